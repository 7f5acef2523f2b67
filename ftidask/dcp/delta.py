"""What a differential file changed, as byte ranges: so that L2 can send only those to the partner.

A differential checkpoint patches a file whose content was known (its *base*, identified by the
base's FB hash). :class:`FileDelta` lists every byte range of the new file that may differ from
the base: the data blocks written, every block's metadata, the block-hash section and table
(from ``fs`` to the end) and the FB. A partner that holds an identical copy of the base (same FB
hash: e.g. it keeps retired partner copies as spares, as :mod:`ftidask.engine.dcpstore` does for own
files) rebuilds the new file with :func:`apply_delta` from :func:`read_payload`'s bytes; any
other partner needs the whole file. The result is verified like any file at recovery.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..ftiff.readahead import read_full
from ..ftiff.structs import FB_SIZE, FileBlock
from ..model.errors import FormatError
from ..storage import files as storage
from ..storage import interrupts

#: Whether :class:`XorScratch` makes its file with ``O_TMPFILE`` (a test seam: False takes the way of a system or
#: file system without it, a hidden temporary created ``O_EXCL`` and unlinked at once).
USE_O_TMPFILE = True


@dataclasses.dataclass(frozen=True)
class Spilled:
    """A piece of a delta read from its source (:class:`XorSource`): ``nbytes`` bytes from ``offset`` there."""

    offset: int
    nbytes: int


class XorScratch:
    """A file without a name in ``directory`` (the rank's local spare directory) that holds a large delta's XOR bytes.

    Unnamed (``O_TMPFILE``; elsewhere created at a hidden temporary name, ``O_EXCL``, and unlinked at once): a crash
    leaves nothing to clean up or to mistake for a checkpoint file, a file planted in the directory is never opened,
    and only this process, in this checkpoint, reads back what it wrote. Its pages are the page cache's, not the
    process's: written and read back within a checkpoint, most never reach the disk."""

    def __init__(self, directory: Path) -> None:
        self.size = 0
        self.fd = -1
        with interrupts.held_off():  # Ctrl-C never between the descriptor and its owner, nor before the unlink
            if USE_O_TMPFILE and hasattr(os, "O_TMPFILE"):
                try:
                    self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, storage.FILE_MODE)
                    return
                except OSError:  # a file system without O_TMPFILE
                    pass
            self.fd, tmp = storage.create_temp(directory / "XorDelta")
            try:
                os.unlink(tmp)  # a kill before this leaves a hidden temporary, which a restart sweeps
            except BaseException:
                self.close()
                raise

    def append(self, data: np.ndarray) -> None:
        """Write ``data`` (uint8) after what the file holds."""
        storage.pwrite_all(self.fd, memoryview(data), self.size)
        self.size += int(data.nbytes)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with the bytes written at ``offset``."""
        view = memoryview(out).cast("B")
        got = read_full(self.fd, offset, view)
        if got < len(view):
            raise OSError(f"the delta's scratch file is shorter than what was written ({offset + got} of {self.size})")

    def close(self) -> None:
        """Close it (its space is freed: it has no name)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __reduce__(self) -> Any:
        # Its descriptor means nothing in another process, nor once closed here: never copied (Dask keeps a task
        # result it cannot pickle in memory rather than spilling it, and fails a task that needs it elsewhere).
        raise TypeError("a delta's scratch file cannot leave its process")

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()


class XorSource(Protocol):
    """Where a delta's :class:`Spilled` pieces are read from: a writer's :class:`XorScratch`, or the two files the
    heads compared (:class:`ftidask.dcp.filexor.FilesXor`). Holds descriptors: never pickled, closed once used."""

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with the source's bytes at ``offset``; an error when it cannot give them all."""

    def close(self) -> None:
        """Free what it holds (its descriptors)."""


@dataclasses.dataclass(frozen=True)
class XorDelta:
    """What a differential file changed, as ``old XOR new`` bytes per range (files zero-padded).

    For L3: Reed-Solomon parity is linear, so a parity built over the group's base files becomes
    the parity of the new files by adding (XOR in GF(2^8)) each member's coefficient times its
    ``XorDelta`` (:mod:`ftidask.levels.rs_delta`). Only produced when the new file has the base's
    layout, so that data ranges and metadata ranges never overlap.
    """

    base_fb_hash: bytes
    ranges: tuple[tuple[int, int], ...]  # (offset, length), sorted, disjoint
    # uint8: the XOR bytes of every range, back to back, in pieces as they were captured (never joined: a copy of
    # every changed byte, the whole state for a checkpoint that changed it all), or read from ``scratch`` (a
    # :class:`Spilled` piece): a writer's scratch file past a bound of memory (its file is overwritten before the
    # parity is patched), or the heads' two files, which stay on disk (:mod:`ftidask.dcp.filexor`: no XOR kept)
    pieces: tuple[np.ndarray | Spilled, ...]
    scratch: XorSource | None = dataclasses.field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of XOR payload (the ranges' total length)."""
        return self._starts[-1]

    @functools.cached_property
    def _starts(self) -> list[int]:
        """Where each piece starts in the payload, and its end (cached: the delta is frozen)."""
        return [0, *itertools.accumulate(int(p.nbytes) for p in self.pieces)]

    def read(self, start: int, n: int) -> np.ndarray:
        """Payload bytes ``[start, start + n)``, zeros past its end (members' payloads are padded to one width)."""
        out = np.zeros(n, np.uint8)
        starts, stop = self._starts, start + n
        # from the piece that holds ``start``: read a stripe at a time, a scan from the first piece each time cost
        # the pieces times the stripes (a 256 MiB delta in 16 KiB pieces: 0.2 s, as long as copying its bytes)
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(self.pieces) and starts[i] < stop:
            lo, hi = max(start, starts[i]), min(stop, starts[i + 1])
            piece = self.pieces[i]
            if lo < hi and isinstance(piece, Spilled):
                assert self.scratch is not None
                self.scratch.read_into(piece.offset + lo - starts[i], out[lo - start:hi - start])
            elif lo < hi:
                out[lo - start:hi - start] = piece[lo - starts[i]:hi - starts[i]]
            i += 1
        return out

    def close(self) -> None:
        """Free its scratch file or files, if it has any (after the parity is patched: its spilled pieces cannot be
        read)."""
        if self.scratch is not None:
            self.scratch.close()


class DeltaMismatch(FormatError):
    """The partner's base is not the file the delta was computed against: send the whole file."""


@dataclasses.dataclass(frozen=True)
class FileDelta:
    """Byte ranges ``(offset, length)`` of a new file that differ from the base file."""

    base_fb_hash: bytes
    file_size: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes that differ: the ranges' total length."""
        return sum(n for _o, n in self.ranges)

    def to_json(self) -> dict[str, Any]:
        """The delta as a JSON-able dict (the base's FB hash as hex)."""
        return {"base_fb_hash": self.base_fb_hash.hex(), "file_size": self.file_size,
                "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, raw: Any) -> FileDelta:
        """The delta ``raw`` holds; :class:`FormatError` if it is not a valid one."""
        try:
            return cls(bytes.fromhex(raw["base_fb_hash"]), int(raw["file_size"]),
                       tuple((int(o), int(n)) for o, n in raw["ranges"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"invalid file delta: {exc}") from None


def file_fb_hash(path: Path | str) -> str:
    """The FB hash (hex) of the file at ``path``, or "" when it is missing or has no valid FB."""
    try:
        with storage.open_read(path) as fh:
            raw = fh.read(FB_SIZE)
        return FileBlock.unpack(raw).hash.hex() if len(raw) == FB_SIZE else ""
    except (OSError, FormatError):
        return ""


def merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-overlapping, adjacent ranges joined."""
    out: list[list[int]] = []
    for off, n in sorted(r for r in ranges if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)


def read_payload(path: Path, delta: FileDelta) -> bytes:
    """The bytes of ``delta``'s ranges of the new file, concatenated."""
    with storage.open_read(path) as fh:
        parts = [os.pread(fh.fileno(), n, off) for off, n in delta.ranges]
    payload = b"".join(parts)
    if len(payload) != delta.nbytes:
        raise FormatError(f"{path}: shorter than its delta", path=str(path))
    return payload


def apply_delta(base_path: Path, out_path: Path, delta: FileDelta, payload: bytes | memoryview) -> None:
    """Patch the copy of the base at ``base_path`` in place and rename it to ``out_path``."""
    if len(payload) != delta.nbytes:
        raise FormatError(f"delta payload of {len(payload)} bytes, the ranges need {delta.nbytes}")
    fd = storage.open_regular(base_path, os.O_RDWR | os.O_NOFOLLOW)  # never written through a planted link
    try:
        raw = os.pread(fd, FB_SIZE, 0)
        try:
            same = len(raw) == FB_SIZE and FileBlock.unpack(raw).hash == delta.base_fb_hash
        except FormatError:
            same = False
        if not same:
            raise DeltaMismatch(f"{base_path} is not the base of this delta", path=str(base_path))
        view, pos = memoryview(payload).cast("B"), 0
        for off, n in delta.ranges:
            storage.pwrite_all(fd, view[pos:pos + n], off)
            pos += n
        os.ftruncate(fd, delta.file_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    storage.rename_into(base_path, out_path)
