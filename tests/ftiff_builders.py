"""Build FTI-FF files byte by byte from the format description, independently of ftidask's writer."""

import hashlib
import struct


def fti11_file(variables, blocks, *, timestamp=1_500_000_000_000_000_000, pad=b"\xaa\xbb\xcc", pt_fs=-1,
               max_fs=-1, ckpt_size=None):
    """An FTI 1.1 file: raw C structs, MD5 everywhere, FB free bytes zero, garbage in VMD pad bytes.

    ``variables``: {id: bytes}; ``blocks``: list of blocks, each a list of
    ``(id, idx, containerid, dptr, containersize)``; a container holds the bytes of its
    variable from ``dptr`` (as many as fit).

    The FB holds what FTI 1.1 writes (FTIFF_CreateMetadata / FTIFF_WriteFTIFF): ``ckptSize`` and
    ``fs`` are both the file's size (metadata included, not the data alone as its documentation
    says); ``ptFs`` and ``maxFs`` are -1 except at L2 (``ptFs``: the partner's file size) and L3
    (``maxFs``: the largest file of the group). ``ckpt_size`` overrides ``ckptSize``.
    """
    body = bytearray()
    offset = 96
    for block in blocks:
        meta_size = 12 + 64 * len(block)
        dbsize = meta_size + sum(c[4] for c in block)
        metas, datas = [], []
        fptr = offset + meta_size
        for vid, idx, cid, dptr, csize in block:
            chunk = variables[vid][dptr:dptr + csize]
            has = len(chunk) > 0
            metas.append(struct.pack("<iiiB3sqqqq16s", vid, idx, cid, has, pad, dptr, fptr, len(chunk), csize,
                                     hashlib.md5(chunk).digest()))
            datas.append(chunk + bytes(csize - len(chunk)))
            fptr += csize
        body += struct.pack("<iq", len(block), dbsize) + b"".join(metas) + b"".join(datas)
        offset += dbsize
    fs = 96 + len(body)
    ckpt_size = fs if ckpt_size is None else ckpt_size
    checksum = hashlib.md5(bytes(body)).hexdigest().encode() + b"\0"
    # FTI's FB hash: MD5 of checksum[33], then timestamp, ckptSize, fs, ptFs, maxFs as C longs.
    fb_hash = hashlib.md5(checksum + struct.pack("<qqqqq", timestamp, ckpt_size, fs, pt_fs, max_fs)).digest()
    fb = checksum + fb_hash + bytes(7) + struct.pack("<qqqqq", ckpt_size, fs, max_fs, pt_fs, timestamp)
    assert len(fb) == 96
    return fb + bytes(body)


def fti_master_file(variables, blocks, *, area=110, ckpt_id=3, timestamp=0x9ABC_DEF0, stale=b"stale container",
                    unwritten=b"\x5e\x11\xa7\x0c\x3d"):
    """A file as FTI 1.6 / master writes it, from its sources (src/IO/ftiff.c at 52f4cbeb, FTIFF_metaInfo in
    include/fti-intern.h at cb10789a), packed here from those serializers, not by ftidask.

    ``variables``: {id: bytes}; ``blocks``: list of blocks, each a list of ``(id, containerid, dptr,
    containersize)``. A container holds its variable's bytes from ``dptr`` (as many as fit; the rest of the
    container is left-over bytes); one past the variable's end is empty (hascontent false) and keeps a stale
    hash, as FTI leaves it. Data first, then per block FTIFF_SerializeDbMeta (numvars int32, dbsize int64:
    the block's container sizes), per container FTIFF_SerializeDbVarMeta (id, containerid int32, hascontent,
    hasCkpt bool, dptr, fptr uintptr_t, chunksize, containersize 64-bit, hash[16]), then the file metadata
    in the last ``area`` bytes (FTI_filemetastructsize): FTIFF_SerializeFileMeta's 105 bytes, then
    ``unwritten`` (what FTI's malloc'd buffer held).
    """
    data, records, hashes = bytearray(), bytearray(), []
    for block in blocks:
        records += struct.pack("<iq", len(block), sum(c[3] for c in block))
        for vid, cid, dptr, csize in block:
            chunk = variables[vid][dptr:dptr + csize]
            digest = hashlib.md5(chunk if chunk else stale).digest()
            records += struct.pack("<ii??QQQQ16s", vid, cid, bool(chunk), True, dptr, len(data), len(chunk), csize,
                                   digest)
            hashes.append(digest)
            data += chunk + bytes([0xEE]) * (csize - len(chunk))
    meta_size = len(records) + area
    fs = len(data) + meta_size
    max_fs = pt_fs = -1
    checksum = hashlib.md5(b"".join(hashes)).hexdigest().encode() + b"\0"  # FTIFF_writeMetaDataFTIFF: every hash
    # FTIFF_GetHashMetaInfo: checksum[33], timestamp (uint32), ckptSize, metaSize, dataSize, fs, ptFs, maxFs
    my_hash = hashlib.md5(checksum + struct.pack("<I", timestamp)
                          + struct.pack("<qqqqqq", fs, meta_size, len(data), fs, pt_fs, max_fs)).digest()
    record = (checksum + my_hash + struct.pack("<i", ckpt_id)
              + struct.pack("<qqqqqq", fs, meta_size, len(data), fs, max_fs, pt_fs) + struct.pack("<I", timestamp))
    assert len(record) == 105 and area >= 105
    return bytes(data + records + record + unwritten[:area - 105])
