"""Refuse run directories that someone else could write to, as ssh refuses such key files.

A checkpoint recovered from a directory that another user can write to (or owns) may be forged,
and a commit record there may name files of that user's choice. So every directory ftidask uses
that already exists (the configured ``ckpt_dir``, ``glbl_dir``, ``meta_dir`` and the run's own
directories below them, never their ancestors: ``/tmp`` itself is world-writable) must be owned
by this user (or root) and not writable by its group or by others.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..model.errors import ConfigError
from .files import SPARE_DIR, RunPaths

_NOT_A_DIR = "exists and is not a directory"


def unsafe_dirs(dirs: Iterable[Path], need_dirs: bool = False) -> list[str]:
    """Why each existing directory of ``dirs`` is not safe to use (empty: all are safe); with ``need_dirs``, an
    existing path of ``dirs`` that is not a directory too."""
    uid = os.geteuid()
    problems = []
    for path in dirs:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # created by ftidask, with private modes (storage.makedirs)
        except OSError as exc:
            problems.append(f"{path}: cannot be checked ({exc.strerror or exc})")
            continue
        if not stat.S_ISDIR(st.st_mode):  # the configured ones: refused at init, not at the first checkpoint
            if need_dirs:
                problems.append(f"{path} {_NOT_A_DIR}")
            continue  # below them: makedirs reports it when it is needed
        if st.st_uid not in (uid, 0):
            problems.append(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})")
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                               if st.st_mode & bit)
            problems.append(f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})")
    return problems


def run_dirs(paths: RunPaths, node: int, records_dir: Path) -> list[Path]:
    """The directories of one run that this process uses (its node's local ones)."""
    node_dir = paths.node_dir(node)
    levels = [paths.local_dir(level, node) for level in (1, 2, 3, 4)] + [paths.level_dir(4, node)]
    return [node_dir.parent, node_dir, *levels, *(d / SPARE_DIR for d in levels),
            paths.ckpt_dir / "stage", paths.stage_root, paths.glbl_dir / paths.exec_id, paths.run_meta, records_dir]


def check(transport: Any, dirs: Iterable[Path], need_dirs: bool = False) -> None:
    """Raise :class:`ConfigError` on every rank when any rank finds an unsafe directory in ``dirs`` (or, with
    ``need_dirs``, a path of ``dirs`` that is a file)."""
    problems = sorted({p for mine in transport.allgather(unsafe_dirs(dirs, need_dirs)) for p in mine})
    files = [p for p in problems if p.endswith(_NOT_A_DIR)]
    if files:
        raise ConfigError(f"a run directory is a file: {'; '.join(files)}; give ckpt_dir, glbl_dir and meta_dir "
                          "directories (or paths that do not exist yet: ftidask creates them)")
    if problems:
        raise ConfigError(explain(problems))


def explain(problems: list[str]) -> str:
    """The message of the error that refuses ``problems``."""
    return ("refusing run directories that another user could write to (a checkpoint there could be "
            "forged): " + "; ".join(problems) + ". Use directories of your own that only you can write to "
            "(chmod go-w), or remove these so that ftidask creates them.")
