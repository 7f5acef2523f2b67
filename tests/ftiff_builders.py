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


# The file metadata records FTI appends, as FTIFF_SerializeFileMeta packs them (tailmeta's docstring): field order
# checksum[33], myHash[16], [ckptId int32,] ckptSize, metaSize, dataSize, fs, maxFs, ptFs, timestamp; myHash is the
# MD5 of checksum[33], timestamp, ckptSize, metaSize, dataSize, fs, ptFs, maxFs. "area": FTI_filemetastructsize.
RECORDS = {"196f77d2": dict(area=110, ckpt_id=True, ts="q"), "master": dict(area=110, ckpt_id=True, ts="I"),
           "8e2e72fc": dict(area=106, ckpt_id=False, ts="q")}


def fti_record(record, checksum_hex, *, ckpt_size, meta_size, data_size, fs, max_fs=-1, pt_fs=-1, ckpt_id=1,
               timestamp=1_600_000_000_123_456_789, unwritten=b"\xa5\x5a\xc3\x3c\x0f"):
    """One FTI file metadata record of version ``record`` (RECORDS), its last bytes those FTI never writes."""
    spec = RECORDS[record]
    checksum = checksum_hex.encode() + b"\0"
    ts = struct.pack("<" + spec["ts"], timestamp % (2**32 if spec["ts"] == "I" else 2**63))
    sizes = (ckpt_size, meta_size, data_size, fs)
    my_hash = hashlib.md5(checksum + ts + struct.pack("<qqqqqq", *sizes, pt_fs, max_fs)).digest()
    out = (checksum + my_hash + (struct.pack("<i", ckpt_id) if spec["ckpt_id"] else b"")
           + struct.pack("<qqqqqq", *sizes, max_fs, pt_fs) + ts)
    return out + unwritten[:spec["area"] - len(out)]


def fti_tail_file(variables, blocks, *, record="196f77d2", max_fs=-1, pt_fs=-1, ckpt_id=1,
                  stale=b"stale container"):
    """A file of FTI 1.2 and later (metadata at the end) as FTI_WriteFtiffData / FTIFF_writeMetaDataFTIFF lay it out.

    ``variables``: {id: bytes}; ``blocks``: list of blocks, each a list of ``(id, containerid, dptr,
    containersize)``. A container holds its variable's bytes from ``dptr`` (as many as fit: FTI's chunksize; a
    variable that shrank to nothing keeps hascontent true and a chunk of 0 bytes in its first container, as
    FTIFF_UpdateDatastructVarFTIFF sets it) and those past it are empty (hascontent false, a stale hash).
    Container records are 62 bytes with ``idx`` (the variable's place in ``variables``) for 196f77d2 and 8e2e72fc,
    58 without for master. Bytes of a container past its chunk are 0xEE.
    """
    area, records, hashes = bytearray(), bytearray(), []
    left = {vid: [len(raw), False] for vid, raw in variables.items()}  # bytes still to place, and placed all
    for block in blocks:
        records += struct.pack("<iq", len(block), sum(c[3] for c in block))
        for vid, cid, dptr, csize in block:
            rest, done = left[vid]
            has, size = not done, 0 if done else min(rest, csize)  # FTIFF_UpdateDatastructVarFTIFF's overflow walk
            left[vid] = [rest - size, done or rest <= csize]
            chunk = variables[vid][dptr:dptr + size]
            digest = hashlib.md5(chunk if has else stale).digest()
            idx = list(variables).index(vid)  # FTI's idx: the variable's place in protection order
            head = struct.pack("<iii", vid, idx, cid) if record != "master" else struct.pack("<ii", vid, cid)
            records += head + struct.pack("<??QQQQ16s", has, True, dptr, len(area), len(chunk), csize, digest)
            hashes.append(digest)
            area += chunk + bytes([0xEE]) * (csize - len(chunk))
    meta_size = len(records) + RECORDS[record]["area"]
    fs = len(area) + meta_size
    checksum = hashlib.md5(b"".join(hashes)).hexdigest()  # the writer's: every container's hash
    return bytes(area + records) + fti_record(record, checksum, ckpt_size=fs, meta_size=meta_size,
                                              data_size=len(area), fs=fs, max_fs=max_fs, pt_fs=pt_fs,
                                              ckpt_id=ckpt_id)


def fti_rsed_file(parity, rank_size, *, record="196f77d2"):
    """FTI's level-3 parity file of an FTI-FF run (FTI_RSenc, src/postckpt.c): the ``maxFs`` parity bytes (the
    group's files padded to the largest + sizeof(off_t)), then a file metadata record appended: fs = maxFs = the
    parity's length, ptFs = -1, ckptSize = this rank's file size, checksum = MD5 (hex) of the parity bytes;
    metaSize, dataSize and ckptId are whatever FTI's malloc'd struct held. ``record`` "1.1": FTI 1.1's raw
    96-byte FTIFF_metaInfo (fwrite of the struct: 7 padding bytes, then ckptSize, fs, maxFs, ptFs, timestamp)."""
    checksum = hashlib.md5(parity).hexdigest()
    if record == "1.1":
        timestamp = 1_500_000_000_000_000_000
        text = checksum.encode() + b"\0"
        fb_hash = hashlib.md5(text + struct.pack("<qqqqq", timestamp, rank_size, len(parity), -1,
                                                   len(parity))).digest()
        return parity + text + fb_hash + b"\xbe" * 7 + struct.pack("<qqqqq", rank_size, len(parity), len(parity), -1,
                                                                    timestamp)
    return parity + fti_record(record, checksum, ckpt_size=rank_size, meta_size=0x0BADC0DE, data_size=-0x2152411,
                               fs=len(parity), max_fs=len(parity), pt_fs=-1, ckpt_id=0x7F7F7F7F)


def fti_padded_rank_file(rank, max_fs):
    """A rank file as FTI's level-3 recovery (FTI_RSdec, src/recover.c) leaves it when interrupted: truncated
    (extended with zeros) to ``maxFs`` and its own size written in its last ``sizeof(off_t)`` bytes, so that the
    decoding sees the file as at encoding; the truncation back to that size never came."""
    assert len(rank) <= max_fs - 8
    return rank + bytes(max_fs - 8 - len(rank)) + struct.pack("<q", len(rank))
