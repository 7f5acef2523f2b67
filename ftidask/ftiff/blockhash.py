"""Block-hashed FTI-FF files, as written by differential checkpointing (dCP).

A dCP file is an ordinary ftidask FTI-FF file (same FB, VB, offsets and variable table) with
flag :data:`FLAG_DCP` set in the FB, and two differences that let a checkpoint rewrite only the
blocks that changed without ever re-reading the unchanged ones:

* each container's chunk is cut into blocks of ``block_size`` bytes (the last one shorter), and
  the digest of every block is kept in a *block-hash section* placed between the VB (offset
  ``fs``) and the variable table: the digests of every container with content, in container
  order, ``digest_size`` bytes each;
* a container's hash (the 16 bytes of its VMD) is the file's hash (FB ``hash_id``) over the
  concatenation of its block digests, not over its data.

The FB checksum still covers every metadata byte, the container hashes and the table, so the
block digests are bound to the FB through the container hashes; the table's ``dcp`` entry records
the block size, the block hash and the section's length. :func:`verify_dcp` checks every
container hash against its digests, then every data block against its digest.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import xxhash

from ..model.errors import FormatError
from . import hashing
from .readahead import read_full

if TYPE_CHECKING:
    from .reader import ByteTarget, FtiffFile

FLAG_DCP = 2
MIN_BLOCK, MAX_BLOCK = 512, 65535  # FTI's bounds for dcp_block_size


def _md5(data: memoryview) -> bytes:
    return hashlib.md5(data).digest()


def _crc32(data: memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "little")


def _blake2b(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


#: block hash id (recorded in the table) -> (name, digest size, one-shot digest function).
#: Ids are part of the format: never reuse one (they are not the config's dcp_mode numbers: see DCP_MODES).
BLOCK_HASHES: dict[int, tuple[str, int, Callable[[memoryview], bytes]]] = {
    1: ("md5", 16, _md5),
    2: ("crc32", 4, _crc32),
    3: ("xxh3_64", 8, xxhash.xxh3_64_digest),
    4: ("xxh3_128", 16, xxhash.xxh3_128_digest),
    5: ("blake2b_128", 16, _blake2b),
}
try:  # the native kernel is optional (built when a C compiler is there at install)
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None
#: one-shot functions the native kernel computes byte for byte, with their digest width.
_NATIVE_WIDTH: dict[Callable[[memoryview], bytes], int] = {xxhash.xxh3_128_digest: 16, xxhash.xxh3_64_digest: 8}


def native_kernel() -> bool:
    """True when XXH3 block digests are computed by the native kernel (see ``setup.py``)."""
    return _native is not None


#: config ``dcp_mode`` -> block hash id. 1 MD5 and 2 CRC32 as FTI reads them (its conf.c adds 2000: 2001 MD5, 2002
#: CRC32; ftidask read 1 as CRC32 before: an FTI config asking for MD5 got CRC32); 0 MD5 as earlier ftidask configs
#: wrote it (FTI refuses 0); 3 xxh3_128 (the default), 4 BLAKE2b-128 and 5 xxh3_64 are ftidask's.
DCP_MODES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 5, 5: 3}


def block_hash_id(dcp_mode: int) -> int:
    """The block hash id selected by the config key ``dcp_mode``."""
    try:
        return DCP_MODES[dcp_mode]
    except KeyError:
        raise ValueError(f"unknown dcp_mode {dcp_mode}; known: {sorted(DCP_MODES)}") from None


def block_hash(bid: int) -> tuple[str, int, Callable[[memoryview], bytes]]:
    """``(name, digest_size, function)`` of block hash id ``bid``."""
    try:
        return BLOCK_HASHES[bid]
    except KeyError:
        raise FormatError(f"unknown block hash id {bid}") from None


def nblocks(chunksize: int, block_size: int) -> int:
    """How many dCP blocks cover ``chunksize`` bytes (the last one may be short)."""
    return -(-chunksize // block_size)


def container_hash(hash_id: int, digests: np.ndarray) -> bytes:
    """A dCP container's hash: the file's hash over its block digests (an ``(n, D)`` uint8 array)."""
    return hashing.digest(hash_id, memoryview(np.ascontiguousarray(digests)).cast("B"))


def table_entry(block_size: int, bid: int, section_len: int) -> dict[str, Any]:
    """The ``dcp`` entry of the variable table."""
    name, size, _fn = block_hash(bid)
    return {"block_size": block_size, "block_hash": name, "block_hash_id": bid, "digest_size": size,
            "section_len": section_len}


class DcpInfo:
    """The checked ``dcp`` entry of a file's table, with where each container's digests are."""

    def __init__(self, parsed: FtiffFile) -> None:
        entry = (parsed.trailer or {}).get("dcp")
        if not isinstance(entry, dict):
            raise FormatError("dCP flag set but the table has no 'dcp' entry", path=parsed.path)
        try:
            self.block_size = int(entry["block_size"])
            self.bid = int(entry["block_hash_id"])
            self.section_len = int(entry["section_len"])
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int() of JSON's Infinity
            raise FormatError(f"invalid 'dcp' entry {entry!r}", path=parsed.path) from None
        if not MIN_BLOCK <= self.block_size <= MAX_BLOCK:
            raise FormatError(f"dCP block size {self.block_size} outside [{MIN_BLOCK}, {MAX_BLOCK}]",
                              path=parsed.path)
        try:
            self.name, self.digest_size, self.fn = block_hash(self.bid)
        except FormatError as exc:
            raise FormatError(str(exc), path=parsed.path) from None
        self.spans: dict[tuple[int, int], tuple[int, int]] = {}  # (bi, ci) -> (offset, count) in section
        pos = 0
        for bi, ci, meta in parsed.containers():
            if meta.hascontent:
                count = nblocks(meta.chunksize, self.block_size)
                self.spans[bi, ci] = (pos, count)
                pos += count * self.digest_size
        if pos != self.section_len or parsed.fb.fs + pos > parsed.file_size:
            raise FormatError(f"block-hash section of {self.section_len} bytes, the containers need {pos}",
                              path=parsed.path)
        self.offset = parsed.fb.fs

    def read_section(self, fh: BinaryIO, path: str) -> np.ndarray:
        """The file's block-hash section (uint8); :class:`FormatError` if truncated."""
        raw = os.pread(fh.fileno(), self.section_len, self.offset)
        if len(raw) != self.section_len:
            raise FormatError("block-hash section truncated", path=path)
        return np.frombuffer(raw, np.uint8)

    def digests(self, section: np.ndarray, key: tuple[int, int]) -> np.ndarray:
        """The ``(n, D)`` digests of container ``key`` = (block index, container index)."""
        start, count = self.spans[key]
        return section[start:start + count * self.digest_size].reshape(count, self.digest_size)


def read_digests(fh: BinaryIO, parsed: FtiffFile) -> tuple[DcpInfo, dict[tuple[int, int], np.ndarray]]:
    """Every container's block digests, each checked against its container hash."""
    info = DcpInfo(parsed)
    section = info.read_section(fh, parsed.path)
    out = {}
    for bi, ci, meta in parsed.containers():
        if not meta.hascontent:
            continue
        digests = info.digests(section, (bi, ci))
        if container_hash(parsed.fb.hash_id, digests) != meta.hash:
            raise FormatError(f"block {bi}, container {ci} (var id {meta.id}): block hashes do not match the "
                              "container hash (damaged block-hash section)", path=parsed.path)
        out[bi, ci] = digests
    return info, out


def check_container(fh: BinaryIO, parsed: FtiffFile, meta: Any, data: memoryview) -> None:
    """Check ``data``, read from container ``meta`` of a dCP file, against its block digests
    (themselves checked against the container hash); :class:`FormatError` if any differs."""
    # This container's digests only, its place found in an index made once per parsed file: each chunk a Dask
    # worker read read and checked the whole section and looked for its container in a pass over all of them
    info = parsed.memo("dcp_info", lambda: DcpInfo(parsed))
    key = parsed.memo("dcp_keys", lambda: {id(m): (bi, ci) for bi, ci, m in parsed.containers()}).get(id(meta))
    if key is None or len(data) != meta.chunksize or key not in info.spans:
        raise FormatError(f"var id {meta.id}: not a container of this file", path=parsed.path)
    start, count = info.spans[key]
    raw = os.pread(fh.fileno(), count * info.digest_size, info.offset + start)
    if len(raw) != count * info.digest_size:
        raise FormatError("block-hash section truncated", path=parsed.path)
    digests = np.frombuffer(raw, np.uint8).reshape(count, info.digest_size)
    if container_hash(parsed.fb.hash_id, digests) != meta.hash:
        raise FormatError(f"block {key[0]}, container {key[1]} (var id {meta.id}): block hashes do not match the "
                          "container hash (damaged block-hash section)", path=parsed.path)
    check_blocks(data, info, digests, 0, f"block {key[0]}, container {key[1]} (var id {meta.id})", parsed.path)


def read_blocks_checked(fh: BinaryIO, parsed: FtiffFile, key: tuple[int, int], meta: Any, lo: int, hi: int,
                        out: memoryview | None) -> None:
    """Bytes ``[lo, hi)`` of container ``meta`` (``key`` = (block, container)) of a dCP file into ``out`` (None: only
    checked), every block they touch read and checked against its digest (the digests checked against the
    container hashes once per parsed file): a piece of a container is verified without reading the rest of it, as a
    restart on another number of ranks needs. The whole blocks inside ``[lo, hi)`` are read straight into ``out`` and
    checked there (``out`` must then be a buffer of the caller's that is dropped on a refusal, never a user's array);
    the blocks cut at either end go through a buffer. :class:`FormatError` when a block does not match or the file
    ends inside it."""
    info, digests = parsed.memo("dcp_digests", lambda: read_digests(fh, parsed))
    bs = info.block_size
    where = f"block {key[0]}, container {key[1]} (var id {meta.id})"
    inner_lo = -(-lo // bs) * bs  # the whole blocks inside [lo, hi): the last one may be the container's short end
    inner_hi = hi if hi == meta.chunksize else hi // bs * bs
    if out is None or inner_hi <= inner_lo:
        _blocks_through_buffer(fh, parsed, info, digests[key], meta, lo, hi, out, where)
        return
    if lo < inner_lo:
        _blocks_through_buffer(fh, parsed, info, digests[key], meta, lo, inner_lo, out[:inner_lo - lo], where)
    step = max(1, _PIECE_BYTES // bs) * bs
    for start in range(inner_lo, inner_hi, step):
        view = out[start - lo:min(start + step, inner_hi) - lo]
        if read_full(fh.fileno(), meta.fptr + start, view) != len(view):
            raise FormatError(f"{where}: file ends inside its data", path=parsed.path)
        check_blocks(view, info, digests[key], start // bs, where, parsed.path)
    if inner_hi < hi:
        _blocks_through_buffer(fh, parsed, info, digests[key], meta, inner_hi, hi, out[inner_hi - lo:], where)


def _blocks_through_buffer(fh: BinaryIO, parsed: FtiffFile, info: DcpInfo, digests: np.ndarray, meta: Any, lo: int,
                           hi: int, out: memoryview | None, where: str) -> None:
    """:func:`read_blocks_checked` of ``[lo, hi)`` through a buffer of whole blocks (at most a piece at a time)."""
    bs = info.block_size
    step = max(1, _PIECE_BYTES // bs) * bs
    buf = memoryview(bytearray(min(step, -(-(hi - lo) // bs) * bs + bs)))
    for start in range(lo - lo % bs, hi, step):  # whole blocks, a piece at a time
        stop = min(start + step, -(-hi // bs) * bs, meta.chunksize)
        view = buf[:stop - start]
        if read_full(fh.fileno(), meta.fptr + start, view) != len(view):
            raise FormatError(f"{where}: file ends inside its data", path=parsed.path)
        check_blocks(view, info, digests, start // bs, where, parsed.path)
        if out is not None:
            a, b = max(lo, start), min(hi, stop)
            out[a - lo:b - lo] = view[a - start:b - start]


_PIECE_BYTES = 8 << 20  # bytes read and checked at a time by read_blocks_checked


def check_blocks(view: memoryview, info: DcpInfo, digests: np.ndarray, first: int, where: str, path: str) -> None:
    """Check the blocks of ``view`` (blocks ``first``, ``first + 1``, ... of a container) against ``digests`` (the
    container's): :class:`FormatError` naming the first that differs, as ``where``'s data block number."""
    got = block_digests(view, info.block_size, info.fn, info.digest_size)
    bad = np.flatnonzero((got != digests[first:first + len(got)]).any(axis=1))
    if len(bad):
        raise FormatError(f"{where}: data block {first + int(bad[0])} does not match its hash (damaged data)",
                          path=path)


def block_digests(data: memoryview, block_size: int, fn: Callable[[memoryview], bytes],
                  digest_size: int) -> np.ndarray:
    """The ``(n, D)`` digests of ``data`` cut into blocks of ``block_size`` bytes.

    XXH3 digests come from the native kernel when it is built (one call, GIL released, so the
    segments hashed by a thread pool run on every core); the bytes are the same either way.
    """
    n = nblocks(len(data), block_size)
    width = _NATIVE_WIDTH.get(fn) if _native is not None else None
    if width is not None:
        out = np.empty((n, width), np.uint8)
        _native.xxh3_blocks(data, block_size, out, width)
        return out
    raw = b"".join([fn(data[lo:lo + block_size]) for lo in range(0, len(data), block_size)])
    return np.frombuffer(raw, np.uint8).reshape(n, digest_size)


def _spans(parsed: FtiffFile, only: set[int] | None) -> Iterator[tuple[int, int, Any]]:
    for bi, ci, meta in parsed.containers():
        if meta.hascontent and (only is None or meta.id in only):
            yield bi, ci, meta


_PIECE_BLOCKS = 1024  # blocks read per piece while verifying (<= 64 MiB)


def verify_dcp(fh: BinaryIO, parsed: FtiffFile, only: set[int] | None = None) -> None:
    """Check every container hash against its block digests, and every block against its digest."""
    info, digests = read_digests(fh, parsed)
    piece = info.block_size * _PIECE_BLOCKS
    buf = bytearray(piece)
    for bi, ci, meta in _spans(parsed, only):
        want = digests[bi, ci]
        for lo in range(0, meta.chunksize, piece):
            n = min(piece, meta.chunksize - lo)
            view = memoryview(buf)[:n]
            if read_full(fh.fileno(), meta.fptr + lo, view) != n:
                raise FormatError(f"block {bi}, container {ci}: file ends inside its data", path=parsed.path)
            check_blocks(view, info, want, lo // info.block_size, f"block {bi}, container {ci} (var id {meta.id})",
                         parsed.path)


def read_into_dcp(fh: BinaryIO, parsed: FtiffFile, targets: Mapping[int, ByteTarget]) -> None:
    """Copy the chunks of the variables in ``targets`` into them, checking every block digest."""
    info, digests = read_digests(fh, parsed)
    piece = info.block_size * _PIECE_BLOCKS
    buf: bytearray | None = None
    for bi, ci, meta in _spans(parsed, set(targets)):
        target = targets[meta.id]
        want = digests[bi, ci]
        for lo in range(0, meta.chunksize, piece):
            n = min(piece, meta.chunksize - lo)
            direct = target.view(meta.dptr + lo, meta.dptr + lo + n)
            if direct is None:
                buf = buf or bytearray(piece)
            view = direct if direct is not None else memoryview(buf)[:n]  # type: ignore[arg-type]
            got_n = read_full(fh.fileno(), meta.fptr + lo, view)
            first = lo // info.block_size
            got = block_digests(view, info.block_size, info.fn, info.digest_size)
            if got_n != n or (got != want[first:first + len(got)]).any():
                raise FormatError(f"block {bi}, container {ci} (var id {meta.id}) changed while it was read",
                                  path=parsed.path)
            if direct is None:
                target.store(meta.dptr + lo, view)
