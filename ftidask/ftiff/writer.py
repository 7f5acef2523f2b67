"""Write one FTI-FF file from a layout and the byte streams of the variables.

Data first, container by container, then the metadata (whose hashes are known only then),
the variable table, and the file block last. The caller owns the file handle (and so the
atomic commit): the writer knows nothing of paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

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


def _write_all(fh: BinaryIO, data: memoryview) -> None:
    for lo in range(0, len(data), _WRITE_PIECE):
        piece = data[lo:lo + _WRITE_PIECE]
        fh.write(piece)
        if len(piece) >= _WRITEBACK_MIN:  # the disk starts on it while the next piece is written
            fh.flush()
            storage.start_writeback(fh.fileno(), fh.tell() - len(piece), len(piece))


def _write_slot(fh: BinaryIO, source: ByteSource, start: int, stop: int, hid: int,
                pool: ThreadPoolExecutor) -> Future[bytes] | bytes:
    view = source.view(start, stop)
    if view is not None:
        # Hash on a second thread while this one writes: both release the GIL.
        future = pool.submit(hashing.digest, hid, view)
        _write_all(fh, view)
        return future
    hasher = hashing.new_hasher(hid)
    for piece in source.pieces(start, stop):
        hasher.update(piece)
        fh.write(piece)
    return hasher.digest()


def _write_compressed(fh: BinaryIO, source: ByteSource, start: int, stop: int, hid: int,
                      codec: tuple[Any, int]) -> tuple[bytes, int, bool]:
    """Encode one container's raw span and write it: ``(digest, stored size, stored plain)``."""
    view = source.view(start, stop)
    raw = view if view is not None else b"".join(bytes(p) for p in source.pieces(start, stop))
    stored, plain = compression.encode_span(codec[0], raw, codec[1])
    _write_all(fh, memoryview(stored))
    return hashing.digest(hid, stored), len(stored), plain


def write_container(fh: BinaryIO, source: ByteSource, start: int, stop: int, hash_id: int,
                    pool: ThreadPoolExecutor) -> Future[bytes] | bytes:
    """Write bytes ``[start, stop)`` of ``source`` at ``fh``'s position: their digest, or a future of it."""
    return _write_slot(fh, source, start, stop, hash_id, pool)


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
                digests[bi, si] = _write_slot(fh, source, slot.dptr, slot.dptr + slot.chunksize, hash_id, pool)
                data_bytes += slot.chunksize
        done = {key: (p.result() if isinstance(p, Future) else p) for key, p in digests.items()}
        if codecs:
            trailer = dict(trailer)
            compression.annotate_trailer(trailer, plain)
        written = write_metadata(fh, layout, done, hash_id=hash_id, trailer=trailer, pt_fs=pt_fs, max_fs=max_fs,
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
