"""FTI-FF as FTI writes it since the differential-checkpoint rework (FTI 1.2 on): data first,
all metadata at the end of the file.

This is the layout of ``src/IO/ftiff.c`` in leobago/fti (checked against commit 196f77d2 and the
later ``FTIT_keymap`` version 00dfba26; files in ``tests/data/fti_written/``)::

    [0, dataSize)        the containers' data, block after block, no metadata in between
    [dataSize, fs - 110) per block: numvars int32, dbsize int64 (data bytes only);
                         then per container (FTIFF_SerializeDbVarMeta, packed):
                         id int32, [idx int32,] containerid int32, hascontent u8, hasCkpt u8,
                         dptr u64, fptr u64, chunksize i64, containersize i64, hash[16] (MD5 of the chunk)
    [fs - 110, fs)       FTIFF_SerializeFileMeta: checksum[33] (hex), myHash[16], ckptID int32,
                         ckptSize, metaSize, dataSize, fs, maxFs, ptFs, timestamp (int64), then one
                         byte FTI leaves unwritten (``FTI_filemetastructsize += 2 - size % 2``, tools.c)

``myHash`` is MD5(checksum[33], timestamp, ckptSize, metaSize, dataSize, fs, ptFs, maxFs)
(``FTIFF_GetHashMetaInfo``). ``checksum`` is the MD5 of the containers' 16-byte hashes, in file
order: FTI's writer (``FTIFF_writeMetaDataFTIFF``) takes every container's, its reader
(``FTIFF_GetFileChecksum``) only those with content; a container left empty by a shrink keeps a
stale hash, so the two differ there and either is accepted. The per-container metadata carries
no hash of its own in the file: the layout checks below (contiguous containers inside the data
area, every variable's bytes tiled once) stand for it; every data byte is checked by its
container's MD5 before it reaches an array.

The ``FTIT_keymap`` version drops ``idx`` (58-byte records); both record sizes are tried and the
one whose walk ends exactly at the file metadata and whose checksum matches is taken.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import BinaryIO

from ..model.errors import FormatError
from .structs import BlockMeta, ContainerMeta, FileBlock

TAIL_FB_SIZE = 110  # 109 serialized bytes, rounded up to even by FTI (the last byte is not written)
_TAIL_FB = struct.Struct("<33s16siqqqqqqq")  # 109 bytes
_DB = struct.Struct("<iq")  # 12 bytes
_DBVAR_IDX = struct.Struct("<iiiBBQQqq16s")  # 62 bytes: with idx (FTIT_dataset arrays)
_DBVAR_NOIDX = struct.Struct("<iiBBQQqq16s")  # 58 bytes: without (FTIT_keymap)
_HASHED = struct.Struct("<qqqqqqq")  # timestamp, ckptSize, metaSize, dataSize, fs, ptFs, maxFs

Blocks = tuple[tuple[BlockMeta, tuple[ContainerMeta, ...]], ...]


def _unpack_fb(raw: bytes) -> tuple[FileBlock, int, int, int] | None:
    """The file block, metaSize, dataSize and ckptID, or None unless ``myHash`` matches."""
    checksum, my_hash, ckpt_id, ckpt_size, meta_size, data_size, fs, max_fs, pt_fs, timestamp = \
        _TAIL_FB.unpack(raw[:_TAIL_FB.size])
    hashed = _HASHED.pack(timestamp, ckpt_size, meta_size, data_size, fs, pt_fs, max_fs)
    if hashlib.md5(checksum + hashed).digest() != my_hash:
        return None
    end = checksum.find(b"\0")
    try:
        text = checksum[:end if end >= 0 else 32].decode("ascii")
    except UnicodeDecodeError:
        return None
    fb = FileBlock(text, my_hash, ckpt_size, fs, max_fs, pt_fs, timestamp, magic=b"", version=0, hash_id=1, flags=0)
    return fb, meta_size, data_size, ckpt_id


def sniff(head_tail: bytes) -> bool:
    """Whether the last :data:`TAIL_FB_SIZE` bytes of a file are an FTI file metadata record."""
    return len(head_tail) == TAIL_FB_SIZE and _unpack_fb(head_tail) is not None


def parse_tail(fh: BinaryIO, path: str, file_size: int) -> tuple[FileBlock, Blocks] | None:
    """Parse a metadata-at-the-end file; None when its last bytes are no FTI file metadata
    (``myHash`` does not match), :class:`FormatError` when they are but the rest is inconsistent."""
    if file_size < TAIL_FB_SIZE:
        return None
    found = _unpack_fb(os.pread(fh.fileno(), TAIL_FB_SIZE, file_size - TAIL_FB_SIZE))
    if found is None:
        return None
    fb, meta_size, data_size, _ckpt_id = found
    if not (fb.fs == fb.ckpt_size == file_size and meta_size >= TAIL_FB_SIZE and data_size >= 0
            and meta_size + data_size == file_size):
        raise FormatError(f"FTI file metadata: fs={fb.fs}, ckptSize={fb.ckpt_size}, metaSize={meta_size}, "
                          f"dataSize={data_size} do not describe this file ({file_size} bytes)", path=path)
    meta = os.pread(fh.fileno(), meta_size - TAIL_FB_SIZE, data_size)
    problems = []
    for record in (_DBVAR_IDX, _DBVAR_NOIDX):
        for stride in sorted({record.size, _DBVAR_IDX.size}):
            try:
                blocks = _walk(meta, record, stride, data_size, path)
            except FormatError as exc:
                problems.append(str(exc))
                continue
            if fb.checksum in _checksums(blocks):
                return fb, blocks
            problems.append("checksum does not match the containers' hashes (damaged metadata)")
    raise FormatError(f"FTI metadata at byte {data_size}: {problems[0]}", path=path)


def _walk(meta: bytes, record: struct.Struct, stride: int, data_size: int, path: str) -> Blocks:
    """The blocks of the metadata area ``meta``; every container checked against the data area."""
    blocks = []
    pos = 0
    offset = 0  # where the next container's data must start
    while pos < len(meta):
        if pos + _DB.size > len(meta):
            raise FormatError(f"block {len(blocks)}: metadata runs past the file metadata", path=path)
        numvars, dbsize = _DB.unpack_from(meta, pos)
        pos += _DB.size
        if numvars < 1 or pos + stride * numvars > len(meta):
            raise FormatError(f"block {len(blocks)}: numvars={numvars} does not fit", path=path)
        metas = []
        start = offset
        for i in range(numvars):
            fields = record.unpack_from(meta, pos + i * stride)
            if record is _DBVAR_IDX:
                vid, idx, cid, has, _has_ckpt, dptr, fptr, chunk, csize, digest = fields
            else:
                (vid, cid, has, _has_ckpt, dptr, fptr, chunk, csize, digest), idx = fields, -1
            where = f"block {len(blocks)}, container {i} (var id {vid}, containerid {cid})"
            if fptr != offset or csize < 0 or offset + csize > data_size or has > 1:
                raise FormatError(f"{where}: fptr={fptr} containersize={csize} break the data layout", path=path)
            if not 0 <= chunk <= csize or (chunk and not has):
                raise FormatError(f"{where}: chunksize={chunk} invalid for containersize={csize}", path=path)
            metas.append(ContainerMeta(vid, idx, cid, bool(has), dptr, fptr, chunk, csize, digest))
            offset += csize
        pos += stride * numvars
        if dbsize != offset - start:
            raise FormatError(f"block {len(blocks)}: containers add up to {offset - start} bytes, dbsize={dbsize}",
                              path=path)
        blocks.append((BlockMeta(numvars, dbsize), tuple(metas)))
    if pos != len(meta) or not blocks:
        raise FormatError("block metadata does not end at the file metadata", path=path)
    return tuple(blocks)


def _checksums(blocks: Blocks) -> tuple[str, str]:
    """FTI's writer's checksum (every container's hash) and its reader's (containers with content)."""
    every, held = hashlib.md5(), hashlib.md5()
    for _bmd, metas in blocks:
        for meta in metas:
            every.update(meta.hash)
            if meta.hascontent:
                held.update(meta.hash)
    return every.hexdigest(), held.hexdigest()
