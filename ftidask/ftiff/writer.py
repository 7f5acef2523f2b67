"""Write one FTI-FF file from a layout and the byte streams of the variables.

Data first, container by container, then the metadata (whose hashes are known only then),
the variable table, and the file block last. The caller owns the file handle (and so the
atomic commit): the writer knows nothing of paths.

The application may write its arrays while they are checkpointed (another thread). The data
of such a checkpoint may be torn between pieces, as in FTI, but its file always verifies:
each piece is copied once from memory into a reusable buffer, and that copy is both hashed and
written (:class:`PieceWriter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

import numpy as np

from .. import storage
from ..layout import Layout
from . import compression, hashing
from .structs import FLAG_METADATA_CHECKSUM, BlockMeta, ContainerMeta, FileBlock
from .trailer import pack_trailer


class ByteSource(Protocol):
    """What the writer needs from a variable: its bytes by range."""

    nbytes: int

    def view(self, start: int, stop: int) -> memoryview | None: ...
    def pieces(self, start: int, stop: int) -> Iterable[memoryview]: ...


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """What was written: the file block, every container's metadata, and the byte counts."""

    fb: FileBlock
    containers: tuple[tuple[ContainerMeta, ...], ...]
    file_size: int
    data_bytes: int


_WRITE_PIECE = 64 << 20
_WRITEBACK_MIN = 8 << 20  # smaller writes are left to the final fsync
#: Bytes copied out of an array, hashed and written at a time. The array may be written by another
#: thread meanwhile: only a private copy guarantees that the bytes hashed are the bytes written.
COPY_PIECE = 8 << 20
_INLINE = 1 << 20  # containers up to this size are copied, hashed and written by the caller alone
_KEEP = 2  # copy buffers kept for the next checkpoint (COPY_PIECE each); more are freed after use
_free: list[np.ndarray] = []
_free_lock = threading.Lock()


def _acquire() -> np.ndarray:
    """A copy buffer of :data:`COPY_PIECE` bytes, reused between checkpoints (no page faults)."""
    with _free_lock:
        if _free:
            return _free.pop()
    return np.empty(COPY_PIECE, np.uint8)


def _release(buf: np.ndarray) -> None:
    with _free_lock:
        if len(_free) < _KEEP:
            _free.append(buf)


def _write_all(fh: BinaryIO, data: memoryview) -> None:
    for lo in range(0, len(data), _WRITE_PIECE):
        piece = data[lo:lo + _WRITE_PIECE]
        fh.write(piece)
        if len(piece) >= _WRITEBACK_MIN:  # the disk starts on it while the next piece is written
            fh.flush()
            storage.start_writeback(fh.fileno(), fh.tell() - len(piece), len(piece))


def copy_span(source: ByteSource, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """Copy bytes ``[start, stop)`` of ``source`` into ``out`` (one read of the memory): the
    filled part of ``out``. NumPy copies without the GIL, so hashing threads keep running."""
    n = stop - start
    view = source.view(start, stop)
    if view is not None:
        np.copyto(out[:n], np.frombuffer(view, np.uint8))
        return out[:n]
    pos = 0
    for piece in source.pieces(start, stop):
        np.copyto(out[pos:pos + len(piece)], np.frombuffer(piece, np.uint8))
        pos += len(piece)
    if pos != n:
        raise ValueError(f"byte source gave {pos} bytes for [{start}, {stop})")
    return out[:n]


def _update(hasher: hashing.Hasher, data: np.ndarray, before: Future[Any] | None) -> None:
    if before is not None:  # the pieces of one container are hashed in order, whatever the pool
        before.result()
    hasher.update(memoryview(data))


def _final(hasher: hashing.Hasher, before: Future[Any]) -> bytes:
    before.result()
    return hasher.digest()


class PieceWriter:
    """Writes byte ranges of sources through two reusable copy buffers: each piece is copied once
    from memory, then hashed (on ``pool``) and written (by the caller) from that copy, so the
    digest is that of the bytes in the file even if the source changes meanwhile. The copy of
    the next piece overlaps the hashing of the previous one. :meth:`close` waits for the pool."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self._bufs: list[np.ndarray] = []
        self._busy: list[Future[Any] | None] = [None, None]  # the last hashing task reading each buffer
        self._futures: list[Future[Any]] = []
        self._turn = 0

    def write(self, fh: BinaryIO, source: ByteSource, start: int, stop: int, hash_id: int) -> Future[bytes] | bytes:
        """Write bytes ``[start, stop)`` of ``source`` at ``fh``'s position: their digest, or a future of it."""
        if stop - start <= _INLINE:
            data = copy_span(source, start, stop, np.empty(stop - start, np.uint8))
            _write_all(fh, memoryview(data))
            return hashing.digest(hash_id, memoryview(data))
        hasher = hashing.new_hasher(hash_id)
        last: Future[Any] | None = None
        for lo in range(start, stop, COPY_PIECE):
            slot, self._turn = self._turn, 1 - self._turn
            if len(self._bufs) <= slot:
                self._bufs.append(_acquire())
            busy = self._busy[slot]
            if busy is not None:
                busy.result()  # the buffer is free once its last piece is hashed (written: already)
            data = copy_span(source, lo, min(stop, lo + COPY_PIECE), self._bufs[slot])
            last = self._busy[slot] = self.pool.submit(_update, hasher, data, last)
            self._futures.append(last)
            _write_all(fh, memoryview(data))
        assert last is not None
        digest = self.pool.submit(_final, hasher, last)
        self._futures.append(digest)
        return digest

    def close(self) -> None:
        """Wait for every hashing task (a failed write leaves none reading a buffer), free the buffers."""
        for future in self._futures:
            with contextlib.suppress(Exception):
                future.result()
        self._futures.clear()
        self._busy = [None, None]
        for buf in self._bufs:
            _release(buf)
        self._bufs.clear()

    def __enter__(self) -> PieceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_compressed(fh: BinaryIO, source: ByteSource, start: int, stop: int, hid: int,
                      codec: tuple[Any, int]) -> tuple[bytes, int, bool]:
    """Encode one container's raw span and write it: ``(digest, stored size, stored plain)``."""
    view = source.view(start, stop)
    raw = view if view is not None else b"".join(bytes(p) for p in source.pieces(start, stop))
    stored, plain = compression.encode_span(codec[0], raw, codec[1])
    if plain and view is not None:
        # Stored as is: from a private copy (the encoder's output already is one), so that the
        # bytes hashed are the bytes written even if the array changes meanwhile.
        del stored
        stored = copy_span(source, start, stop, np.empty(stop - start, np.uint8))
    _write_all(fh, memoryview(stored))
    return hashing.digest(hid, stored), len(stored), plain


def write_container(fh: BinaryIO, source: ByteSource, start: int, stop: int, hash_id: int,
                    pool: ThreadPoolExecutor) -> bytes:
    """Write bytes ``[start, stop)`` of ``source`` at ``fh``'s position: the digest of the bytes written."""
    with PieceWriter(pool) as writer:
        digest = writer.write(fh, source, start, stop, hash_id)
        return digest.result() if isinstance(digest, Future) else digest


def write_ftiff(fh: BinaryIO, layout: Layout, sources: Mapping[int, ByteSource], *, hash_id: int,
                trailer: Mapping[str, Any], pt_fs: int | None = None, max_fs: int | None = None,
                timestamp: int | None = None, pool: ThreadPoolExecutor | None = None,
                codecs: Mapping[int, tuple[Any, int]] | None = None) -> WrittenFile:
    """Write the whole file to ``fh`` (positioned anywhere; seekable) and return its metadata.

    ``codecs`` maps a variable id to ``(numcodecs codec, itemsize)``: its containers are stored
    compressed (see :mod:`ftidask.ftiff.compression`; ``chunksize`` is then the stored size).
    """
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")
    pieces = PieceWriter(pool)
    try:
        digests: dict[tuple[int, int], Future[bytes] | bytes] = {}
        stored_sizes: dict[tuple[int, int], int] = {}
        plain: dict[int, list[int]] = {}
        data_bytes = 0
        for bi, block in enumerate(layout.blocks):
            for si, slot in enumerate(block.slots):
                if not slot.hascontent:
                    continue
                source = sources[slot.var_id]
                fh.seek(slot.fptr)
                if codecs and slot.var_id in codecs:
                    digests[bi, si], size, is_plain = _write_compressed(
                        fh, source, slot.dptr, slot.dptr + slot.chunksize, hash_id, codecs[slot.var_id])
                    stored_sizes[bi, si] = size
                    if is_plain:
                        plain.setdefault(slot.var_id, []).append(slot.containerid)
                    data_bytes += size
                    continue
                digests[bi, si] = pieces.write(fh, source, slot.dptr, slot.dptr + slot.chunksize, hash_id)
                data_bytes += slot.chunksize
        done = {key: (p.result() if isinstance(p, Future) else p) for key, p in digests.items()}
        if codecs:
            trailer = dict(trailer)
            compression.annotate_trailer(trailer, plain)
        written = write_metadata(fh, layout, done, hash_id=hash_id, trailer=trailer, pt_fs=pt_fs, max_fs=max_fs,
                                 timestamp=timestamp, stored_sizes=stored_sizes if codecs else None)
        return dataclasses.replace(written, data_bytes=data_bytes)
    finally:
        pieces.close()
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
    containers = []
    for bi, block in enumerate(layout.blocks):
        metas = []
        for si, s in enumerate(block.slots):
            digest = digests.get((bi, si), bytes(16)) if s.hascontent else bytes(16)
            chunk = stored_sizes.get((bi, si), s.chunksize) if stored_sizes is not None else s.chunksize
            metas.append(ContainerMeta(s.var_id, s.idx, s.containerid, s.hascontent, s.dptr, s.fptr,
                                       chunk, s.containersize, digest))
        raw = BlockMeta(block.numvars, block.dbsize).pack() + b"".join(m.pack() for m in metas)
        fh.seek(block.offset)
        fh.write(raw)
        checksum.update(raw)
        containers.append(tuple(metas))
    tail = pack_trailer(json.dumps(dict(trailer), separators=(",", ":"), sort_keys=True).encode())
    fh.seek(layout.fs)
    if len(section):
        fh.write(section)
    fh.write(tail)
    checksum.update(tail)
    ckpt_size = (sum(m.chunksize for metas in containers for m in metas) if stored_sizes is not None
                 else layout.ckpt_size)
    fb = FileBlock(checksum.hexdigest()[:32], bytes(16), ckpt_size, layout.fs,
                   max_fs if max_fs is not None else layout.fs, pt_fs if pt_fs is not None else layout.fs,
                   timestamp if timestamp is not None else time.time_ns(), hash_id=hash_id,
                   flags=flags).sealed()
    fh.seek(0)
    fh.write(fb.pack())
    size = layout.fs + len(section) + len(tail)
    fh.truncate(size)  # unused container space stays a hole, read back as zeros
    return WrittenFile(fb, tuple(containers), size, 0)


def sync(fh: BinaryIO) -> None:
    """Flush Python's buffer and the kernel's to the device."""
    fh.flush()
    os.fsync(fh.fileno())
