"""Which runs are live: a lock that a run holds for its lifetime, and one taken while a run is chosen.

A run's writer (the single process, MPI rank 0, the Dask client) holds an exclusive ``flock`` on
``{meta_dir}/{exec_id}/run.lock`` from init to finalize. The kernel releases it when the process
dies, however it dies, so "the lock is free" means "nobody writes this run": only such a run may be
adopted by a restart. Every init chooses its run while holding ``{meta_dir}/current_exec_id.lock``,
so that two inits starting together never both adopt the same dead run.

Within one process, inits of the same run share its lock (a re-init, as when a notebook's init cell
runs again, is a restart, as it always was): the lock guards against other processes, and is released
when the last Context of this process that holds it is finalized, closed or garbage collected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from . import files as storage
from . import interrupts

log = logging.getLogger("ftidask")

LOCK_NAME = "run.lock"
CHOOSING_NAME = "current_exec_id.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class _Flock:
    """One open, locked lock file of this process, shared by the :class:`RunLock` handles on it."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.users = 0
        self.said = False  # whether a lock file that cannot be locked again was said (lock_again)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class RunLock:
    """One Context's hold on a run's lock, released by :meth:`release` (or garbage collection)."""

    def __init__(self, flock: _Flock, path: Path) -> None:
        self._flock: _Flock | None = flock
        self.path = path
        self._key = _key(path.parent)
        flock.users += 1

    @property
    def held(self) -> bool:
        """Whether this handle still holds the lock (not yet released)."""
        return self._flock is not None

    def release(self) -> None:
        """Let go of the lock (idempotent); the file lock is unlocked once no handle of this process holds it."""
        flock, self._flock = self._flock, None
        if flock is not None:
            flock.users -= 1
            if flock.users == 0:
                if _held.get(self._key) is flock:
                    del _held[self._key]
                flock.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit, the kernel releases it anyway
            self.release()


#: The runs this process holds, by the real path of their directory.
_held: dict[str, _Flock] = {}


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def _open(path: Path, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    return os.open(path, flags, storage.FILE_MODE)


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


_RECORD_SIZE = 256  # bytes of the holder's record in the lock file (longer when a host name needs it)


def acquire(run_dir: Path) -> RunLock | None:
    """Lock the run in ``run_dir`` (created if needed) for this process; None when another live process holds it."""
    path = run_dir / LOCK_NAME
    storage.makedirs(run_dir)
    shared = _held.get(_key(run_dir))
    if shared is not None and shared.fd is not None:  # a Context of this process holds it: shared
        return RunLock(shared, path)
    key, fd, flock = _key(run_dir), -1, None
    try:  # closed on any exception (a Ctrl-C between flock and _held leaked a lock this process then held for good)
        with interrupts.held_off():
            fd = _open(path, create=True)
            if not _flock(fd, path):
                fd = os.close(fd) or -1
                return None
            flock = _held[key] = _Flock(fd)
        _write_holder(fd)
        return RunLock(flock, path)
    except BaseException:
        if flock is None:
            if fd >= 0:
                os.close(fd)
        elif flock.users == 0:  # no handle holds it yet
            if _held.get(key) is flock:
                del _held[key]
            flock.close()
        raise


def _write_holder(fd: int) -> None:
    """Who holds the lock, for the error a second writer gets (only read while the lock is held): written over the
    last holder's record, padded to a fixed size, so that the file need not be truncated first (a truncation waits
    for the file system's journal: 13 ms of a restart's init here, when the disk was busy)."""
    with contextlib.suppress(OSError):
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        record += b" " * (_RECORD_SIZE - len(record))  # JSON allows trailing white space
        os.pwrite(fd, record, 0)
        if os.fstat(fd).st_size > len(record):  # not one of ours (a host name of over 200 bytes): cut
            os.ftruncate(fd, len(record))


def lock_again(run_dir: Path) -> None:
    """Where this process holds the run in ``run_dir`` but its lock file was removed or replaced under it (a cleaner
    of /tmp took the meta_dir while the run lived): lock the file now at its path. Else a second program found no
    lock, adopted the live run and finalized it, and the live run's next commits went into a finalized run."""
    flock = _held.get(_key(run_dir))
    if flock is None or flock.fd is None:
        return
    path = run_dir / LOCK_NAME
    try:
        now, held = os.stat(path), os.fstat(flock.fd)
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return
    except OSError:  # gone, or a link loop planted there: locked again below if it can be
        pass
    fd = -1
    try:  # never fails the commit that called it (written already): a lock file replaced by a directory or a link
        with interrupts.held_off():
            fd = _open(path, create=True)
            if not _flock(fd, path):
                fd = os.close(fd) or -1
                log.warning("the lock file %s of this live run was removed, and another process has locked it "
                            "since: two programs may now write this run", path)
                return
            old, flock.fd, fd = flock.fd, fd, -1
            os.close(old)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if not flock.said:  # once, not at every commit
            flock.said = True
            log.warning("the lock file %s of this live run was removed or replaced and cannot be locked again (%s): "
                        "another program may take this run for a dead one", path, exc)
        return
    _write_holder(flock.fd)
    log.warning("the lock file %s of this live run was removed during the run: it is locked again", path)


def take_dead(run_dir: Path) -> RunLock | None:
    """Lock the run in ``run_dir`` for this process when it is provably dead: its lock file exists and no process
    holds it, this one included. None otherwise, and on a file system without locks (nothing is provably dead
    there). What removes a dead run's files holds this meanwhile: no init adopts or restarts the run under it."""
    if held_here(run_dir):
        return None
    path = run_dir / LOCK_NAME
    with interrupts.held_off():  # the descriptor never left open by a Ctrl-C between its steps
        try:
            fd = _open(path, create=False)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (BlockingIOError), or not supported
            os.close(fd)
            return None
        return RunLock(_Flock(fd), path)  # not shared with an init of this process: that one is refused meanwhile


def held_here(run_dir: Path) -> bool:
    """Whether a Context of this process holds the run in ``run_dir``."""
    shared = _held.get(_key(run_dir))
    return shared is not None and shared.fd is not None


def is_live(run_dir: Path) -> bool:
    """Whether another live process holds the run in ``run_dir`` (a run without a lock file is not live)."""
    if held_here(run_dir):
        return False  # this process's own run
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
    info = _record(run_dir)
    return "an unknown process" if info is None else f"pid {info[0]} on host {info[1]}"


def last_holder_here(run_dir: Path) -> bool:
    """Whether the run's lock file names a process of this host as its last holder. A lock that this host could
    take proves that holder dead only then: on a file system whose locks are node-local (Lustre's ``localflock``),
    a live run on another node holds a lock this host does not see."""
    info = _record(run_dir)
    return info is not None and info[1] == socket.gethostname()


def _record(run_dir: Path) -> tuple[int, str] | None:
    """(pid, host) of the lock file's holder record; None when unreadable."""
    try:
        info = json.loads(storage.read_regular(run_dir / LOCK_NAME).decode("utf-8"))
        return int(info["pid"]), str(info["host"])
    # RecursionError: JSON nested too deep; OverflowError: int() of JSON's Infinity (a lock file written by anyone)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, OverflowError):
        return None


class choosing:  # noqa: N801 - used as a function: ``with choosing(meta_dir):``
    """Hold ``{meta_dir}/current_exec_id.lock`` (waiting for it): one init chooses its run at a time.

    A class, not a generator: a Ctrl-C once a generator had taken the lock (in contextlib's ``__enter__``) left the
    lock to a suspended generator that the notebook's kept traceback never closed; every later init waited for it.
    Here any exception out of ``__enter__`` lets the lock go first."""

    def __init__(self, meta_dir: Path) -> None:
        self.path, self.fd = meta_dir / CHOOSING_NAME, -1

    def __enter__(self) -> None:
        try:
            with interrupts.held_off():  # Ctrl-C never between the descriptor and the name that closes it
                self.fd = _open(self.path, create=True)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED and self.fd >= 0:
                return  # a file system without locks: as before
            self._close()
            raise
        except BaseException:
            self._close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
