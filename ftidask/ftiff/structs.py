"""The fixed-size records of FTI-FF (v1.1 layout), as frozen dataclasses with pack/unpack.

All integers little-endian. File block (FB), 96 bytes::

    0  checksum[33]  hex digest of the VB (NUL-terminated)
    33 hash[16]      digest of the FB itself
    49 free[7]       ftidask: magic "FTDK", format version, hash id, flags (FTI 1.1: zero)
    56 ckptSize, 64 fs, 72 maxFs, 80 ptFs, 88 timestamp   (int64)

Block metadata (BMD), 12 bytes packed: int32 numvars, int64 dbsize.
Container metadata (VMD), 64 bytes: int32 id, idx, containerid; uint8 hascontent; 3 pad;
int64 dptr, fptr, chunksize, containersize; hash[16].
"""

from __future__ import annotations

import dataclasses
import struct

from ..model.errors import FormatError
from . import hashing

FB_SIZE = 96
BMD_SIZE = 12
VMD_SIZE = 64
MAGIC = b"FTDK"
FORMAT_VERSION = 1
FLAG_METADATA_CHECKSUM = 1  # checksum covers metadata + container hashes, not every data byte

_FB_TAIL = struct.Struct("<4sBBBqqqqq")  # free bytes at 49..55 then the five int64
_BMD = struct.Struct("<iq")
_VMD = struct.Struct("<iiiB3xqqqq16s")
_LEGACY_FB_HASHED = struct.Struct("<qqqqq")
BMD_STRUCT, VMD_STRUCT = _BMD, _VMD  # for the writer, which packs thousands of containers in place


@dataclasses.dataclass(frozen=True)
class FileBlock:
    """FTIFF_metaInfo. ``magic`` is empty for files written by FTI itself."""

    checksum: str
    hash: bytes
    ckpt_size: int
    fs: int
    max_fs: int
    pt_fs: int
    timestamp: int
    magic: bytes = MAGIC
    version: int = FORMAT_VERSION
    hash_id: int = 2
    flags: int = FLAG_METADATA_CHECKSUM

    @property
    def legacy(self) -> bool:
        """True for a file written by FTI 1.1 (MD5 everywhere, no variable table)."""
        return self.magic != MAGIC

    def pack_unhashed(self) -> bytes:
        """The 96 bytes with the ``hash`` field zeroed (what the ftidask FB hash covers)."""
        checksum = self.checksum.encode("ascii")[:32].ljust(33, b"\0")
        tail = _FB_TAIL.pack(self.magic, self.version, self.hash_id, self.flags,
                             self.ckpt_size, self.fs, self.max_fs, self.pt_fs, self.timestamp)
        return checksum + bytes(16) + tail

    def pack(self) -> bytes:
        """The 96 bytes of the file block, ``hash`` field included."""
        raw = self.pack_unhashed()
        return raw[:33] + self.hash + raw[49:]

    def compute_hash(self) -> bytes:
        """The FB digest: FTI 1.1's MD5 recipe for legacy files, else the file's hash over the FB."""
        checksum = self.checksum.encode("ascii")[:32].ljust(33, b"\0")
        if self.legacy:
            fields = _LEGACY_FB_HASHED.pack(self.timestamp, self.ckpt_size, self.fs, self.pt_fs, self.max_fs)
            return hashing.digest(1, checksum, fields)
        raw = self.pack_unhashed()
        return hashing.digest(self.hash_id, raw[:33], raw[49:])

    def sealed(self) -> FileBlock:
        """This block with its ``hash`` field computed."""
        return dataclasses.replace(self, hash=self.compute_hash())

    @classmethod
    def unpack(cls, raw: bytes, *, path: str | None = None) -> FileBlock:
        """The file block in ``raw`` (96 bytes; one without ftidask's magic is read as FTI 1.1's); :class:`FormatError`,
        naming ``path``, if it is not one."""
        if len(raw) != FB_SIZE:
            raise FormatError(f"file block truncated ({len(raw)} of {FB_SIZE} bytes)", path=path)
        checksum_raw = raw[:33]
        end = checksum_raw.find(b"\0")
        text = checksum_raw[: end if end >= 0 else 32]
        try:
            checksum = text.decode("ascii")
        except UnicodeDecodeError:
            raise FormatError("file block: checksum is not a hex string (not an FTI-FF file?)", path=path) from None
        magic, version, hid, flags, ckpt_size, fs, max_fs, pt_fs, timestamp = _FB_TAIL.unpack(raw[49:])
        if magic != MAGIC:
            magic, version, hid, flags = b"", 0, 1, 0  # FTI 1.1: the free bytes carry nothing
        return cls(checksum, bytes(raw[33:49]), ckpt_size, fs, max_fs, pt_fs, timestamp, magic, version, hid, flags)


@dataclasses.dataclass(frozen=True)
class BlockMeta:
    """FTIFF_db as stored: number of containers in the block and the block's total size."""

    numvars: int
    dbsize: int

    def pack(self) -> bytes:
        """The 12 bytes of the BMD."""
        return _BMD.pack(self.numvars, self.dbsize)

    @classmethod
    def unpack(cls, raw: bytes) -> BlockMeta:
        """The BMD in ``raw`` (12 bytes)."""
        return cls(*_BMD.unpack(raw))


@dataclasses.dataclass(frozen=True)
class ContainerMeta:
    """FTIFF_dbvar as stored: where one chunk of a variable lives in the file."""

    id: int
    idx: int
    containerid: int
    hascontent: bool
    dptr: int
    fptr: int
    chunksize: int
    containersize: int
    hash: bytes = bytes(16)

    def pack(self) -> bytes:
        """The 64 bytes of the VMD."""
        return _VMD.pack(self.id, self.idx, self.containerid, int(self.hascontent), self.dptr, self.fptr,
                         self.chunksize, self.containersize, self.hash)

    @classmethod
    def unpack(cls, raw: bytes) -> ContainerMeta:
        """The VMD in ``raw`` (64 bytes)."""
        vid, idx, cid, has, dptr, fptr, chunk, csize, digest = _VMD.unpack(raw)
        return cls(vid, idx, cid, has != 0, dptr, fptr, chunk, csize, digest)
