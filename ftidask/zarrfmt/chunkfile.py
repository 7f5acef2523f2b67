"""A compressed Zarr chunk file checked before any codec decodes it: what it unpacks to is exactly one chunk.

A codec allocates what a chunk file tells it to: a Zstd frame of a few bytes unpacks to terabytes, and numcodecs
decodes every frame of a file, not only the first (a real frame followed by a bomb frame passed a check of the
first frame's header). So a chunk file must be one Zstd frame, declaring a chunk's bytes and ending where the file
ends (its blocks walked by their headers, nothing decoded), or one Blosc buffer declaring a chunk's bytes and
filling the file; an uncompressed one holds a chunk's bytes. Shared by ftidask's own stores (:mod:`.checks`) and
the stores it did not write (:mod:`.foreign`).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from ..ftiff import compression
from ..model.errors import FormatError
from ..storage import files as storage

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528, little-endian
_ZSTD_BLOCK_MAX = 128 << 10  # Block_Maximum_Size: no block of a frame holds more


def compressed_most(raw: int) -> int:
    """The most bytes Zstd or Blosc makes of ``raw`` bytes, with room to spare: Zstd's ZSTD_compressBound is raw +
    raw / 256 + 64 KiB / 2**11 and a frame's header and checksum; Blosc's is raw + its 16- or 32-byte header."""
    return raw + (raw >> 7) + 4096


def zstd_frame_size(fh: BinaryIO, size: int) -> int | None:
    """The bytes of the Zstd frame at the start of ``fh`` (a file of ``size`` bytes), found from its header and
    its blocks' headers (RFC 8878, 3.1.1), or None when it is no whole frame. Each block header is read and its
    block skipped: a file of n bytes has at most n / 3 blocks, read 3 bytes at a time."""
    head = fh.read(18)
    if len(head) < 6 or head[:4] != _ZSTD_MAGIC:
        return None
    fhd = head[4]
    if fhd & 0x08:  # the reserved bit: a decoder refuses the frame
        return None
    single = (fhd >> 5) & 1
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + (1 if single else 0, 2, 4, 8)[fhd >> 6]
    checksum = 4 if fhd & 0x04 else 0
    while True:
        if at + 3 > size:
            return None
        fh.seek(at)
        block = int.from_bytes(fh.read(3), "little")
        kind, length = (block >> 1) & 3, block >> 3
        if kind == 3 or length > _ZSTD_BLOCK_MAX:  # a reserved block type, or a block no decoder takes
            return None
        at += 3 + (1 if kind == 1 else length)  # an RLE block: one byte stored, repeated ``length`` times
        if block & 1:  # the last block
            end = at + checksum
            return end if end <= size else None


def check_chunk_file(store: Path, rel: str, codec: str, whole: int, size: int) -> None:
    """A :class:`FormatError` unless chunk file ``rel`` of ``store`` (``size`` bytes) decodes to exactly
    ``whole`` bytes with ``codec`` ("raw", "zstd" or "blosc"), seen from its headers without decoding it."""
    if codec == "raw":
        if size != whole:
            raise FormatError(f"{store}: chunk {rel} holds {size} bytes, not a chunk's {whole}")
        return
    most = compressed_most(whole)
    # Zarr reads a chunk file whole (twice over) to decode it: a file of holes (free to its forger) of terabytes,
    # its header intact, was that allocation, and Blosc decodes its header's bytes and ignores the rest
    if size > most:
        raise FormatError(f"{store}: chunk {rel} holds {size} bytes, larger than {codec} makes a chunk of {whole} "
                          f"raw bytes (at most {most})")
    try:  # a missing or special file is a FormatError (os.stat said regular: never a FIFO opened here)
        with storage.open_read(store / rel) as fh:
            head = fh.read(18)
            said = compression.declared_size(codec, head)
            fh.seek(0)
            ends = zstd_frame_size(fh, size) if codec == "zstd" else (
                int.from_bytes(head[12:16], "little") if len(head) >= 16 else None)  # Blosc's cbytes
    except OSError as exc:
        raise FormatError(f"{store}: chunk {rel}: {exc}") from None
    if said is None:
        raise FormatError(f"{store}: chunk {rel} does not decode: no {codec} header declares its raw size")
    if said != whole:
        raise FormatError(f"{store}: chunk {rel} declares {said} raw bytes in its {codec} header, a chunk "
                          f"holds {whole}: refused before it is decoded")
    if ends != size:
        what = "frame" if codec == "zstd" else "buffer"
        where = f"its first {what} ends at byte {ends}" if ends is not None else f"no whole {what} is there"
        raise FormatError(f"{store}: chunk {rel} does not decode as one {codec} {what} of {size} bytes ({where}): "
                          "more frames, or trailing bytes, are refused before anything is decoded")
