"""How files are committed (temporary name, fsync, rename, fsync the directory), removed and collected.

The names of a run's directories and files are :mod:`ftidask.storage.paths` (re-exported here).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, BinaryIO

from . import interrupts
from .paths import (  # noqa: F401 - the names and paths, long imported from here
    SPARE_DIR,
    RunPaths,
    ckpt_dirname,
    find_paths,
    is_inside,
    parity_file,
    partner_file,
    rank_file,
    spare_file,
)
from .removal import (  # noqa: F401 - long imported from here
    TRASH_PREFIX,
    collect_level_garbage,
    discard,
    entry_is_dir,
    move_to_trash,
    prune_empty_dirs,
    remove_inside,
    remove_tree,
)

_COPY_PIECE = 16 << 20
log = logging.getLogger("ftidask")


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``: the names created, renamed or removed in it are then durable."""
    _fsync(path, os.O_DIRECTORY)


def make_durable(path: Path) -> None:
    """fsync the file ``path`` and its directory: what :func:`atomic_file` leaves to do with ``durable=False``."""
    _fsync(path, 0)
    fsync_dir(path.parent)


def _fsync(path: Path, flags: int) -> None:
    with interrupts.held_off():  # Ctrl-C never between the descriptor and the try that closes it
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


try:  # optional native helpers (built when a C compiler is there at install; see setup.py)
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None  # type: ignore[assignment]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + nbytes)`` of ``fd`` to disk now.

    Overlaps the write-back with the work still to do, so the final fsync waits for the tail
    only. A hint: it neither waits nor makes anything durable, and failures are ignored.
    """
    if _native is not None and nbytes > 0:
        with contextlib.suppress(OSError):
            _native.start_writeback(fd, offset, nbytes)


def write_then_writeback(fh: BinaryIO, data: memoryview, min_bytes: int) -> None:
    """Write ``data`` at ``fh``'s position; when it is ``min_bytes`` or more, flush it and have the disk
    start on it now (:func:`start_writeback`) while the caller prepares what comes next."""
    fh.write(data)
    if data.nbytes >= min_bytes:
        fh.flush()
        start_writeback(fh.fileno(), fh.tell() - data.nbytes, data.nbytes)


def drop_cache(path: Path) -> None:
    """Drop the clean cached pages of ``path`` (a hint; failures are ignored)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view[: 256 << 20], offset)
        view, offset = view[n:], offset + n


def rename_into(src: Path, dst: Path) -> None:
    """Publish a complete, fsynced file: rename ``src`` to ``dst`` and sync ``dst``'s directory."""
    makedirs(dst.parent)
    os.replace(src, dst)
    fsync_dir(dst.parent)


#: Modes of the files and directories ftidask creates, by ``[advanced] permissions``: private
#: (the default) or readable by the group; never writable by anyone but the owner.
PERMISSIONS = {"private": (0o600, 0o700), "group": (0o640, 0o750)}
FILE_MODE, DIR_MODE = PERMISSIONS["private"]


def set_permissions(name: str) -> None:
    """Create files and directories with the modes of ``[advanced] permissions = name`` from now on
    (in this process: each MPI rank and Dask worker sets its own)."""
    global FILE_MODE, DIR_MODE
    FILE_MODE, DIR_MODE = PERMISSIONS[name]


def makedirs(path: Path, created: list[Path] | None = None) -> Path:
    """Create ``path`` and its missing parents with :data:`DIR_MODE`; an existing directory is fine.

    A new directory's name is durable only once its parent is fsynced (POSIX; ext4 and XFS commit it with any
    later fsync, other file systems need not, and a commit record could then outlive the directory holding the
    files it names). Each directory created here has its parent fsynced at once, or, when ``created`` is given,
    is appended to it for the caller's :func:`fsync_parents` once what the directory holds is durable (no extra
    wait on a checkpoint's path: the file's fsync has by then committed the creation, the parents' is a flush).
    """
    made: list[Path] = []
    missing: list[Path] = []
    probe = path
    while True:
        try:
            os.mkdir(probe, DIR_MODE)
            made.append(probe)
            break
        except FileExistsError:
            if not probe.is_dir():
                raise
            break
        except FileNotFoundError:
            if probe.parent == probe:
                raise
            missing.append(probe)
            probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(directory, DIR_MODE)
            made.append(directory)
    if created is None:
        fsync_parents(made)
    else:
        created.extend(made)
    return path


def fsync_parents(created: list[Path]) -> None:
    """fsync the parent of each directory in ``created`` (see :func:`makedirs`), each parent once. The parent of
    the topmost one may be the user's: one that cannot be opened for it (no read permission) or a file system
    without directory fsync is passed over, as the directories ftidask makes never are."""
    ours = set(created)
    for parent in dict.fromkeys(directory.parent for directory in created):
        try:
            fsync_dir(parent)
        except OSError as exc:
            if parent in ours or exc.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOTSUP):
                raise


def _sync_at_once(fd: int, directory: Path, created: list[Path], pool: Executor) -> None:
    """fsync ``fd``, its ``directory``, the parents of the directories ``created`` in parallel (0.9 ms in a row, 0.4 at
    once: 2 cores, SSD). POSIX orders none of them; all end before a record names the file (until then: garbage)."""
    others = [pool.submit(fsync_dir, directory)] + ([pool.submit(fsync_parents, created)] if created else [])
    errors = []
    for sync in (functools.partial(os.fsync, fd), *(f.result for f in others)):  # every one waited for
        try:
            sync()
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


#: Flags of a new temporary file: never an existing file, never through a symbolic link.
_NEW_FILE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_temp(path: Path, flags: int = os.O_RDWR) -> tuple[int, Path]:
    """Create a new, empty file beside ``path`` at a hidden temporary name; its descriptor and name.

    ``O_EXCL``: a file or symbolic link already at the name (a leftover of a killed process with
    the same pid, or one planted there) is never opened, let alone followed: a fresh name is used.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    for _attempt in range(16):
        try:
            return os.open(tmp, flags | _NEW_FILE, FILE_MODE), tmp
        except FileExistsError:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    raise FileExistsError(f"no free temporary name beside {path}")


def open_temp(path: Path, mode: str = "w+b") -> tuple[BinaryIO, Path]:
    """A new file object at a temporary name beside ``path`` (:func:`create_temp`), and that name."""
    with interrupts.held_off():  # Ctrl-C never between the descriptor and its file object
        fd, tmp = create_temp(path)
        try:
            return os.fdopen(fd, mode), tmp  # type: ignore[return-value]
        except BaseException:
            os.close(fd)
            raise


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w+b", durable: bool = True,
                sync_pool: Executor | None = None) -> Iterator[BinaryIO]:
    """Yield a file at a temporary name; on success fsync it and rename it to ``path``. ``durable=False``: renamed
    without waiting for the disk; the caller calls :func:`make_durable` before any record names it (the
    directories made for it are then durable at once: a later fsync of a parent would wait for the file's data).
    ``sync_pool`` (threads, for a file that counts once a later record names it): renamed first, then synced in
    parallel (:func:`_sync_at_once`)."""
    created: list[Path] = []
    makedirs(path.parent, created if durable else None)
    fh, tmp = open_temp(path, mode)
    try:
        yield fh  # type: ignore[misc]
        fh.flush()
        if durable and sync_pool is not None:  # renamed first, then every wait for the disk at once
            os.replace(tmp, path)
            _sync_at_once(fh.fileno(), path.parent, created, sync_pool)
            fh.close()
            return
        if durable:
            os.fsync(fh.fileno())
        fh.close()
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
            fsync_parents(created)
    except BaseException as exc:
        # Closing flushes what is buffered: on a full disk it fails again. The temporary file
        # must go all the same, and the error to see is the first one.
        with contextlib.suppress(OSError):
            fh.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise located(exc, path) from None
        raise


def located(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """``exc``, naming ``path`` when it names no file: a failed ``write`` or ``fsync`` (a full disk, EIO) says
    nothing of where, and the user must learn which disk failed."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, os.fspath(path))


def write_json_atomic(path: Path, value: Any) -> bytes:
    """Write ``value`` as JSON at ``path`` atomically (the bytes written); an :class:`OSError`, and nothing written,
    when it would be larger than :data:`MAX_RECORD` (:func:`read_json` would refuse it)."""
    # One line: with an indent json falls back to its Python encoder, 5.5x slower (16 ms against 3 for the commit
    # record of a Dask array of 1024 chunks, written and sealed on the client's path of every checkpoint).
    raw = json.dumps(value, sort_keys=True).encode()
    check_record_size(path, raw)
    with atomic_file(path) as fh:
        fh.write(raw)
    return raw


def check_record_size(path: str | os.PathLike[str], raw: bytes) -> None:
    """Raise :class:`OSError` when ``raw`` is larger than a record ftidask reads back (:data:`MAX_RECORD`)."""
    if len(raw) > MAX_RECORD:
        raise _too_large(path, len(raw))


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor on the regular file ``path``, opened with ``flags``; an :class:`OSError` when it is anything
    else. A FIFO planted in a checkpoint tree would block an ``open`` for ever (no writer comes) and a device
    (a link to ``/dev/zero``) never ends: both are refused here, without blocking (``O_NONBLOCK``)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise OSError(errno.EISDIR if stat.S_ISDIR(kind) else errno.EINVAL,
                          "a directory, not a file" if stat.S_ISDIR(kind) else "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_read(path: str | os.PathLike[str], buffering: int = -1) -> BinaryIO:
    """``open(path, "rb")`` for a file of a checkpoint tree: a regular file only (:func:`open_regular`)."""
    with interrupts.held_off():  # Ctrl-C never between the descriptor and its file object
        fd = open_regular(path)
        try:
            return open(fd, "rb", buffering=buffering)
        except BaseException:
            os.close(fd)
            raise


#: The largest JSON record ftidask writes or reads (commit records, hash records, run state, a Zarr store's
#: manifest): a Dask commit record lists every chunk (about 75 bytes each), so millions of chunks fit. A record
#: forged larger (a sparse file costs nothing on disk) is refused before it is read, never allocated.
MAX_RECORD = 256 << 20


def _too_large(path: str | os.PathLike[str], size: int) -> OSError:
    return OSError(errno.EFBIG, f"{size} bytes, larger than the {MAX_RECORD} bytes of any ftidask record",
                   os.fspath(path))


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`: an :class:`OSError` for anything else,
    and for a file of more than :data:`MAX_RECORD` bytes)."""
    with open_read(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_RECORD:  # before any read: nothing of its size is allocated
            raise _too_large(path, size)
        raw = fh.read(size + 1)  # bounded even if it grows meanwhile (read(n) allocates n bytes first)
        if len(raw) > size:  # it did: read what is there now, as before, up to the limit
            raw += fh.read(MAX_RECORD + 1 - len(raw))
    if len(raw) > MAX_RECORD:
        raise _too_large(path, len(raw))
    return raw


#: JSON nesting a record may have: ftidask's own nest a few levels (a Dask record's structured dtypes a few more).
MAX_NESTING = 100


def read_json(path: Path) -> Any | None:
    """The JSON at ``path``, or None when it is missing or unreadable (a torn or damaged record, one larger
    than :data:`MAX_RECORD`, not a regular file: :func:`open_regular`, or nested deeper than :data:`MAX_NESTING`:
    JSON parses nesting up to Python's recursion limit, which code that walks the value recursively, a record's
    ``dataclasses.asdict`` or a message's ``str()``, then exceeds: a RecursionError far from the read)."""
    try:
        raw = read_regular(path)
    except OSError:
        return None
    return json_of(raw)


def json_of(raw: bytes) -> Any | None:
    """The JSON value of ``raw``, a file's bytes, as :func:`read_json` reads it (None when it is not JSON)."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return value if nested_within(value, MAX_NESTING) else None


def nested_within(value: Any, depth: int) -> bool:
    """Whether the JSON value ``value`` nests lists and objects at most ``depth`` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            if level > depth:
                return False
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def copy_file_atomic(src: Path, dst: Path) -> int:
    """Copy ``src`` to ``dst`` atomically; the bytes copied. A read or write error names both files."""
    with open_read(src) as fin, atomic_file(dst) as fout:
        try:
            copied = 0
            while True:
                n = os.sendfile(fout.fileno(), fin.fileno(), copied, _COPY_PIECE) if hasattr(os, "sendfile") else 0
                if n == 0:
                    break
                copied += n
            if copied == 0 and os.fstat(fin.fileno()).st_size:
                shutil.copyfileobj(fin, fout, _COPY_PIECE)
                copied = os.fstat(fin.fileno()).st_size
            fout.flush()  # here, where a full disk is still this copy's error
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, os.fspath(src), None, os.fspath(dst)) from None
        return copied
