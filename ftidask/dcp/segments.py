"""The hashing side of a differential checkpoint: a container's bytes hashed in segments on a pool,
compared with the base file's block digests, and the changed blocks staged for the writer.

:class:`~ftidask.dcp.files.DcpFileWriter` runs :func:`segment_task` for each segment of a container a
few segments ahead of its writes (:data:`WINDOW`): each task hashes its blocks, marks those that differ
from the base, and copies up to :data:`STAGE_BUDGET` bytes of them for writing, so that the writer
writes what was hashed (a byte the application changes meanwhile is in the next checkpoint, never
written under an old digest).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import numpy as np

from ..ftiff.blockhash import block_digests
from ..ftiff.layout import Slot
from ..ftiff.writer import ByteSource
from ..model.errors import CheckpointError

SEGMENT = 8 << 20  # bytes hashed per task: small enough to pipeline, large enough to amortise
SEGMENT_KNOWN = 64 << 20  # the same with write tracking: few blocks are hashed, fewer steps cost less
WINDOW = 6  # segments hashed ahead of the writer
STAGE_BUDGET = 8 << 20  # changed bytes a hashing task copies for writing; the writer copies the rest
PAGE = os.sysconf("SC_PAGE_SIZE")


def segment_bounds(slot: Slot, block_size: int, segment: int) -> Iterator[tuple[int, int]]:
    """The ``(start, stop)`` spans of a container hashed as one segment each: ``segment`` bytes rounded down to
    whole dCP blocks (one block at least), the last span cut at the container's end."""
    step = max(1, segment // block_size) * block_size
    for lo in range(0, slot.chunksize, step):
        yield lo, min(slot.chunksize, lo + step)


def _hash_segment(source: ByteSource, start: int, stop: int, block_size: int, fn: Callable[[memoryview], bytes],
                  size: int, reuse: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, memoryview | None]:
    """The digests of the blocks of bytes ``[start, stop)``; with ``reuse`` = (digests, stale
    mask) only the stale blocks are hashed and the others' digests are taken as given."""
    view = source.view(start, stop)
    copy = None
    if view is None:  # non-contiguous array: one bounded copy, kept for writing
        copy = memoryview(b"".join(bytes(p) for p in source.pieces(start, stop)))
        view = copy
    if reuse is None:
        return block_digests(view, block_size, fn, size), copy
    digests, stale = reuse
    for b0, b1 in _runs(stale):
        digests[b0:b1] = block_digests(view[b0 * block_size:b1 * block_size], block_size, fn, size)
    return digests, copy


_Run = tuple[int, int, bool, bool]  # blocks [b0, b1) of a segment; may it widen to a page before, after?


@dataclasses.dataclass
class Segment:
    """One hashed segment of a container: its digests, the blocks that differ from the base, and
    the bytes to write: ``staged`` (segment offset, private copy) by the hashing task, then
    ``runs`` that the task left for the writer to stage (past its budget)."""

    digests: np.ndarray
    mask: np.ndarray
    staged: list[tuple[int, memoryview]]
    runs: list[_Run]
    copy: memoryview | None


def _split(runs: list[tuple[int, int]], most: int) -> list[_Run]:
    """``runs`` cut into runs of at most ``most`` blocks (each staged copy stays bounded); only the
    outer ends of a run are widened to whole pages, so that no two writes overlap."""
    out = []
    for b0, b1 in runs:
        for lo in range(b0, b1, most):
            out.append((lo, min(b1, lo + most), lo == b0, lo + most >= b1))
    return out


def segment_task(source: ByteSource, start: int, stop: int, block_size: int, fn: Callable[[memoryview], bytes],
                  size: int, reuse: tuple[np.ndarray, np.ndarray] | None, base: np.ndarray | None,
                  file_offset: int) -> Segment:
    """Hash a segment, compare it with the base's digests, and stage (copy) its first changed
    blocks for writing: on the pool, so that copying costs the writer's thread no time."""
    if reuse is not None and not reuse[1].any():  # nothing to hash
        digests, copy = reuse[0], None
    else:
        digests, copy = _hash_segment(source, start, stop, block_size, fn, size, reuse)
        if not digests.flags.writeable:  # the pure-Python hashes: the staging below rewrites some rows
            digests = digests.copy()
    mask = np.ones(len(digests), bool)
    if base is not None:
        same = min(len(digests), len(base))
        mask[:same] = _differ(digests[:same], base[:same])
    runs = _split(_runs(mask), max(1, STAGE_BUDGET // block_size))
    staged: list[tuple[int, memoryview]] = []
    budget = STAGE_BUDGET
    while runs and (copy is not None or budget > 0):
        offset, data = stage_run(source, copy, start, stop - start, runs.pop(0), digests, block_size, fn, size,
                                 file_offset)
        staged.append((offset, data))
        budget -= len(data)
    return Segment(digests, mask, staged, runs, copy)


def stage_run(source: ByteSource, copy: memoryview | None, start: int, length: int, run: _Run,
              digests: np.ndarray, block_size: int, fn: Callable[[memoryview], bytes], size: int,
              file_offset: int) -> tuple[int, memoryview]:
    """The bytes to write for a run of changed blocks of a segment: ``(segment offset, data)``.

    The data is a private copy of the memory (another thread may be writing the array), and the
    digests of its blocks are recomputed from that copy, so that the file's block hashes are those
    of the bytes it holds. Widened to whole file pages (see :func:`_page_aligned`) only into a
    neighbouring block whose copy still matches its digest (its bytes in the file).
    """
    b0, b1, widen_lo, widen_hi = run
    off, end = b0 * block_size, min(length, b1 * block_size)
    poff, pend = _page_aligned(file_offset, off, end, length) if aligns_writes(block_size) else (off, end)
    poff, pend = poff if widen_lo else off, pend if widen_hi else end
    if copy is not None:  # the digests were computed from this private copy
        return poff, copy[poff:pend]
    first, last = poff // block_size, -(-pend // block_size)
    lo, hi = first * block_size, min(length, last * block_size)
    view = source.view(start + lo, start + hi)
    if view is None:
        raise CheckpointError("a variable's buffer changed while it was checkpointed")
    snap = np.frombuffer(view, np.uint8).copy()  # one read of the memory: hashed and written
    fresh = block_digests(memoryview(snap), block_size, fn, size)
    digests[b0:b1] = fresh[b0 - first:b1 - first]
    if first < b0 and _differ(fresh[:1], digests[first:b0]).any():
        poff = off  # the block before changed since it was hashed: its bytes in the file stay
    if last > b1 and _differ(fresh[-1:], digests[b1:last]).any():
        pend = end
    return poff, memoryview(snap)[poff - lo:pend - lo]


def aligns_writes(block_size: int) -> bool:
    """Are changed blocks written as whole file pages? For blocks of 4 pages or more (at most
    a quarter more bytes on average); smaller blocks would mean too many bytes more."""
    return block_size >= 4 * PAGE


def _page_aligned(base: int, off: int, end: int, limit: int) -> tuple[int, int]:
    """``[off, end)`` of a segment starting at file offset ``base``, widened to whole file pages
    within ``[0, limit)``. The bytes added belong to blocks that are unchanged (file and memory
    agree) or written anyway, so writing them changes nothing; but a write of whole pages into a
    file whose pages are not cached (see :meth:`DcpStore.retire`) needs no read of the page first."""
    return max(0, (base + off) // PAGE * PAGE - base), min(limit, -(-(base + end) // PAGE) * PAGE - base)


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: do the digests differ?"""
    if a.shape[1] % 8 == 0 and a.flags.c_contiguous and b.flags.c_contiguous:
        a, b = a.view(np.uint64), b.view(np.uint64)  # 2 words per 16-byte digest, not 16 bytes
    return (a != b).any(axis=1)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[(first, stop), ...]`` of the runs of True in ``mask``."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))
