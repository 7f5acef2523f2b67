"""A file's data written around the page cache (``O_DIRECT``), from aligned buffers.

Why: with several processes checkpointing onto one disk at once, buffered writes reach the device at the pace of
the kernel's write-back, which varies from one run to the next; writes that go straight from the process's buffers
keep the device busy with large requests and copy each byte once fewer times (the private copy that is hashed is
written from where it is, not copied again into the page cache). ``benchmarks/bench_direct_io.py`` measures both.

``O_DIRECT`` asks the buffer's address, the file offset and the length to be multiples of the device's logical
block: :data:`ALIGN` (4096) covers the usual 512 and 4096. A :class:`DirectStream` takes the file's data at
increasing offsets: large pieces the caller copied into an aligned buffer of its own at their offset within a block
(:meth:`DirectStream.write_from`: written from there), small ones copied into the stream's buffer
(:meth:`DirectStream.write`). A block two writes share (the end of one piece, the start of the next) is carried
from one to the other; gaps are zeros; the last partial block goes through the page cache. What the caller writes
next through the page cache (metadata in the gaps, the bytes after the data) goes after :meth:`DirectStream.close`,
which has waited for every direct write: a partial page is then read back from the disk and updated there, never
overwritten by a direct write still in flight.

``O_DIRECT`` is set on the caller's descriptor for the stream's life (``fcntl``) and cleared by ``close``. A file
system that refuses it (tmpfs before Linux 6.6, some FUSE mounts) refuses at ``fcntl`` or at the first write with
``EINVAL``: the stream then writes the same bytes through the page cache. No durability is implied: the caller's
``fsync`` is still what makes the file durable.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

ALIGN = 4096
BUFFER = 1 << 20  # the stream's own buffers (small pieces): each written whole in one request
_DEPTH = 2  # of those, writes in flight (threads); one more buffer is being filled
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, threads): a forked child makes its own
_free: list[np.ndarray] = []  # buffers kept for the next file (no page faults), at most _DEPTH + 1


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():  # a pool inherited through fork() has no threads
            _pool = (os.getpid(), ThreadPoolExecutor(_DEPTH, thread_name_prefix="ftidask-direct"))
        return _pool[1]


def aligned(n: int) -> np.ndarray:
    """A new buffer of ``n`` bytes whose address is a multiple of :data:`ALIGN`."""
    raw = np.empty(n + ALIGN, np.uint8)
    lo = (-raw.ctypes.data) % ALIGN
    return raw[lo:lo + n]


def _acquire() -> np.ndarray:
    with _lock:
        if _free:
            return _free.pop()
    return aligned(BUFFER)


def _release(buf: np.ndarray) -> None:
    with _lock:
        if len(_free) <= _DEPTH:
            _free.append(buf)


def _set_direct(fd: int, on: bool) -> bool:
    """Set or clear ``O_DIRECT`` on ``fd``: whether it is now as asked."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
        return True
    except OSError:
        return False


def open_stream(fd: int) -> DirectStream | None:
    """A stream writing ``fd``'s data around the page cache, or None where this system cannot (then write as
    usual). ``fd`` must be open for writing, its file new: nothing of it in the page cache."""
    if not _O_DIRECT or not _set_direct(fd, True):
        return None
    return DirectStream(fd)


class DirectStream:
    """The data of one file, written at increasing offsets (see the module's docstring); use :func:`open_stream`."""

    def __init__(self, fd: int) -> None:
        self.fd, self.direct = fd, True
        self.base, self.fill = -1, 0  # the buffer being filled holds the file's bytes [base, base + fill)
        self.buf: np.ndarray | None = None
        self.inflight: deque[tuple[Future[None], np.ndarray]] = deque()
        self.outside: list[Future[None]] = []  # writes from the caller's buffers (write_from)
        self.end = 0  # where the data written so far ends

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` (contiguous bytes) at ``offset`` (never before the end of the bytes already written)."""
        src = np.frombuffer(data, np.uint8)
        if offset < self.end:
            raise ValueError(f"direct writes go forward: {offset} is before {self.end}")
        if self.buf is None or offset - self.base >= BUFFER:  # not in this buffer: it goes, a new one starts
            self._submit()
            self._start(offset - offset % ALIGN)
        buf = self.buf
        assert buf is not None
        buf[self.fill:offset - self.base] = 0  # a gap (metadata written later, or a hole): zeros
        self.fill, pos = offset - self.base, 0
        while pos < src.size:
            n = min(src.size - pos, BUFFER - self.fill)
            np.copyto(buf[self.fill:self.fill + n], src[pos:pos + n])
            self.fill, pos = self.fill + n, pos + n
            if self.fill == BUFFER:
                self._submit()
                self._start(self.base + BUFFER)
                buf = self.buf
                assert buf is not None
        self.end = offset + src.size

    def write_from(self, offset: int, buf: np.ndarray, n: int) -> Future[None] | None:
        """Write the ``n`` bytes at ``offset`` that the caller copied into ``buf`` (from :func:`aligned`) at
        ``offset % ALIGN``: written from ``buf`` by the stream's threads; ``buf[:offset % ALIGN]`` is overwritten (the
        bytes before, in the same block), the partial block at the end is kept by the stream. The write's future
        (None: nothing of ``buf`` to write): ``buf`` is the stream's until it is done (a failure raises at
        :meth:`close` too)."""
        pad = offset % ALIGN
        if offset < self.end:
            raise ValueError(f"direct writes go forward: {offset} is before {self.end}")
        head, staged = offset - pad, self.buf
        if staged is not None and self.fill % ALIGN and self.base + self.fill - self.fill % ALIGN == head:
            part = self.fill % ALIGN  # the stream's last block is this one's first: carried into ``buf``
            buf[:part] = staged[self.fill - part:self.fill]
            buf[part:pad] = 0
            self.fill -= part
        else:
            buf[:pad] = 0
        self._submit()
        end = pad + n
        whole = end - end % ALIGN
        future = None
        if whole:  # two in flight at most (the threads): the caller fills its next buffer meanwhile
            future = _threads().submit(self._pwrite, memoryview(buf[:whole]), head)
            self.outside.append(future)
        if end % ALIGN:  # the partial last block: kept, the next write may share it
            self._start(head + whole)
            assert self.buf is not None
            self.buf[:end - whole] = buf[whole:end]
            self.fill = end - whole
        self.end = offset + n
        return future

    def close(self) -> None:
        """Write what is left, wait for every write, clear ``O_DIRECT``. The last partial block is written through the
        page cache then: the file ends where its data ends (no padding to cut, a truncation waits for the journal)."""
        tail = None
        try:
            if self.buf is not None and self.fill % ALIGN:
                part = self.fill % ALIGN
                tail = (self.base + self.fill - part, self.buf[self.fill - part:self.fill].tobytes())
                self.fill -= part
            self._submit()
            self._wait(0)
            for future in self.outside:
                future.result()
        finally:
            self.abort()
        if tail is not None:
            if self.direct:  # O_DIRECT could not be cleared: the partial block cannot be written
                raise OSError(errno.EINVAL, "cannot clear O_DIRECT to write the last partial block")
            _pwrite_all(self.fd, memoryview(tail[1]), tail[0])

    def abort(self) -> None:
        """Wait for the writes in flight (errors ignored: the file is being given up) and clear ``O_DIRECT``."""
        for future in self.outside:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the caller's own error is the one raised
                pass
        self.outside = []
        while self.inflight:
            future, buf = self.inflight.popleft()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the caller's own error is the one raised
                pass
            _release(buf)
        if self.buf is not None:
            _release(self.buf)
            self.buf = None
        if self.direct:
            self.direct = not _set_direct(self.fd, False)

    def _start(self, base: int) -> None:
        self._wait(_DEPTH - 1)  # a buffer is free once at most _DEPTH - 1 others are in flight
        self.buf, self.base, self.fill = _acquire(), base, 0

    def _submit(self) -> None:
        if self.buf is None or not self.fill:
            if self.buf is not None:
                _release(self.buf)
            self.buf = None
            return
        whole = self.fill + (-self.fill) % ALIGN
        self.buf[self.fill:whole] = 0
        view = memoryview(self.buf[:whole])
        self.inflight.append((_threads().submit(self._pwrite, view, self.base), self.buf))
        self.buf = None

    def _wait(self, keep: int) -> None:
        while len(self.inflight) > keep:
            future, buf = self.inflight.popleft()
            try:
                future.result()
            finally:
                _release(buf)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        try:
            _pwrite_all(self.fd, view, offset)
        except OSError as exc:
            # Refused at the first write (the flag was accepted): the same bytes through the page cache from now
            # (both threads may see it; one clears the flag, both write again).
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            with _lock:
                if self.direct:
                    self.direct = not _set_direct(self.fd, False)
            if self.direct:
                raise
            _pwrite_all(self.fd, view, offset)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:  # pragma: no cover - a write of nothing without an error: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n
