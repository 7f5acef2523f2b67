"""FTI's own level-3 parity files of an FTI-FF run (``Ckpt{id}-RSed{r}.fti``): recognised and checked.

``FTI_RSenc`` (leobago/fti src/postckpt.c) encodes the group's rank files, each padded to ``maxFs`` (the group's
largest file plus ``sizeof(off_t)``), writes this rank's ``maxFs`` parity bytes, then appends a file metadata
record: ``fs = maxFs = `` the parity's length, ``ptFs = -1``, ``ckptSize`` the rank file's size, ``checksum`` the
MD5 (hex) of the parity bytes, ``myHash`` computed as for a rank file (``metaSize``, ``dataSize`` and ``ckptId`` are
whatever FTI's malloc'd struct held: hashed, never used). FTI 1.1 ``fwrite``s its raw 96-byte ``FTIFF_metaInfo``
(:class:`~.structs.FileBlock`'s layout and FTI 1.1 hash); later versions ``FTIFF_SerializeFileMeta``'s record
(:data:`.tailmeta.VARIANTS`). Such a file holds no variable's bytes: reading it as a checkpoint is refused with
what it is, and ``ftidask verify`` checks its MD5 over the ``fs`` parity bytes as FTI's level-3 recovery does
(``FTIFF_GetEncodedFileChecksum``). Its parity bytes are decoded by :mod:`.fti_rs` when
:func:`ftidask.tools.fti_run.recover_fti_run` rebuilds a lost level-3 rank file of its group.
ftidask's own parity files have a ``.hash`` record instead (:func:`ftidask.levels.rs.check_parity`).
"""

from __future__ import annotations

import dataclasses
import os

from ..model.errors import FormatError
from .structs import FB_SIZE, FileBlock
from .tailmeta import TAIL_FB_SIZE, unpack_record
from .verify import md5_hex


@dataclasses.dataclass(frozen=True)
class FtiParity:
    """What the record at the end of an FTI parity file says."""

    parity_size: int  # maxFs: the parity bytes, from offset 0
    rank_size: int  # ckptSize: the size of the rank file this parity encodes
    checksum: str  # MD5 (hex) of the parity bytes
    record: str  # which FTI version's record ends the file

    def describe(self) -> str:
        """One sentence: what the file is and what to do instead."""
        return (f"FTI's level-3 Reed-Solomon parity file (RSed, {self.record} record): {self.parity_size} parity "
                f"bytes of a rank file of {self.rank_size} bytes; it holds no variable's data and recover_file "
                "does not decode FTI's parity: recover from the rank file (Ckpt*-Rank*.fti) or its partner copy, "
                "or the whole run with ftidask.tools.fti_run.recover_fti_run, which rebuilds a lost level-3 rank "
                "file from its group's files and their parity")


def sniff_parity(fd: int, file_size: int) -> FtiParity | None:
    """The parity record ``fd`` ends with, or None when the file is no FTI parity file."""
    size = min(file_size, TAIL_FB_SIZE)
    tail = os.pread(fd, size, file_size - size)
    found = unpack_record(tail)
    if found is not None:
        record_size, name, fb = found[0].size, found[0].name, found[1]
    else:  # FTI 1.1: the raw struct, hashed the FTI 1.1 way (FileBlock.legacy)
        try:
            fb = FileBlock.unpack(tail[-FB_SIZE:])
        except FormatError:
            return None
        if len(tail) < FB_SIZE or not fb.legacy or fb.compute_hash() != fb.hash:
            return None
        record_size, name = FB_SIZE, "FTI 1.1"
    if not (fb.fs == fb.max_fs == file_size - record_size and fb.pt_fs == -1 and 0 <= fb.ckpt_size <= fb.fs):
        return None
    return FtiParity(fb.fs, fb.ckpt_size, fb.checksum, name)


def parity_problem(fd: int, parity: FtiParity) -> str:
    """'' when the parity bytes match the record's MD5, else why not."""
    if md5_hex(fd, 0, parity.parity_size) != parity.checksum:
        return "FTI parity file (RSed): the MD5 of its parity bytes does not match its record (damaged)"
    return ""
