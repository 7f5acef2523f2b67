"""Which runs are live: a lock that a run holds for its lifetime, and one taken while a run is chosen.

A run's writer (the single process, MPI rank 0, the Dask client) holds an exclusive ``flock`` on
``{meta_dir}/{exec_id}/run.lock`` from init to finalize. The kernel releases it when the process
dies, however it dies, so "the lock is free" means "nobody writes this run": only such a run may be
adopted by a restart. Every init chooses its run while holding ``{meta_dir}/current_exec_id.lock``,
so that two inits starting together never both adopt the same dead run.

Within one process, a later init of a run that a Context of this process holds replaces that
Context (as a restart would: re-running a notebook's init cell); the older one refuses further use.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("ftidask")

LOCK_NAME = "run.lock"
CHOOSING_NAME = "current_exec_id.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """An exclusive ``flock`` on a run's lock file, held until :meth:`release` (or garbage collection)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __del__(self) -> None:
        self.release()


def _open(path: Path, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o644)


def _flock(fd: int, path: Path) -> bool:
    """Lock ``fd`` without waiting; False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise
        # A file system without locks: runs sharing this directory cannot be told apart (as before).
        log.warning("cannot lock %s (%s): live runs sharing this meta_dir are not detected", path, exc)
    return True


def acquire(run_dir: Path) -> RunLock | None:
    """Lock the run in ``run_dir`` (created if needed) for this process; None when a live process holds it."""
    path = run_dir / LOCK_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _open(path, create=True)
    if not _flock(fd, path):
        os.close(fd)
        return None
    # Who holds it, for the error a second writer gets (only read while the lock is held).
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    return RunLock(fd, path)


def is_live(run_dir: Path) -> bool:
    """Whether a live process holds the run in ``run_dir`` (a run without a lock file is not live)."""
    path = run_dir / LOCK_NAME
    try:
        fd = _open(path, create=False)
    except OSError:
        return False
    try:
        return not _flock(fd, path)
    finally:
        os.close(fd)


def holder(run_dir: Path) -> str:
    """``"pid N on host H"`` of the process that holds the run's lock, as far as its lock file says."""
    try:
        info = json.loads((run_dir / LOCK_NAME).read_text(encoding="utf-8"))
        return f"pid {int(info['pid'])} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process"


@contextlib.contextmanager
def choosing(meta_dir: Path) -> Iterator[None]:
    """Hold ``{meta_dir}/current_exec_id.lock`` (waiting for it): one init chooses its run at a time."""
    path = meta_dir / CHOOSING_NAME
    fd = _open(path, create=True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
        yield
    finally:
        os.close(fd)


# --- Contexts of this process, by run directory: a later init of the same run replaces the older one ---

_owners: dict[str, weakref.ref[Any]] = {}


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def supersede_local(run_dir: Path) -> bool:
    """Retire the open Context of this process that holds ``run_dir`` (it releases the lock); whether one did."""
    ref = _owners.pop(_key(run_dir), None)
    owner = ref() if ref is not None else None
    if owner is None or getattr(owner, "_closed", True):
        return False
    owner._supersede()
    return True


def take_over(run_dir: Path, owner: Any) -> None:
    """Register ``owner`` (a Context) as this process's handle on ``run_dir``; an older one is superseded."""
    ref = _owners.get(_key(run_dir))
    if ref is not None and ref() is not owner:
        supersede_local(run_dir)
    _owners[_key(run_dir)] = weakref.ref(owner)
