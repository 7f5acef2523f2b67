"""A delta of two files that stay on disk: which blocks differ, their ``base XOR new`` read back when needed.

The heads' differential L3 (:mod:`ftidask.backends.mpi.head_parity`) compares the previous L3 checkpoint's rank file
(the *base*) with the new one block by block. Both stay on disk, unchanged, until the parity is patched (the
application waits for its head before its next checkpoint or recovery; the heads retire the base only after the
update), so the delta keeps no XOR bytes: :func:`files_xor_delta` records the blocks that differ and a digest of each
block's XOR, and :class:`FilesXor` (the delta's source, as a writer's scratch file is) reads both files again a
piece at a time when the exchange asks for a stripe. It reads them through the descriptors the comparison opened: a
file renamed or replaced by name meanwhile is never the one read. A file shorter than it was, or a block whose XOR is
not the one compared (a byte changed since), is an error: that member's part of the exchange fails, and with it the
checkpoint on every member; the parity is never patched from bytes that were not compared.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..ftiff.readahead import read_full
from ..ftiff.structs import FB_SIZE, FileBlock
from ..model.errors import FormatError
from ..storage import files as storage
from ..storage import interrupts
from .delta import Spilled, XorDelta

READ_PIECE = 1 << 20  # bytes of each file read and XORed at once when a stripe is read back


class FilesXor:
    """The ``base XOR new`` bytes of a delta's ranges (each file zero-padded to the longer), read from both files.

    Offsets are the payload's (the ranges' bytes back to back, as :meth:`XorDelta.read` asks for them). Every range
    is made of whole ``block``-byte blocks (the last block of the longer file aside); ``digests[i]`` is the XXH3-64
    of payload block ``i`` as it was compared. Owns both descriptors: :meth:`close` them."""

    def __init__(self, base_fd: int, new_fd: int, sizes: tuple[int, int], block: int,
                 ranges: tuple[tuple[int, int], ...], digests: array, names: tuple[str, str]) -> None:
        self.fds = (base_fd, new_fd)
        self.sizes = sizes  # of base and new when compared: past them, zeros (never what a file may hold since)
        self.block = block
        self.ranges = ranges
        self._starts = [0, *itertools.accumulate(n for _o, n in ranges)]  # payload offset of each range, and the end
        self.digests = digests
        self.names = names

    @property
    def size(self) -> int:
        """Payload bytes."""
        return self._starts[-1]

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with payload bytes from ``offset``, each whole block read checked against its digest."""
        end = offset + len(out)
        if offset < 0 or end > self.size:
            raise ValueError(f"payload bytes [{offset}, {end}) of a delta of {self.size}")
        piece = max(1, READ_PIECE // self.block) * self.block
        pos = offset // self.block * self.block
        while pos < end:  # whole blocks, a piece at a time: a stripe's edges cut blocks, each is checked whole
            stop = min(pos + piece, -(-end // self.block) * self.block, self.size)
            xor = self._xor(pos, stop)
            lo, hi = max(offset, pos), min(end, stop)
            out[lo - offset:hi - offset] = xor[lo - pos:hi - pos]
            pos = stop

    def _xor(self, start: int, stop: int) -> np.ndarray:
        """Payload bytes ``[start, stop)`` (block bounds), from both files, checked."""
        out = np.empty(stop - start, np.uint8)
        other = np.empty(stop - start, np.uint8)
        k = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < stop:
            off, n = self.ranges[k]
            lo, hi = pos - self._starts[k], min(n, stop - self._starts[k])
            self._read(0, off + lo, out[pos - start:pos - start + hi - lo])
            self._read(1, off + lo, other[pos - start:pos - start + hi - lo])
            pos += hi - lo
            k += 1
        np.bitwise_xor(out, other, out=out)
        del other
        for b in range(start // self.block, -(-stop // self.block)):
            lo = b * self.block - start
            if xxhash.xxh3_64_intdigest(out[lo:lo + self.block]) != self.digests[b]:
                at = self._file_offset(b * self.block)
                raise FormatError(f"{self.names[0]} or {self.names[1]} changed since they were compared (the block at "
                                  f"byte {at}): the parity is not patched from it")
        return out

    def _file_offset(self, payload: int) -> int:
        k = bisect.bisect_right(self._starts, payload) - 1
        return self.ranges[k][0] + payload - self._starts[k]

    def _read(self, which: int, offset: int, out: np.ndarray) -> None:
        """File ``which``'s bytes at ``offset`` into ``out``: those it had when compared, zeros past its size then."""
        have = max(0, min(len(out), self.sizes[which] - offset))
        out[have:] = 0
        if have and read_full(self.fds[which], offset, memoryview(out[:have])) < have:
            raise OSError(f"{self.names[which]} is shorter than when it was compared ({self.sizes[which]} bytes)")

    def close(self) -> None:
        """Close both descriptors (once)."""
        fds, self.fds = self.fds, (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __reduce__(self) -> Any:
        raise TypeError("a delta read from its files cannot leave its process (it holds their descriptors)")

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()


def files_xor_delta(base: Path, new: Path, block: int, limit: int, whole: Any = None) -> XorDelta | None:
    """The delta of ``new`` from ``base`` (each zero-padded to the longer) over the ``block``-byte blocks that differ,
    its XOR bytes read back from both files (:class:`FilesXor`: close the delta); None when ``base`` is gone or has
    no FB, or more than ``limit`` bytes differ (encoding anew then costs less). ``whole``: a hasher that gets every
    byte of ``new`` (complete when a delta is returned)."""
    fds: list[int] = []
    try:
        with interrupts.held_off():  # Ctrl-C never between a descriptor and the list that closes it
            try:
                fds.append(storage.open_regular(base))
            except OSError:  # no base (as one without an FB): no delta
                return None
            fds.append(storage.open_regular(new))
        base_fb = _fb_hash(fds[0])  # of the file compared, read through its descriptor: not another at its name
        if not base_fb:
            return None
        sizes = (os.fstat(fds[0]).st_size, os.fstat(fds[1]).st_size)
        found = _compare(fds, max(sizes), block, limit, whole)
        if found is None:
            return None
        ranges, digests = found
        with interrupts.held_off():  # the source owns the descriptors now: never closed twice
            source = FilesXor(fds[0], fds[1], sizes, block, ranges, digests, (str(base), str(new)))
            fds.clear()
        return XorDelta(base_fb, ranges, (Spilled(0, source.size),) if ranges else (), source)
    finally:
        for fd in fds:
            os.close(fd)


def _fb_hash(fd: int) -> bytes:
    """The FB hash of the file open at ``fd``; empty when it has no valid FB (as :func:`~.delta.file_fb_hash`)."""
    raw = os.pread(fd, FB_SIZE, 0)
    try:
        return FileBlock.unpack(raw).hash if len(raw) == FB_SIZE else b""
    except FormatError:
        return b""


def _compare(fds: list[int], size: int, block: int, limit: int,
             whole: Any) -> tuple[tuple[tuple[int, int], ...], array] | None:
    """The ranges of the blocks that differ (adjacent ones joined) and each block's XOR digest; None past ``limit``."""
    ranges: list[tuple[int, int]] = []
    digests = array("Q")
    total = 0
    for off in range(0, size, block):
        n = min(block, size - off)
        raw = os.pread(fds[1], n, off)
        if whole is not None:
            whole.update(raw)
        diff = _padded(os.pread(fds[0], n, off), n) ^ _padded(raw, n)
        if not diff.any():
            continue
        total += n
        if total > limit:
            return None
        if ranges and ranges[-1][0] + ranges[-1][1] == off:  # adjacent blocks: one range
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
        else:
            ranges.append((off, n))
        digests.append(xxhash.xxh3_64_intdigest(diff))
    return tuple(ranges), digests


def _padded(raw: bytes, n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    out[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out
