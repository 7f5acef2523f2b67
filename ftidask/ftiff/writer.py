"""Write one FTI-FF file from a layout and the byte streams of the variables.

Data first, container by container, then the metadata (whose hashes are known only then),
the variable table, and the file block last. The caller owns the file handle (and so the
atomic commit): the writer knows nothing of paths.

The application may write its arrays while they are checkpointed (another thread). The data
of such a checkpoint may be torn between pieces, as in FTI, but its file always verifies:
each piece is copied once from memory into a reusable buffer, and that copy is both hashed and
written (:func:`write_spans`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

import numpy as np

from ..storage import files as storage
from ..storage.direct import ALIGN, DirectStream, aligned, open_stream
from . import compression, hashing
from .layout import Layout
from .structs import BMD_SIZE, BMD_STRUCT, FLAG_METADATA_CHECKSUM, VMD_SIZE, VMD_STRUCT, ContainerMeta, FileBlock
from .trailer import pack_trailer


class ByteSource(Protocol):
    """What the writer needs from a variable: its bytes by range."""

    nbytes: int

    def view(self, start: int, stop: int) -> memoryview | None:
        """A zero-copy view of bytes ``[start, stop)``, or None (then :meth:`pieces` is used)."""

    def pieces(self, start: int, stop: int) -> Iterable[memoryview]:
        """Bytes ``[start, stop)``, in pieces."""


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """What was written: the file block, every container's metadata, and the byte counts."""

    fb: FileBlock
    block_meta: tuple[bytes, ...]  # each block's metadata as written: its BMD, then a VMD per container
    file_size: int
    data_bytes: int

    @property
    def containers(self) -> tuple[tuple[ContainerMeta, ...], ...]:
        """Every container's metadata, block by block."""
        return tuple(tuple(ContainerMeta.unpack(raw[lo:lo + VMD_SIZE]) for lo in range(BMD_SIZE, len(raw), VMD_SIZE))
                     for raw in self.block_meta)


_WRITE_PIECE = 64 << 20
_WRITEBACK_MIN = 8 << 20  # smaller writes are left to the final fsync
#: Bytes copied out of an array, hashed and written at a time. The array may be written by another
#: thread meanwhile: only a private copy makes the bytes hashed the bytes written.
COPY_PIECE = 8 << 20
#: Less data than this goes through the page cache even when ``direct`` is asked: the metadata written after it
#: shares its first and last pages, read back from the disk after a direct write (a small file's fixed cost).
DIRECT_MIN = 16 << 20
_RING = 3  # copy buffers per writer: the pool fills the next ones while the caller writes one
_INLINE = 256 << 10  # containers up to this size are copied, hashed and written by the caller alone
_free: list[np.ndarray] = []  # buffers kept for the next checkpoint (no page faults), at most _RING
_free_lock = threading.Lock()


def _acquire() -> np.ndarray:
    with _free_lock:
        if _free:
            return _free.pop()
    # aligned, with a block of room: a direct write copies a piece at its offset within a block (storage.direct)
    return aligned(COPY_PIECE + ALIGN)


def _release(buf: np.ndarray) -> None:
    with _free_lock:
        if len(_free) < _RING:
            _free.append(buf)


def _write_all(fh: BinaryIO, data: memoryview) -> None:
    for lo in range(0, len(data), _WRITE_PIECE):
        # the disk starts on each large piece while the next one is written
        storage.write_then_writeback(fh, data[lo:lo + _WRITE_PIECE], _WRITEBACK_MIN)


def copy_span(source: ByteSource, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """Copy bytes ``[start, stop)`` of ``source`` into ``out`` (one read of the memory): the
    filled part of ``out``. NumPy copies without holding the GIL."""
    n = stop - start
    view = source.view(start, stop)
    if view is not None:
        np.copyto(out[:n], np.frombuffer(view, np.uint8))
        return out[:n]
    copy_into = getattr(source, "copy_into", None)
    if copy_into is not None:  # a snapshot's source (ftidask.memsnap): straight into ``out``, no piece buffers
        return copy_into(start, stop, out[:n])
    pos = 0
    for piece in source.pieces(start, stop):
        np.copyto(out[pos:pos + len(piece)], np.frombuffer(piece, np.uint8))
        pos += len(piece)
    if pos != n:
        raise ValueError(f"byte source gave {pos} bytes for [{start}, {stop})")
    return out[:n]


def _copy_small(source: ByteSource, start: int, stop: int, out: np.ndarray, out_view: memoryview) -> memoryview:
    """A small span's bytes copied into ``out`` (``out_view``: the same bytes as a memoryview): the copy."""
    try:  # a memoryview's copy (NumPy's costs more than 1 KiB's)
        out_view[:] = source.view(start, stop)  # type: ignore[index]
    except (TypeError, ValueError):  # no view, or one of another format
        copy_span(source, start, stop, out)
    return out_view


def _fill(source: ByteSource, start: int, stop: int, buf: np.ndarray, hasher: hashing.Hasher,
          before: Future[Any] | None) -> np.ndarray:
    """Copy a piece into ``buf`` and hash the copy (after the container's previous piece)."""
    data = copy_span(source, start, stop, buf)
    if before is not None:  # pieces of one container are hashed in order, whatever the pool
        before.result()
    hasher.update(memoryview(data))
    return data


class _Batch:
    """Small containers that follow each other in the file, copied side by side and written in one call: a seek
    and a write per container cost more than its copy (10,000 variables of 1 KiB: 20,000 system calls)."""

    SIZE = 4 * _INLINE  # room for any small container (at most _INLINE bytes)

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.start, self.used = fh, 0, 0
        self.buf = np.empty(0, np.uint8)
        self.mv = memoryview(self.buf)

    def take(self, offset: int, n: int) -> int:
        """Room for the ``n`` bytes at file ``offset`` (``n`` at most :attr:`SIZE`): where they go in :attr:`buf`
        (and :attr:`mv`). The bytes before are written first when these do not follow them or do not fit."""
        used = self.used
        if used and (offset != self.start + used or used + n > self.SIZE):
            self.flush()
            used = 0
        if not self.buf.size:
            self.buf = np.empty(self.SIZE, np.uint8)
            self.mv = memoryview(self.buf)
        if not used:
            self.start = offset
        self.used = used + n
        return used

    def flush(self) -> None:
        """Write what was taken."""
        if self.used:
            self.fh.seek(self.start)
            _write_all(self.fh, self.mv[:self.used])
            self.used = 0


#: A byte range to write: (key, file offset, source, start, stop) -> its digest under ``key``.
Span = tuple[Any, int, ByteSource, int, int]


def write_spans(fh: BinaryIO, spans: Iterable[Span], hash_id: int, pool: ThreadPoolExecutor,
                stream: DirectStream | None = None) -> dict[Any, bytes]:
    """Write each span's bytes at its file offset (through ``stream`` when given, in file order; the caller closes
    it); the digest of the bytes written, by key.

    Each piece of :data:`COPY_PIECE` bytes is copied once from memory into a reusable buffer and
    hashed there by a ``pool`` thread, while this thread writes the pieces already hashed: the
    digest is that of the bytes in the file even if the source changes meanwhile, and copying
    and hashing overlap the writing.
    """
    digests: dict[Any, bytes] = {}
    hashers: dict[Any, hashing.Hasher] = {}
    pieces: list[tuple[Any, int, ByteSource, int, int]] = []
    steps: list[int | Span] = []  # what the writing loop does, in order: a piece (its index), a small span (direct)
    batch = _Batch(fh)
    take, oneshot = batch.take, hashing.oneshot(hash_id)
    for span in sorted(spans, key=lambda span: span[1]) if stream is not None else spans:
        key, offset, source, start, stop = span
        n = stop - start
        if n <= _INLINE:  # not worth a round trip through the pool
            if stream is not None:  # a direct stream takes its bytes in file order: with the pieces
                steps.append(span)
                continue
            pos = take(offset, n)
            digests[key] = oneshot(_copy_small(source, start, stop, batch.buf[pos:pos + n], batch.mv[pos:pos + n]))
            continue
        hashers[key] = hashing.new_hasher(hash_id)
        first = len(pieces)
        pieces += [(key, offset + lo - start, source, lo, min(stop, lo + COPY_PIECE))
                   for lo in range(start, stop, COPY_PIECE)]
        steps += range(first, len(pieces))
    batch.flush()
    if not steps:
        return digests
    bufs = [_acquire() for _ in range(min(_RING, len(pieces)))]
    queue: deque[Future[np.ndarray]] = deque()
    last: dict[Any, Future[np.ndarray]] = {}
    # A direct stream writes a piece from its buffer while this thread goes on: one buffer fewer is filled ahead, and
    # a buffer is filled again once its piece's write ended.
    writing: list[Future[None] | None] = [None] * len(bufs)
    ahead = len(bufs) - 1 if stream is not None and len(bufs) > 1 else len(bufs)

    def submit(i: int) -> None:
        # Piece i reuses the buffer of piece i - len(bufs), written by then; for a direct stream, at its offset within
        # a block (written from the buffer as it is).
        key, offset, source, lo, hi = pieces[i]
        slot = i % len(bufs)
        if writing[slot] is not None:
            done, writing[slot] = writing[slot], None
            done.result()  # type: ignore[union-attr]
        buf = bufs[slot] if stream is None else bufs[slot][offset % ALIGN:]
        last[key] = pool.submit(_fill, source, lo, hi, buf, hashers[key], last.get(key))
        queue.append(last[key])

    try:
        for i in range(min(ahead, len(pieces))):
            submit(i)
        position, small = -1, np.empty(_INLINE if stream is not None else 0, np.uint8)
        for i in steps:
            if not isinstance(i, int):  # a small span, to a direct stream
                key, offset, source, start, stop = i
                n = stop - start
                data = _copy_small(source, start, stop, small[:n], memoryview(small)[:n])
                digests[key] = oneshot(data)
                stream.write(offset, data)  # type: ignore[union-attr]
                continue
            data = queue.popleft().result()
            offset = pieces[i][1]
            if stream is not None:
                writing[i % len(bufs)] = stream.write_from(offset, bufs[i % len(bufs)], len(data))
            else:
                if offset != position:
                    fh.seek(offset)
                _write_all(fh, memoryview(data))
            position = offset + len(data)
            if i + ahead < len(pieces):
                submit(i + ahead)
        digests.update((key, hasher.digest()) for key, hasher in hashers.items())
        return digests
    finally:
        for future in [*queue, *(w for w in writing if w is not None)]:  # after a failure: no task may still fill
            with contextlib.suppress(Exception):  # or write a buffer given back
                future.result()
        for buf in bufs:
            _release(buf)


def _write_compressed(fh: BinaryIO, source: ByteSource, start: int, stop: int, hid: int,
                      codec: tuple[Any, int]) -> tuple[bytes, int, bool, list[int] | None]:
    """Encode one container's raw span and write it: ``(digest, stored size, stored plain, frame sizes)``."""
    view = source.view(start, stop)
    # a non-contiguous array: its span copied into one buffer (bytes of each piece, then their join, were two)
    raw = view if view is not None else copy_span(source, start, stop, np.empty(stop - start, np.uint8))
    pieces, plain, frames = compression.encode_container(codec[0], raw, codec[1])
    if plain and view is not None:
        # Stored as is: from a private copy (the encoder's output already is one), so that the
        # bytes hashed are the bytes written even if the array changes meanwhile.
        del pieces
        pieces = [copy_span(source, start, stop, np.empty(stop - start, np.uint8))]
    hasher = hashing.new_hasher(hid)
    for piece in pieces:
        hasher.update(piece)
        _write_all(fh, memoryview(piece))
    return hasher.digest(), sum(memoryview(p).nbytes for p in pieces), plain, frames


def write_ftiff(fh: BinaryIO, layout: Layout, sources: Mapping[int, ByteSource], *, hash_id: int,
                trailer: Mapping[str, Any], pt_fs: int | None = None, max_fs: int | None = None,
                timestamp: int | None = None, pool: ThreadPoolExecutor | None = None,
                codecs: Mapping[int, tuple[Any, int]] | None = None, direct: bool = False) -> WrittenFile:
    """Write the whole file to ``fh`` (positioned anywhere; seekable) and return its metadata.

    ``codecs`` maps a variable id to ``(numcodecs codec, itemsize)``: its containers are stored
    compressed (see :mod:`ftidask.ftiff.compression`; ``chunksize`` is then the stored size).
    ``direct``: the data written around the page cache (:mod:`ftidask.storage.direct`) when there are at least
    :data:`DIRECT_MIN` bytes of it, none compressed, and the file system allows; ``fh``'s file must be new.
    """
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")
    try:
        digests: dict[tuple[int, int], bytes] = {}
        stored_sizes: dict[tuple[int, int], int] = {}
        plain: dict[int, list[int]] = {}
        frames: dict[int, dict[int, list[int]]] = {}
        spans: list[Span] = []
        data_bytes = 0
        for bi, block in enumerate(layout.blocks):
            for si, slot in enumerate(block.slots):
                if slot.chunksize <= 0:  # no content
                    continue
                source = sources[slot.var_id]
                if codecs and slot.var_id in codecs:
                    fh.seek(slot.fptr)
                    digests[bi, si], size, is_plain, sizes = _write_compressed(
                        fh, source, slot.dptr, slot.dptr + slot.chunksize, hash_id, codecs[slot.var_id])
                    stored_sizes[bi, si] = size
                    if is_plain:
                        plain.setdefault(slot.var_id, []).append(slot.containerid)
                    if sizes:
                        frames.setdefault(slot.var_id, {})[slot.containerid] = sizes
                    data_bytes += size
                    continue
                spans.append(((bi, si), slot.fptr, source, slot.dptr, slot.dptr + slot.chunksize))
                data_bytes += slot.chunksize
        stream = None
        if direct and not stored_sizes and data_bytes >= DIRECT_MIN:
            fh.flush()
            stream = open_stream(fh.fileno())
        try:
            digests.update(write_spans(fh, spans, hash_id, pool, stream))
            if stream is not None:  # every direct write ended before the metadata is written through the cache
                stream.close()
        finally:
            if stream is not None:
                stream.abort()
        if codecs:
            trailer = dict(trailer)
            compression.annotate_trailer(trailer, plain, frames)
        written = write_metadata(fh, layout, digests, hash_id=hash_id, trailer=trailer, pt_fs=pt_fs, max_fs=max_fs,
                                 timestamp=timestamp, stored_sizes=stored_sizes if codecs else None)
        return dataclasses.replace(written, data_bytes=data_bytes)
    finally:
        if own_pool:
            pool.shutdown(wait=True)


def write_metadata(fh: BinaryIO, layout: Layout, digests: Mapping[tuple[int, int], bytes], *, hash_id: int,
                   trailer: Mapping[str, Any], pt_fs: int | None = None, max_fs: int | None = None,
                   timestamp: int | None = None, flags: int = FLAG_METADATA_CHECKSUM,
                   section: bytes | memoryview = b"",
                   stored_sizes: Mapping[tuple[int, int], int] | None = None) -> WrittenFile:
    """Write every block's metadata, ``section`` at ``fs`` (a dCP file's block hashes), the table,
    then the FB; truncate the file. ``digests`` maps (block, slot) to the container hash;
    ``stored_sizes`` (compressed containers) to the stored ``chunksize``, which ``ckptSize`` sums.

    ``data_bytes`` of the result is 0: the data were written by the caller.
    """
    checksum = hashing.new_hasher(hash_id)
    blocks_raw = []
    pack_into, zero, ckpt_size = VMD_STRUCT.pack_into, bytes(16), 0
    for bi, block in enumerate(layout.blocks):
        # packed in place, no object per container (10,000 containers: 8 us each as ContainerMeta objects)
        raw = bytearray(block.metasize)
        BMD_STRUCT.pack_into(raw, 0, block.numvars, block.dbsize)
        pos = BMD_SIZE
        for si, s in enumerate(block.slots):
            chunk = s.chunksize
            if chunk > 0:
                digest = digests.get((bi, si), zero)
                if stored_sizes is not None:
                    chunk = stored_sizes.get((bi, si), chunk)
                pack_into(raw, pos, s.var_id, s.idx, s.containerid, 1, s.dptr, s.fptr, chunk, s.containersize, digest)
            else:
                pack_into(raw, pos, s.var_id, s.idx, s.containerid, 0, s.dptr, s.fptr, chunk, s.containersize, zero)
            ckpt_size += chunk
            pos += VMD_SIZE
        fh.seek(block.offset)
        fh.write(raw)
        checksum.update(raw)
        blocks_raw.append(bytes(raw))
    tail = pack_trailer(json.dumps(dict(trailer), separators=(",", ":"), sort_keys=True).encode())
    fh.seek(layout.fs)
    if len(section):
        fh.write(section)
    fh.write(tail)
    checksum.update(tail)
    fb = FileBlock(checksum.hexdigest()[:32], bytes(16), ckpt_size, layout.fs,
                   max_fs if max_fs is not None else layout.fs, pt_fs if pt_fs is not None else layout.fs,
                   timestamp if timestamp is not None else time.time_ns(), hash_id=hash_id,
                   flags=flags).sealed()
    fh.seek(0)
    fh.write(fb.pack())
    size = layout.fs + len(section) + len(tail)
    # Unused container space stays a hole, read back as zeros. A new file already ends at ``size`` (the
    # trailer is written last): ext4 truncates even to the same size, waiting for its journal (up to
    # 75 ms measured here with the file's write-back in flight), so only a file that is not is cut.
    if fh.seek(0, os.SEEK_END) != size:
        fh.truncate(size)
    return WrittenFile(fb, tuple(blocks_raw), size, 0)


def sync(fh: BinaryIO) -> None:
    """Flush Python's buffer and the kernel's to the device."""
    fh.flush()
    os.fsync(fh.fileno())
