"""Test helper: count the files a recovery's search verifies."""

from __future__ import annotations

from ftidask.engine import recovering


def counting_checks(monkeypatch) -> list[str]:
    """The files a recovery's search verifies (every byte hashed), in order, from now on."""
    checked: list[str] = []
    check = recovering.check_file

    def counted(path, *args, **kwargs):
        checked.append(str(path))
        return check(path, *args, **kwargs)

    monkeypatch.setattr(recovering, "check_file", counted)
    return checked
