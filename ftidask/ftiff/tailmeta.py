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
container's MD5 before it reaches an array. A variable id changed in a record cannot be told from
a real one (nor can FTI's reader): recovering such a file, a protected id is then missing, and the
recovery is refused before any array is touched (tests/test_fuzz.py fuzzes these files too).

The ``FTIT_keymap`` version drops ``idx`` (58-byte records); both record sizes are tried and the
one whose walk ends exactly at the file metadata and whose checksum matches is taken.

An earlier development state of this layout (``src/ftiff.c`` at leobago/fti 8e2e72fc, files in
``tests/data/fti_written/c8e2e72f/``) writes a 106-byte file metadata record: the same fields without
``ckptID`` (``FTIFF_SerializeFileMeta`` there: checksum, myHash, then seven int64;
``FTI_filemetastructsize`` = 33 + 16 + 7 * 8 = 105, rounded up to 106), with the same ``myHash`` recipe.
Which record a file ends with is told by which one's ``myHash`` matches (:data:`VARIANTS`).

FTI's latest sources (``src/IO/ftiff.c`` at 52f4cbeb, ``FTIFF_metaInfo`` in ``include/fti-intern.h`` at
cb10789a: the ``FTIT_Datatype`` API of FTI 1.6 and master) keep the sizes int64 but make the timestamp a
``uint32_t``: ``FTIFF_SerializeFileMeta`` writes checksum[33], myHash[16], ckptId int32, ckptSize,
metaSize, dataSize, fs, maxFs, ptFs (int64), timestamp uint32 (105 bytes), and ``myHash`` is
MD5(checksum[33], timestamp uint32, ckptSize, metaSize, dataSize, fs, ptFs, maxFs int64). Block and
container records are the ``FTIT_keymap`` ones above (12 and 58 bytes); the checksum is the writer's, over
every container's hash. The record sits at ``fs - FTI_filemetastructsize`` and what FTI writes after its
105 bytes is whatever its malloc'd buffer held. ``FTI_filemetastructsize`` (``FTI_InitExecVars``) of that
state was not found in the stored sources: 110 (``7 * sizeof(int64_t) + sizeof(int)``, rounded to even,
as before) and 106 (the 105 bytes rounded) are both tried; a wrong one cannot end the walk at the record.
(A transient state, tools.c at 09b551e2 with every ``long`` made ``int32_t``: 82/8/50-byte records, is not
read: its serializers were not found.) These two variants are built from FTI's sources, not checked
against a file FTI wrote (``tests/ftiff_builders.py`` builds such files independently).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

from ..model.errors import FormatError
from .structs import BlockMeta, ContainerMeta, FileBlock


@dataclass(frozen=True)
class TailVariant:
    """One FTI version's file metadata record at the end of the file."""

    name: str
    size: int  # FTI_filemetastructsize: the serialized bytes rounded up to even (the last byte is not written)
    record: struct.Struct
    has_ckpt_id: bool
    timestamp: str = "q"  # the timestamp's struct code, in the record and in myHash


#: The file metadata records FTI has written, newest first (the last two checked against FTI-written files).
_MASTER = struct.Struct("<33s16siqqqqqqI")  # 105 bytes: FTI 1.6 / master, src/IO/ftiff.c at 52f4cbeb
VARIANTS = (
    TailVariant("FTI 1.6/master (52f4cbeb, from its sources)", 110, _MASTER, True, "I"),
    TailVariant("FTI 1.6/master (52f4cbeb, from its sources, 106-byte area)", 106, _MASTER, True, "I"),
    TailVariant("FTI 1.3-1.4 (196f77d2)", 110, struct.Struct("<33s16siqqqqqqq"), True),  # 109 bytes
    TailVariant("FTI 1.2 development (8e2e72fc)", 106, struct.Struct("<33s16sqqqqqqq"), False),  # 105 bytes
)
TAIL_FB_SIZE = max(v.size for v in VARIANTS)  # the last bytes to read to recognise any variant
_DB = struct.Struct("<iq")  # 12 bytes
_DBVAR_IDX = struct.Struct("<iiiBBQQqq16s")  # 62 bytes: with idx (FTIT_dataset arrays)
_DBVAR_NOIDX = struct.Struct("<iiBBQQqq16s")  # 58 bytes: without (FTIT_keymap)
_HASHED = struct.Struct("<qqqqqq")  # after the timestamp: ckptSize, metaSize, dataSize, fs, ptFs, maxFs

_MAX_META = 64 << 20  # block and container records of a file: 62 bytes a container

Blocks = tuple[tuple[BlockMeta, tuple[ContainerMeta, ...]], ...]


def _unpack_fb(tail: bytes) -> tuple[TailVariant, FileBlock, int, int] | None:
    """The variant, file block, metaSize and dataSize of the record ``tail`` ends with, or None
    unless one variant's ``myHash`` matches."""
    for variant in VARIANTS:
        if len(tail) < variant.size:
            continue
        fields = variant.record.unpack_from(tail, len(tail) - variant.size)
        if variant.has_ckpt_id:
            checksum, my_hash, _ckpt_id, ckpt_size, meta_size, data_size, fs, max_fs, pt_fs, timestamp = fields
        else:
            checksum, my_hash, ckpt_size, meta_size, data_size, fs, max_fs, pt_fs, timestamp = fields
        hashed = struct.pack("<" + variant.timestamp, timestamp) + _HASHED.pack(ckpt_size, meta_size, data_size,
                                                                               fs, pt_fs, max_fs)
        if hashlib.md5(checksum + hashed).digest() != my_hash:
            continue
        end = checksum.find(b"\0")
        try:
            text = checksum[:end if end >= 0 else 32].decode("ascii")
        except UnicodeDecodeError:
            continue
        fb = FileBlock(text, my_hash, ckpt_size, fs, max_fs, pt_fs, timestamp, magic=b"", version=0, hash_id=1,
                       flags=0)
        return variant, fb, meta_size, data_size
    return None


def unpack_record(tail: bytes) -> tuple[TailVariant, FileBlock, int, int] | None:
    """The variant, file block, metaSize and dataSize of the FTI file metadata record ``tail`` ends with, or None."""
    return _unpack_fb(tail)


def sniff(tail: bytes) -> bool:
    """Whether the last bytes of a file (up to :data:`TAIL_FB_SIZE`) end with an FTI file metadata record."""
    return _unpack_fb(tail) is not None


def parse_tail(fh: BinaryIO, path: str, file_size: int) -> tuple[FileBlock, Blocks] | None:
    """Parse a metadata-at-the-end file; None when its last bytes are no FTI file metadata
    (no variant's ``myHash`` matches), :class:`FormatError` when they are but the rest is inconsistent."""
    size = min(file_size, TAIL_FB_SIZE)
    found = _unpack_fb(os.pread(fh.fileno(), size, file_size - size))
    if found is None:
        return None
    variant, fb, meta_size, data_size = found
    if not (fb.fs == fb.ckpt_size == file_size and meta_size >= variant.size and data_size >= 0
            and meta_size + data_size == file_size):
        raise FormatError(f"FTI file metadata: fs={fb.fs}, ckptSize={fb.ckpt_size}, metaSize={meta_size}, "
                          f"dataSize={data_size} do not describe this file ({file_size} bytes)", path=path)
    if meta_size - variant.size > _MAX_META:  # read whole below: a forged size must not allocate gigabytes
        raise FormatError(f"FTI file metadata: metaSize={meta_size} is more than any FTI file's records "
                          f"({_MAX_META >> 20} MiB: a million containers)", path=path)
    meta = os.pread(fh.fileno(), meta_size - variant.size, data_size)
    problems = []
    for record in (_DBVAR_IDX, _DBVAR_NOIDX):
        for stride in sorted({record.size, _DBVAR_IDX.size}):
            try:
                blocks = _walk(meta, record, stride, data_size, path)
            except FormatError as exc:
                problems.append(str(exc).removeprefix(f"{path}: "))  # the path is said once, below
                continue
            if fb.checksum in _checksums(blocks):
                return fb, blocks
            problems.append("checksum does not match the containers' hashes (damaged metadata)")
    raise FormatError(f"FTI metadata at byte {data_size} ({variant.name} record): {problems[0]}", path=path)


def parse_padded(fh: BinaryIO, path: str, file_size: int) -> tuple[int, tuple[FileBlock, Blocks]] | None:
    """``(size, parse_tail's result)`` of a rank file that FTI's level-3 recovery left padded, else None.

    ``FTI_RSdec`` (src/recover.c) truncates a present FTI-FF rank file to the group's ``maxFs`` (zeros appended)
    and writes the file's size in its last ``sizeof(off_t)`` bytes, decodes, then truncates it back to that size:
    interrupted in between, it leaves the file padded. Its first ``size`` bytes are the file: read as such (every
    data byte is still checked by its container's MD5; the padding is never read)."""
    last = os.pread(fh.fileno(), 8, file_size - 8) if file_size > 8 else b""
    if len(last) != 8:  # too small, or it holds less than its size said (it shrank since): no padded file
        return None
    (size,) = struct.unpack("<q", last)
    if not 0 < size <= file_size - 8:
        return None
    tail = parse_tail(fh, path, size)
    return None if tail is None else (size, tail)


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
