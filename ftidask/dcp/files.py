"""Differential checkpointing: hash the data in blocks, write only the blocks that changed.

:class:`DcpFileWriter` brings an existing file (the *base*, whose block digests are known:
:class:`BlockState`) up to date in place: every block of the current data is hashed (this is
unavoidable without a copy of the data, and runs at several GiB/s on a thread pool, xxhash and
hashlib releasing the GIL), blocks whose digest differs from the base's are written at their
``fptr`` offset, then the metadata, block-hash section, table and FB are rewritten (they are
small). Nothing unchanged is read back or rehashed from disk: a container's hash is the hash of
its block digests (see :mod:`ftidask.ftiff.blockhash`).

Which file is patched, and how the previous checkpoint stays valid meanwhile, is decided by
:mod:`ftidask.engine.dcpstore`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff import blockhash
from ..ftiff.blockhash import FLAG_DCP, container_hash
from ..ftiff.layout import Layout, Slot
from ..ftiff.structs import FLAG_METADATA_CHECKSUM
from ..ftiff.writer import ByteSource, WrittenFile, write_metadata
from ..model.arrays import VarInfo
from ..model.errors import CheckpointError, FormatError
from ..storage import files as storage
from ..storage import interrupts
from .delta import FileDelta, Spilled, XorDelta, XorScratch, merge_ranges
from .segments import SEGMENT, SEGMENT_KNOWN, WINDOW, segment_bounds, segment_task, stage_run
from .track import KnownDigests

log = logging.getLogger("ftidask")
#: XOR bytes of an L3 delta kept in memory; past them, a run's are kept in a scratch file (when the writer has a
#: ``spill_dir``): the delta of a checkpoint that changed its whole state was a copy of the state in memory.
XOR_IN_MEMORY = 16 << 20
SPILL_PIECE = 1 << 20  # bytes of a run read, XORed and written to the scratch file at once


@dataclasses.dataclass(frozen=True)
class BlockState:
    """What one file holds, as block digests: enough to know which blocks a new state changes."""

    layout: Layout
    block_size: int
    bid: int
    digests: Mapping[tuple[int, int], np.ndarray]  # (block, slot) -> (n, D) uint8
    fb_hash: bytes  # identifies the file this state describes

    def compatible(self, block_size: int, bid: int) -> bool:
        """Whether these digests were made with block size ``block_size`` and block hash ``bid``."""
        return self.block_size == block_size and self.bid == bid


@dataclasses.dataclass(frozen=True)
class DcpStats:
    """What a differential write did."""

    data_bytes: int
    blocks_changed: int
    blocks_total: int
    file_bytes: int
    hash_seconds: float
    delta: FileDelta | None = None  # the ranges that differ from the base (None: no base)
    xor: XorDelta | None = None  # old XOR new of those ranges, when asked for (L3) and the layout is the base's
    blocks_hashed: int = 0  # blocks read and hashed (write tracking spares the others, see dcptrack)
    data_runs: int = 0  # separate writes of data (runs of changed blocks)


#: Segments up to this size are hashed by the caller: a round trip through the pool per small variable cost more
#: than its hashing (10,000 variables of 1 KiB: 1.4 s of waiting a checkpoint).
_INLINE = 64 << 10


def _done(fn: Any, *args: Any) -> Future[Any]:
    """``fn(*args)`` run now, as a finished future (its exception raised where the pool's would be)."""
    out: Future[Any] = Future()
    try:
        out.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 - raised by result(), as the pool's future does
        out.set_exception(exc)
    return out


def _base_slot(base: BlockState | None, bi: int, si: int, slot: Slot) -> np.ndarray | None:
    """The base's digests of the same container, or None when the base has no such container."""
    if base is None or bi >= len(base.layout.blocks) or si >= len(base.layout.blocks[bi].slots):
        return None
    old = base.layout.blocks[bi].slots[si]
    if (old.var_id, old.dptr, old.fptr, old.containersize) != (slot.var_id, slot.dptr, slot.fptr, slot.containersize):
        return None
    digests = base.digests.get((bi, si))
    if digests is None:
        return None
    if old.chunksize != slot.chunksize:
        # Only the blocks that are whole in both files have comparable digests.
        digests = digests[:min(old.chunksize, slot.chunksize) // base.block_size]
    return digests


class DcpFileWriter:
    """Bring the file open at ``fd`` from ``base`` (None: unknown content, write everything) to
    the current data, variable by variable (so that iCP can use it), then :meth:`finish`."""

    def __init__(self, fd: int, layout: Layout, base: BlockState | None, *, block_size: int, bid: int,
                 hash_id: int, pool: ThreadPoolExecutor, capture_xor: bool = False,
                 spill_dir: Path | None = None) -> None:
        if not blockhash.MIN_BLOCK <= block_size <= blockhash.MAX_BLOCK:
            raise CheckpointError(f"dcp_block_size {block_size} outside [512, 65535]")
        self.fd, self.layout, self.pool = fd, layout, pool
        self.base = base if base is not None and base.compatible(block_size, bid) else None
        self.block_size, self.bid, self.hash_id = block_size, bid, hash_id
        _name, self.dsize, self.fn = blockhash.block_hash(bid)
        self.digests: dict[tuple[int, int], np.ndarray] = {}
        self.changed: dict[tuple[int, int], np.ndarray] = {}  # per container: mask of written blocks
        # Containers a write that did not complete may have patched: the file no longer holds the base's bytes
        # there, so any later write of them rewrites every block (comparing with the base would skip some).
        self.dirty: set[tuple[int, int]] = set()
        self.data_bytes = 0
        self.blocks_hashed = 0
        self.hash_seconds = 0.0
        self.done: set[int] = set()
        self._writeback: list[Future[None]] = []
        self.runs: list[tuple[int, int]] = []  # file ranges of the data written
        # For L3 parity updates: the base's metadata bytes, read before anything is overwritten.
        self._old_meta: list[tuple[int, bytes]] | None = None
        self._xor: list[tuple[int, np.ndarray | Spilled]] = []
        self._spill_dir, self._scratch, self._in_memory = spill_dir, None, 0
        if capture_xor and self.base is not None and self.base.layout == layout:
            old_size = os.fstat(fd).st_size
            self._old_meta = [(off, _pread_padded(fd, n, off, old_size)) for off, n in self._meta_ranges(old_size)]
        # Invalidate the FB before the first data write: a file torn by a crash while it is patched
        # never shows a valid FB, so it is never mistaken for the file its old FB described.
        os.pwrite(fd, bytes(96), 0)
        os.fdatasync(fd)

    def write_var(self, var_id: int, source: ByteSource, known: KnownDigests | None = None) -> int:
        """Hash every block of ``var_id``'s containers, write those that differ from the base.
        With ``known`` (see :mod:`ftidask.dcp.track`), blocks whose pages were not written since
        they were last hashed keep their digest and are not read."""
        if var_id in self.done:  # written before, then interrupted after (its tracking, the add's bookkeeping):
            self.dirty.update((bi, si) for bi, si, _s in self.layout.positions_of(var_id))  # rewritten whole
        counted = self.blocks_hashed, self.hash_seconds
        try:
            return self._write_var(var_id, source, known)
        except BaseException:
            self.blocks_hashed, self.hash_seconds = counted  # the next write counts its own
            # Not written whole (Ctrl-C, a full disk): a run may be in the delta and not in the file, and the variable
            # written again (iCP keeps the checkpoint open) takes it again from the same old bytes: two equal deltas
            # of one range cancel, and the patched parity would miss it. No delta from this file: L3 re-encodes.
            self.discard_xor()
            # Some of its blocks hold this write's bytes now, not the base's: written again, each is rewritten.
            self.dirty.update((bi, si) for bi, si, _s in self.layout.positions_of(var_id))
            raise

    def _write_var(self, var_id: int, source: ByteSource, known: KnownDigests | None) -> int:
        written = 0
        pending: deque[tuple[tuple[int, int], Slot, int, int, Future[Any]]] = deque()
        # from the layout's index: a scan of every container per variable made n variables quadratic
        slots = [((bi, si), s) for bi, si, s in self.layout.positions_of(var_id) if s.hascontent]
        parts: dict[tuple[int, int], list[np.ndarray]] = {key: [] for key, _s in slots}
        reuse = {key: known.container(s.dptr, s.chunksize, self.block_size) for key, s in slots} if known else {}
        for key, _s in slots:  # this write's masks only (a write interrupted before left part of one)
            self.changed[key] = np.zeros(0, bool)
        tasks = ((key, s, lo, hi) for key, s in slots
                 for lo, hi in segment_bounds(s, self.block_size, SEGMENT if reuse.get(key) is None else SEGMENT_KNOWN))
        start = time.perf_counter()

        def submit() -> None:
            for key, s, lo, hi in tasks:
                known_part = reuse.get(key)
                b0, b1 = lo // self.block_size, -(-hi // self.block_size)
                if known_part is not None:
                    known_part = (known_part[0][b0:b1], known_part[1][b0:b1])
                self.blocks_hashed += (int(known_part[1].sum()) if known_part is not None
                                       else -(-(hi - lo) // self.block_size))
                base = None if key in self.dirty else _base_slot(self.base, key[0], key[1], s)
                args = (source, s.dptr + lo, s.dptr + hi, self.block_size, self.fn, self.dsize, known_part,
                        None if base is None else base[b0:b1], s.fptr + lo)
                pending.append((key, s, lo, hi, self.pool.submit(segment_task, *args) if hi - lo > _INLINE
                                else _done(segment_task, *args)))
                if len(pending) >= WINDOW:
                    return

        submit()
        while pending:
            key, slot, lo, hi, fut = pending.popleft()
            seg = fut.result()
            submit()
            parts[key].append(seg.digests)
            self.changed[key] = np.concatenate((self.changed[key], seg.mask))
            # Changed blocks the task did not copy are copied now, one run at a time (bounded memory).
            later = (stage_run(source, seg.copy, slot.dptr + lo, hi - lo, run, seg.digests, self.block_size,
                               self.fn, self.dsize, slot.fptr + lo) for run in seg.runs)
            for off, data in itertools.chain(seg.staged, later):
                end = off + len(data)
                if self._old_meta is not None:  # old XOR new, read before it is overwritten
                    self._capture(slot.fptr + lo + off, np.frombuffer(memoryview(data).cast("B"), np.uint8))
                storage.pwrite_all(self.fd, data, slot.fptr + lo + off)
                self.runs.append((slot.fptr + lo + off, end - off))
                written += end - off
            if (seg.staged or seg.runs) and hi - lo > _INLINE:  # a small one is left to the fsync
                # Submitting write-back of scattered ranges costs CPU: on a pool thread, it overlaps.
                self._writeback.append(self.pool.submit(storage.start_writeback, self.fd, slot.fptr + lo, hi - lo))
        for key, chunks in parts.items():
            self.digests[key] = (np.concatenate(chunks) if chunks else np.zeros((0, self.dsize), np.uint8))
        self.hash_seconds += time.perf_counter() - start
        self.data_bytes += written
        self.done.add(var_id)
        return written

    def _capture(self, offset: int, new: np.ndarray) -> None:
        """Keep old XOR new of ``new``, about to be written at ``offset``: in memory up to :data:`XOR_IN_MEMORY`,
        past it in the scratch file a piece at a time (the old bytes exist nowhere else once overwritten).
        The scratch failing (a full disk) only drops the delta: the parity is then encoded again in full."""
        n = int(new.nbytes)
        if self._spill_dir is None or self._in_memory + n <= XOR_IN_MEMORY:
            self._in_memory += n
            self._xor.append((offset, np.frombuffer(_pread_padded(self.fd, n, offset, None), np.uint8) ^ new))
            return
        try:
            if self._scratch is None:
                self._scratch = XorScratch(self._spill_dir)
            start = self._scratch.size
            for lo in range(0, n, SPILL_PIECE):
                hi = min(n, lo + SPILL_PIECE)
                old = np.frombuffer(_pread_padded(self.fd, hi - lo, offset + lo, None), np.uint8)
                self._scratch.append(old ^ new[lo:hi])
        except OSError as exc:
            log.warning("L3: cannot keep the parity delta in %s (%s): the parity will be encoded again in full",
                        self._spill_dir, exc)
            self.discard_xor()
            return
        self._xor.append((offset, Spilled(start, n)))

    def discard_xor(self) -> None:
        """No delta from this write (its scratch file closed): L3 encodes the parity again."""
        self._old_meta, self._xor = None, []
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            with contextlib.suppress(OSError):
                scratch.close()

    def drain(self) -> None:
        """Wait for the write-back requests sent to the pool (before fsync, and before fd is closed)."""
        pending, self._writeback = self._writeback, []
        for started in pending:
            started.result()

    def var_digests(self, var_id: int) -> dict[int, tuple[int, np.ndarray]]:
        """``var_id``'s block digests by container: dptr -> (chunksize, digests)."""
        return {s.dptr: (s.chunksize, self.digests[bi, si]) for bi, si, s in self.layout.positions_of(var_id)
                if (bi, si) in self.digests}

    def _meta_ranges(self, end: int) -> list[tuple[int, int]]:
        """The FB, each block's metadata, and ``[fs, end)``: the bytes a patch rewrites besides data."""
        out = [(0, 96)] + [(b.offset, b.metasize) for b in self.layout.blocks]
        return out + [(self.layout.fs, max(0, end - self.layout.fs))]

    def _xor_delta(self, new_size: int) -> XorDelta:
        """Old XOR new for the data runs written and every metadata range (FB, blocks, fs to the end)."""
        assert self._old_meta is not None and self.base is not None
        old_tail_end = self._old_meta[-1][0] + len(self._old_meta[-1][1])
        pieces = list(self._xor)
        for (_off, old), (off2, n) in zip(self._old_meta, self._meta_ranges(max(new_size, old_tail_end)), strict=True):
            new = _pread_padded(self.fd, n, off2, new_size)
            old = old + bytes(n - len(old))
            pieces.append((off2, np.frombuffer(old, np.uint8) ^ np.frombuffer(new, np.uint8)))
        pieces.sort(key=lambda p: p[0])
        self._xor, scratch, self._scratch = [], self._scratch, None  # the delta holds them now
        ranges = tuple((off, int(x.nbytes)) for off, x in pieces)
        return XorDelta(self.base.fb_hash, ranges, tuple(x for _o, x in pieces), scratch)

    def finish(self, trailer: Mapping[str, Any], *, pt_fs: int | None = None,
               max_fs: int | None = None) -> tuple[WrittenFile, DcpStats, BlockState]:
        """Write the metadata, block-hash section, table and FB; fsync. The new state is returned."""
        missing = {s.var_id for s in self.layout.slots() if s.hascontent} - self.done
        if missing:
            raise CheckpointError(f"variables {sorted(missing)} were not written")
        self.drain()
        keys = [(bi, si) for bi, b in enumerate(self.layout.blocks) for si, s in enumerate(b.slots) if s.hascontent]
        section = b"".join(memoryview(np.ascontiguousarray(self.digests[k])).cast("B") for k in keys)
        table = dict(trailer)
        table["dcp"] = blockhash.table_entry(self.block_size, self.bid, len(section))
        hashes = {k: container_hash(self.hash_id, self.digests[k]) for k in keys}
        with interrupts.held_off():  # Ctrl-C never between the duplicate descriptor and its file object
            dup = os.dup(self.fd)
            try:
                fh = os.fdopen(dup, "r+b")
            except BaseException:
                os.close(dup)
                raise
        with fh:
            written = write_metadata(fh, self.layout, hashes, hash_id=self.hash_id, trailer=table, pt_fs=pt_fs,
                                     max_fs=max_fs, flags=FLAG_METADATA_CHECKSUM | FLAG_DCP, section=section)
            fh.flush()
            os.fsync(fh.fileno())
        changed = sum(int(m.sum()) for m in self.changed.values())
        total = sum(len(m) for m in self.changed.values())
        meta_bytes = written.file_size - self.layout.fs + sum(b.metasize for b in self.layout.blocks) + 96
        delta = None
        if self.base is not None:
            meta = [(0, 96), (self.layout.fs, written.file_size - self.layout.fs)]
            meta += [(b.offset, b.metasize) for b in self.layout.blocks]
            delta = FileDelta(self.base.fb_hash, written.file_size, merge_ranges(self.runs + meta))
        xor = self._xor_delta(written.file_size) if self._old_meta is not None and self.base is not None else None
        stats = DcpStats(self.data_bytes, changed, total, self.data_bytes + meta_bytes, self.hash_seconds, delta, xor,
                         self.blocks_hashed, len(self.runs))
        state = BlockState(self.layout, self.block_size, self.bid, dict(self.digests), written.fb.hash)
        return dataclasses.replace(written, data_bytes=self.data_bytes), stats, state


def _pread_padded(fd: int, n: int, offset: int, size: int | None) -> bytes:
    """``n`` bytes at ``offset``, zeros past the end of the file (``size``, or as it is now)."""
    raw = os.pread(fd, n, offset) if size is None or offset < size else b""
    return raw + bytes(n - len(raw))


def load_state(path: Path, expected_fb_hash: bytes) -> BlockState | None:
    """The block state of the dCP file at ``path`` read from its own block-hash section, when its
    FB hash is ``expected_fb_hash`` (the hash its commit record gave); None otherwise.

    For backends whose writers keep no state between checkpoints (Dask tasks): a committed file
    was complete and fsynced, and a writer invalidates the FB before patching a file, so a valid
    FB with the expected hash means the section describes the data. Nothing but metadata is read.
    """
    from ..ftiff.reader import parse_ftiff

    try:
        with storage.open_read(path) as fh:
            parsed = parse_ftiff(fh, str(path))
            if parsed.fb.hash != expected_fb_hash:
                return None
            return state_of_file(path, parsed)
    except (OSError, FormatError):
        return None


def state_of_file(path: Path, parsed: Any) -> BlockState | None:
    """The block state of a verified dCP file (None for a file without block hashes, or a Zarr store)."""
    if getattr(parsed, "fb", None) is None or not parsed.fb.flags & FLAG_DCP:
        return None
    with storage.open_read(path) as fh:
        info, digests = blockhash.read_digests(fh, parsed)
    return BlockState(parsed.layout(), info.block_size, info.bid, digests, parsed.fb.hash)


def write_dcp_file(fd: int, layout: Layout, sources: Mapping[int, ByteSource], infos: list[VarInfo],
                   meta: Mapping[str, Any], base: BlockState | None, *, block_size: int, bid: int, hash_id: int,
                   pool: ThreadPoolExecutor, pt_fs: int | None = None, max_fs: int | None = None,
                   capture_xor: bool = False,
                   spill_dir: Path | None = None) -> tuple[WrittenFile, DcpStats, BlockState]:
    """Bring the file at ``fd`` from ``base`` to ``sources`` (every variable at once)."""
    writer = DcpFileWriter(fd, layout, base, block_size=block_size, bid=bid, hash_id=hash_id, pool=pool,
                           capture_xor=capture_xor, spill_dir=spill_dir)
    try:
        for vid, source in sources.items():
            writer.write_var(vid, source)
        trailer = dict(meta)
        trailer["vars"] = [info.to_json() for info in infos]
        return writer.finish(trailer, pt_fs=pt_fs, max_fs=max_fs)
    finally:
        writer.drain()
