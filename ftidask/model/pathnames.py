"""What makes a string a path the OS can be given: checked where a user's path enters, so that a bad one is an
ftidask error naming the argument, not a raw ValueError, UnicodeEncodeError or OSError(ENAMETOOLONG) from deep
inside pathlib (which on Python 3.11 raises the last one from ``exists()`` and ``is_dir()``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Linux's limits on one name and on a whole path (every local and parallel file system of the field keeps them).
NAME_MAX, PATH_MAX = 255, 4096


def path_problem(value: Any, room: int = 0) -> str:
    """Why ``value`` cannot name a file ("" if it can): not a str or os.PathLike, empty, holding a NUL, not
    encodable (a lone surrogate), a name over NAME_MAX bytes, or a path over PATH_MAX - 1 - ``room`` bytes
    (``room``: what the caller appends under it)."""
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if not isinstance(value, (str, os.PathLike)):
        return f"expected a path (str or os.PathLike), got {type(value).__name__} {value!r}"[:200]
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        return "an empty path"
    if "\0" in text:
        return "it holds a NUL character"
    try:
        raw = os.fsencode(text)
    except UnicodeError as exc:
        return f"it cannot be encoded for the OS: {exc.reason}"
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > NAME_MAX:
        return f"it holds a name of {longest} bytes: a file system takes names of at most {NAME_MAX}"
    if len(raw) > PATH_MAX - 1 - room:
        return f"it is {len(raw)} bytes long: the OS takes paths of at most {PATH_MAX - 1 - room} bytes here"
    return ""


def checked_path(value: Any, what: str, error: type[Exception], room: int = 0) -> Path:
    """``value`` as a Path, else ``error`` naming ``what`` (the argument) and :func:`path_problem`'s reason."""
    problem = path_problem(value, room)
    if problem:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise error(f"{what}: {shown} cannot be a path: {problem}")
    text = os.fspath(value)
    return Path(os.fsdecode(text) if isinstance(text, bytes) else text)
