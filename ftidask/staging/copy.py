"""One staging transfer: copy a node-local file to its destination, verified and atomic.

This is the part every mover runs (a thread of the caller, a mover process, an MPI head, a Dask
task), so it only needs plain paths. The copy is written under a temporary name in the destination
directory, fsynced, read back and checked by size and hash against what was read from the source,
then published under its final name; the source is removed only after that. On any failure the
temporary file is removed and :class:`TransferFailed` says why: nothing half-written is left.

Paths are checked by ``send_file`` and may change before the copy: every directory of the source
and the destination is opened again here one component at a time, relative to its parent's
descriptor and without following symbolic links (all were resolved when the request was checked),
so a directory or a source swapped for a link meanwhile fails the transfer instead of copying
outside ``glbl_dir`` or copying a foreign file in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import time
from collections.abc import Callable
from typing import Any, ContextManager

from ..ftiff import hashing

PIECE = 8 << 20
NAME_MAX = 255  # bytes in a file name, on every file system Linux runs ftidask on
#: The reason of a transfer stopped by its owner (a finalize past ``stage_timeout``, or an exit without one).
CANCELLED = "cancelled: not finished when staging stopped (finalize after stage_timeout, or exit without finalize)"


class TransferFailed(Exception):
    """A transfer failed; the message is the reason reported with FTI_SI_FAIL."""


@dataclasses.dataclass(frozen=True)
class StageRequest:
    """What a mover needs to run one request; JSON-able for movers in other processes."""

    id: int
    src: str
    dst: str
    tmp: str
    size: int
    hash: str = "xxh3_128"
    file_mode: int = 0o600  # of the published file and the directories created ([advanced] permissions)
    dir_mode: int = 0o700

    def to_json(self) -> dict[str, Any]:
        """The request as a JSON-able dict (what a mover in another process receives)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StageRequest:
        """The request ``raw`` describes (its modes kept to permission bits)."""
        return cls(int(raw["id"]), str(raw["src"]), str(raw["dst"]), str(raw["tmp"]), int(raw["size"]),
                   str(raw.get("hash", "xxh3_128")), int(raw.get("file_mode", 0o600)) & 0o777,
                   int(raw.get("dir_mode", 0o700)) & 0o777)


def temp_name(dst: str, token: str) -> str:
    """The temporary name of a transfer: hidden, in the destination directory, known to the caller.

    The caller (not only the mover) knows it, so that it can remove the leftover of a mover that died.
    """
    head, name = os.path.split(dst)
    tail = f".ftidask-stage-{token}.tmp"
    # A destination's name may be as long as the file system takes; the journal's note has the temporary name,
    # itself written at a temporary name first (storage.create_temp's ".tmp-{pid}-{8 hex}", 24 bytes at most).
    room = NAME_MAX - 1 - len(tail.encode()) - 24
    short = os.fsdecode(os.fsencode(name)[:room])  # unique all the same: the token is
    return os.path.join(head, f".{short}{tail}")


def describe_os_error(exc: OSError, action: str) -> str:
    """A one-line reason such as ``writing /g/x: File too large (EFBIG)``."""
    name = errno.errorcode.get(exc.errno or 0, "")
    what = exc.strerror or str(exc)
    return f"{action}: {what}" + (f" ({name})" if name else "")


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _hash_file(fd: int, hid: int, buf: bytearray) -> tuple[int, bytes]:
    """Size and digest of an open file, read from the start."""
    os.lseek(fd, 0, os.SEEK_SET)
    hasher = hashing.new_hasher(hid)
    total = 0
    view = memoryview(buf)
    while True:
        n = os.readv(fd, [view])
        if n == 0:
            return total, hasher.digest()
        hasher.update(view[:n])
        total += n


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Swapped(Exception):
    """A path component that was a directory when the request was checked is a link now."""


def open_regular(name: str, dir_fd: int) -> int:
    """Open ``name`` in ``dir_fd`` to read, never following a link, and without blocking: a FIFO put in the file's
    place since send_file would block open() until some process wrote to it (the mover stuck for ever, the requests
    behind it too); the caller then finds it is no regular file. Blocking again once open (a regular file)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    with contextlib.suppress(OSError):
        os.set_blocking(fd, True)
    return fd


def _open_dir(path: str, create_mode: int | None = None) -> int:
    """Open the directory ``path`` (absolute and free of links when the request was checked) from
    ``/`` one component at a time, following no symbolic link; create the missing ones with
    ``create_mode`` (None: none may be missing), each one's parent fsynced. Raises :class:`_Swapped` for a link."""
    fd = os.open("/", _DIR)
    done = "/"
    try:
        for name in [part for part in path.split(os.sep) if part]:
            done = os.path.join(done, name)
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                with contextlib.suppress(FileExistsError):  # another mover made it meanwhile
                    os.mkdir(name, create_mode, dir_fd=fd)
                os.fsync(fd)  # the new name durable before the staged source is removed
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and stat.S_ISLNK(
                        os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)):
                    raise _Swapped(done) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _publish(tmp: str, dst: str, dir_fd: int) -> None:
    """Give ``tmp`` its final name ``dst`` (both in ``dir_fd``) without ever replacing an existing one."""
    try:
        os.link(tmp, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)  # fails if dst exists
    except FileExistsError:
        raise TransferFailed(f"destination {dst} appeared during the transfer; it was left untouched") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # File systems without hard links: check, then rename (a small race, as in FTI).
        try:
            os.stat(dst, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(tmp, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        raise TransferFailed(f"destination {dst} appeared during the transfer; it was left untouched") from None
    os.unlink(tmp, dir_fd=dir_fd)


@dataclasses.dataclass(frozen=True)
class TransferResult:
    """A completed transfer: the bytes copied, their digest as read back at the destination, the time taken."""

    nbytes: int
    digest: str
    seconds: float


def transfer(req: StageRequest, cancelled: Callable[[], bool] = lambda: False,
             publishing: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> TransferResult:
    """Run ``req``: copy, verify, publish, remove the source. Raises :class:`TransferFailed`.

    ``cancelled`` is polled between pieces (a finalize that timed out) and before the publication, which runs inside
    ``publishing()`` (the Dask mover's: under the run's fence, so that a dead client's copy never publishes once a
    new client writes the run; it raises :class:`TransferFailed` then).
    """
    start = time.perf_counter()
    src_dir, src_name = os.path.split(req.src)
    dst_dir, dst_name = os.path.split(req.dst)
    tmp_name = os.path.basename(req.tmp)
    hid = hashing.hash_id(req.hash)
    buf = bytearray(PIECE)
    view = memoryview(buf)
    action = f"reading {req.src}"
    sfd = dfd = -1
    created = False
    try:
        sfd = _open_dir(src_dir)
        try:
            fin = open_regular(src_name, sfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _Swapped(req.src) from None
            raise
        try:
            before = os.fstat(fin)
            if not stat.S_ISREG(before.st_mode):
                raise TransferFailed(f"source {req.src} is no longer a regular file")
            if before.st_size != req.size:
                raise TransferFailed(f"source {req.src} changed since send_file ({req.size} bytes then, "
                                     f"{before.st_size} now)")
            action = f"creating {dst_dir}"
            try:
                dfd = _open_dir(dst_dir, req.dir_mode)
            except NotADirectoryError:
                raise TransferFailed(f"cannot create {dst_dir}: a component of it is a file, "
                                     "not a directory (ENOTDIR)") from None
            action = f"writing {req.dst}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dfd)  # this request's own name: the leftover of an earlier, killed attempt
            fout = os.open(tmp_name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           req.file_mode, dir_fd=dfd)
            created = True
            try:
                hasher = hashing.new_hasher(hid)
                copied = 0
                while True:
                    if cancelled():
                        raise TransferFailed(CANCELLED)
                    n = os.readv(fin, [view])
                    if n == 0:
                        break
                    hasher.update(view[:n])
                    _write_all(fout, view[:n])
                    copied += n
                os.fsync(fout)
                # Size and mtime catch an application that rewrites a file it handed over (to the
                # granularity of the file system's clock); the copy itself is checked by hash below.
                after = os.fstat(fin)
                if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or copied != req.size:
                    raise TransferFailed(f"source {req.src} was modified during the transfer")
                # Verify what reached the disk: drop the cached pages so that the read-back hits storage.
                with contextlib.suppress(AttributeError, OSError):
                    os.posix_fadvise(fout, 0, 0, os.POSIX_FADV_DONTNEED)
                action = f"verifying {req.dst}"
                size, digest = _hash_file(fout, hid, buf)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        expected = hasher.digest()
        if size != copied or digest != expected:
            raise TransferFailed(f"verification of {req.dst} failed: {size} bytes with hash {digest.hex()}, "
                                 f"expected {copied} bytes with hash {expected.hex()}")
        if cancelled():
            raise TransferFailed(CANCELLED)
        action = f"publishing {req.dst}"
        with publishing():
            _publish(tmp_name, dst_name, dfd)
            created = False
        os.fsync(dfd)
        action = f"removing the staged source {req.src}"
        # Published already: a source the application removed itself meanwhile is the outcome asked for, not a
        # failure (SI_FAIL would say that the destination holds nothing of it).
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(src_name, dir_fd=sfd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino):  # never another file put there meanwhile
                os.unlink(src_name, dir_fd=sfd)
        return TransferResult(copied, expected.hex(), time.perf_counter() - start)
    except _Swapped as exc:
        raise TransferFailed(f"{exc} was replaced by a symbolic link after send_file checked it; nothing was "
                             "copied through it") from None
    except OSError as exc:
        raise TransferFailed(describe_os_error(exc, action)) from None
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name, dir_fd=dfd)
        for fd in (sfd, dfd):
            if fd >= 0:
                os.close(fd)
