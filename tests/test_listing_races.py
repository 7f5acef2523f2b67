"""A directory removed by someone else while it is listed (another rank of the node tidying the same stage
directory, a store clearing its spares): skipped, never a FileNotFoundError out of a clean-up. Python 3.11's
``Path.glob`` checks that a directory exists, then lists it, and lets the error out if it went in between; the
listings are ``os.scandir`` in a ``try`` now. Each race is forced by removing the directory just before it is
listed (both listing paths are patched: pathlib's, which the code used, and ``os.scandir``)."""

from __future__ import annotations

import os
import pathlib
import shutil
from pathlib import Path

import pytest

from ftidask.staging import journal
from ftidask.storage import removal


@pytest.fixture
def removed_when_listed(monkeypatch):
    """``{name: k}``: the directory ``name`` removed (by "another process") the moment it is listed the k-th time."""
    names: dict[str, int] = {}
    seen: dict[str, int] = {}
    path_scandir, os_scandir = pathlib.Path._scandir, os.scandir

    def maybe_remove(path) -> None:
        name = Path(path).name
        if name in names:
            seen[name] = seen.get(name, 0) + 1
            if seen[name] == names[name]:
                shutil.rmtree(path, ignore_errors=True)

    def path_listing(self):
        maybe_remove(self)
        return path_scandir(self)

    def os_listing(path="."):
        if isinstance(path, (str, os.PathLike)):  # (rmtree lists by descriptor)
            maybe_remove(path)
        return os_scandir(path)

    monkeypatch.setattr(pathlib.Path, "_scandir", path_listing)
    monkeypatch.setattr(removal.os, "scandir", os_listing)
    return names


def test_spares_directory_removed_while_collected(tmp_path, removed_when_listed):
    level = tmp_path / "l1"
    (level / "dcp" / ".trash-Spare-Rank0.fti-1-aa").mkdir(parents=True)
    removed_when_listed["dcp"] = 2  # listed for its temporaries first, then for its trash
    assert removal.collect_level_garbage(level, set(), trash=True, spares=True) == 0


def test_stage_directory_removed_while_tidied(tmp_path, removed_when_listed):
    stage = tmp_path / "stage" / "run"
    (stage / "node0" / ".rank1-transfers").mkdir(parents=True)
    removed_when_listed["node0"] = 1
    assert journal.tidy_stage(stage, tmp_path / "glbl", "node0") == 0
