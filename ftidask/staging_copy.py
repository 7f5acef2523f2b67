"""One staging transfer: copy a node-local file to its destination, verified and atomic.

This is the part every mover runs (a thread of the caller, a mover process, an MPI head, a Dask
task), so it only needs plain paths. The copy is written under a temporary name in the destination
directory, fsynced, read back and checked by size and hash against what was read from the source,
then published under its final name; the source is removed only after that. On any failure the
temporary file is removed and :class:`TransferFailed` says why: nothing half-written is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ftiff import hashing
from .storage import fsync_dir

PIECE = 8 << 20
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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StageRequest:
        return cls(int(raw["id"]), str(raw["src"]), str(raw["dst"]), str(raw["tmp"]), int(raw["size"]),
                   str(raw.get("hash", "xxh3_128")))


def temp_name(dst: str, token: str) -> str:
    """The temporary name of a transfer: hidden, in the destination directory, known to the caller.

    The caller (not only the mover) knows it, so that it can remove the leftover of a mover that died.
    """
    head, name = os.path.split(dst)
    return os.path.join(head, f".{name}.ftidask-stage-{token}.tmp")


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


def _publish(tmp: Path, dst: Path) -> None:
    """Give ``tmp`` its final name without ever replacing an existing ``dst``."""
    try:
        os.link(tmp, dst)  # fails if dst exists, unlike rename
    except FileExistsError:
        raise TransferFailed(f"destination {dst} appeared during the transfer; it was left untouched") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # File systems without hard links: check, then rename (a small race, as in FTI).
        if os.path.lexists(dst):
            raise TransferFailed(f"destination {dst} appeared during the transfer; it was left untouched") from None
        os.rename(tmp, dst)
        return
    os.unlink(tmp)


@dataclasses.dataclass(frozen=True)
class TransferResult:
    nbytes: int
    digest: str
    seconds: float


def transfer(req: StageRequest, cancelled: Callable[[], bool] = lambda: False, *,
             throttle: float = 0.0) -> TransferResult:
    """Run ``req``: copy, verify, publish, remove the source. Raises :class:`TransferFailed`.

    ``cancelled`` is polled between pieces (a finalize that timed out); ``throttle`` sleeps that many
    seconds between pieces (to leave disk bandwidth to the application).
    """
    start = time.perf_counter()
    src, dst, tmp = Path(req.src), Path(req.dst), Path(req.tmp)
    hid = hashing.hash_id(req.hash)
    buf = bytearray(PIECE)
    view = memoryview(buf)
    action = f"reading {src}"
    created = False
    try:
        fin = os.open(src, os.O_RDONLY)
        try:
            before = os.fstat(fin)
            if before.st_size != req.size:
                raise TransferFailed(f"source {src} changed since send_file ({req.size} bytes then, "
                                     f"{before.st_size} now)")
            action = f"creating {dst.parent}"
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError:
                raise TransferFailed(f"cannot create {dst.parent}: a component of it is a file, "
                                     "not a directory (ENOTDIR)") from None
            action = f"writing {dst}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # this request's own name: the leftover of an earlier, killed attempt
            fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
                    if throttle:
                        time.sleep(throttle)
                os.fsync(fout)
                # Size and mtime catch an application that rewrites a file it handed over (to the
                # granularity of the file system's clock); the copy itself is checked by hash below.
                after = os.fstat(fin)
                if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or copied != req.size:
                    raise TransferFailed(f"source {src} was modified during the transfer")
                # Verify what reached the disk: drop the cached pages so that the read-back hits storage.
                with contextlib.suppress(AttributeError, OSError):
                    os.posix_fadvise(fout, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fout)
                fout = os.open(tmp, os.O_RDONLY)
                action = f"verifying {dst}"
                size, digest = _hash_file(fout, hid, buf)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        expected = hasher.digest()
        if size != copied or digest != expected:
            raise TransferFailed(f"verification of {dst} failed: {size} bytes with hash {digest.hex()}, "
                                 f"expected {copied} bytes with hash {expected.hex()}")
        if cancelled():
            raise TransferFailed(CANCELLED)
        action = f"publishing {dst}"
        _publish(tmp, dst)
        created = False
        fsync_dir(dst.parent)
        action = f"removing the staged source {src}"
        os.unlink(src)
        return TransferResult(copied, expected.hex(), time.perf_counter() - start)
    except OSError as exc:
        raise TransferFailed(describe_os_error(exc, action)) from None
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
