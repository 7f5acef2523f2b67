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
