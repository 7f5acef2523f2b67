"""FTI's MPI-IO level-4 checkpoint (``ckpt_io = 2``): one shared file of every rank's bytes, read for one rank.

FTI_InitMPIO (src/IO/mpio.c) writes level 4 as ONE file, ``{glbl_dir}/{exec_id}/l4/Ckpt{id}-mpiio.fti``, opened on
FTI_COMM_WORLD: the application processes, heads excluded, in the order of their global rank (FTI splits the
global communicator keyed by it). Each process's part starts at the sum of the checkpoint sizes of the processes
before it (``splitRank``) and holds its protected variables back to back in protection order (FTI_WriteMPIOData),
without padding; the file is those parts and nothing else. FTI_RecoverL4Mpi reads a part back with the same prefix
sum of the sizes the meta files record. The meta files are the POSIX mode's (``{meta_dir}/{exec_id}/l4/
sector{s}-group{g}.fti``, :mod:`ftidask.ftiff.posix`): a section per process naming ``Ckpt{id}-Rank{r}.fti`` (``r``
its global rank), ``ckpt_file_size`` (its part's bytes), ``ckpt_checksum`` (FTI_Checksum: the MD5 of its
variables, i.e. of its part) and ``var{j}_id``/``var{j}_size``. Level 4 flushed by heads (``inline_l4 = 0``,
src/postckpt.c FTI_FlushMPI) has the same layout: each head writes its node's local POSIX files at the sum of the
sizes before them in node order, FTI_COMM_WORLD's order, and the meta files record each local file's MD5
(docs/format.md, FTI runs with heads).

A part is read only once every process's section of the checkpoint is found in the meta files (every group's file)
and their sizes add up to the file's size exactly: a rank missing, a size that is not a byte count, or one that
would put a part past the file's end is a FormatError, before any byte is read. The part's MD5 is checked before
its bytes are handed out. (FTI versions whose MPI-IO writer computes no integrity, ``finIntegrity = FTI_dummy``,
record no MD5 of the part: their parts do not verify and are refused.)
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..model.errors import FormatError
from ..storage.files import open_read
from .posix import (
    HEX15,
    HEX32,
    PosixFile,
    buffer_for,
    checksum_matches,
    meta_files,
    meta_int,
    meta_variables,
    process_sections,
    read_meta,
)

MPIIO_NAME = re.compile(r"Ckpt(\d{1,9})-mpiio\.fti")
_RANK_FILE = re.compile(r"Ckpt(\d{1,9})-Rank(\d{1,9})\.fti")
HOW = "recover_file(path, meta=META_DIR/sector*-group*.fti or their directory, rank=R)"


def is_mpiio_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is named as FTI's MPI-IO shared file, ``Ckpt{id}-mpiio.fti``."""
    return MPIIO_NAME.fullmatch(os.path.basename(os.fspath(path))) is not None


def check_rank(rank: object) -> int:
    """``rank`` as a process's rank in FTI's global communicator, else FormatError."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise FormatError(f"rank must be a non-negative int (the rank in FTI's global communicator), got {rank!r}")
    return rank


def _file_size(path: str | os.PathLike[str]) -> int:
    try:
        with open_read(path) as fh:  # a regular file only
            return os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise FormatError(f"cannot read: {exc}", path=os.fspath(path)) from None


def mpiio_parts(path: str | os.PathLike[str],
                meta: str | os.PathLike[str]) -> dict[int, tuple[int, int, dict[str, str], str]]:
    """Every rank's part of FTI's MPI-IO file ``path``: ``{global rank: (offset, size, meta section, where)}``, from
    the meta files ``meta`` (a file or their directory), checked to tile the file exactly (FormatError if not)."""
    named = MPIIO_NAME.fullmatch(os.path.basename(os.fspath(path)))
    if not named:
        raise FormatError("not the name of FTI's MPI-IO file (Ckpt{id}-mpiio.fti)", path=os.fspath(path))
    ckpt_id = int(named[1])
    sections: dict[int, tuple[dict[str, str], str]] = {}
    for meta_path in meta_files(meta):
        ini = read_meta(meta_path)
        kind = ini.get("ckpt_info", "ckpt_type", fallback="full").strip().lower()
        for group_rank, values in sorted(process_sections(ini).items()):
            values, where = values | {"ckpt_type": kind}, f"{meta_path} [{group_rank}]"
            name = values.get("ckpt_file_name", "")
            rank_file = _RANK_FILE.fullmatch(name)
            if not rank_file:
                raise FormatError(f"ckpt_file_name = {name!r} is not an FTI rank file name (Ckpt{{id}}-Rank{{r}}.fti)",
                                  path=where)
            if int(rank_file[1]) != ckpt_id:
                raise FormatError(f"the section describes checkpoint {int(rank_file[1])} ({name}), the file is "
                                  f"checkpoint {ckpt_id}: meta files of another checkpoint", path=where)
            rank = int(rank_file[2])
            if rank in sections:
                raise FormatError(f"{name} is described twice ({sections[rank][1]} and this section)", path=where)
            sections[rank] = (values, where)
    if not sections:
        raise FormatError("no process section ([0], [1], ...) in the meta file(s)", path=os.fspath(meta))
    total = _file_size(path)
    parts: dict[int, tuple[int, int, dict[str, str], str]] = {}
    offset = 0
    for rank in sorted(sections):  # FTI_COMM_WORLD's order: the application ranks by global rank
        values, where = sections[rank]
        size = meta_int(values, "ckpt_file_size", where)
        if offset + size > total:
            raise FormatError(f"rank {rank}'s part [{offset}, {offset + size}) lies past the end of the file "
                              f"({total} bytes): a size is wrong, or the file is cut", path=os.fspath(path))
        parts[rank] = (offset, size, values, where)
        offset += size
    if offset != total:
        raise FormatError(f"the ckpt_file_size of the {len(parts)} ranks the meta files describe sum to {offset} "
                          f"bytes, the file has {total}: a rank's meta file is missing or the file is cut",
                          path=os.fspath(path))
    return parts


def read_mpiio(path: str | os.PathLike[str], meta: str | os.PathLike[str], rank: int) -> PosixFile:
    """Rank ``rank``'s variables (``rank``: its global rank, as in ``Ckpt{id}-Rank{rank}.fti``) out of FTI's MPI-IO
    file ``path``, its part located with the meta files ``meta`` and verified (size, MD5) before it is returned."""
    rank = check_rank(rank)
    return _read_part(path, meta, mpiio_parts(path, meta), rank)


def _read_part(path: str | os.PathLike[str], meta: str | os.PathLike[str],
               parts: dict[int, tuple[int, int, dict[str, str], str]], rank: int) -> PosixFile:
    if rank not in parts:
        ckpt_id = int(MPIIO_NAME.fullmatch(os.path.basename(os.fspath(path)))[1])  # type: ignore[index]
        raise FormatError(f"no section of the FTI meta file(s) names Ckpt{ckpt_id}-Rank{rank}.fti (ckpt_file_name): "
                          f"rank {rank} has no part in this file (its ranks: {sorted(parts)})", path=os.fspath(meta))
    offset, size, values, where = parts[rank]
    if values["ckpt_type"] != "full" or any(key.startswith("dcp") for key in values):
        raise FormatError("the meta file describes a differential checkpoint (dCP layers), not a part of "
                          "FTI's MPI-IO file", path=where)
    checksum = values.get("ckpt_checksum", "").lower()
    if not (HEX32.fullmatch(checksum) or HEX15.fullmatch(checksum)):
        raise FormatError(f"ckpt_checksum = {checksum!r}: no MD5 to verify rank {rank}'s part against, so it is not "
                          "read", path=where)
    variables = meta_variables(values, size, where)
    raw = buffer_for(size, path)
    try:
        with open_read(path) as fh:
            fh.seek(offset)
            got = fh.readinto(raw)  # type: ignore[attr-defined]
    except OSError as exc:
        raise FormatError(f"cannot read: {exc}", path=os.fspath(path)) from None
    if got != size:
        raise FormatError(f"rank {rank}'s part ends at byte {offset + got}, its meta file says {offset + size}",
                          path=os.fspath(path))
    if not checksum_matches(hashlib.md5(raw, usedforsecurity=False).hexdigest(), checksum):
        raise FormatError(f"MD5 does not match the meta file's ckpt_checksum of rank {rank}'s part (bytes [{offset}, "
                          f"{offset + size})): damaged file", path=os.fspath(path))
    view = memoryview(raw)
    return PosixFile(os.fspath(path), where, {vid: view[start:start + n] for vid, start, n in variables})


def verify_mpiio(path: str | os.PathLike[str], meta: str | os.PathLike[str]) -> str:
    """Check every rank's part of FTI's MPI-IO file ``path`` against the meta files (FormatError naming the damaged
    ranks); a note of how many parts were checked."""
    parts = mpiio_parts(path, meta)
    bad = []
    for rank in parts:
        try:
            _read_part(path, meta, parts, rank)
        except FormatError as exc:
            bad.append(f"rank {rank}: {exc}")
    if bad:
        raise FormatError(f"{len(bad)} of {len(parts)} ranks' parts refused: " + "; ".join(bad), path=os.fspath(path))
    return f"{len(parts)} ranks' parts"


def mpiio_files(root: Path) -> list[Path]:
    """FTI's MPI-IO files in the directory ``root``."""
    return sorted(p for p in root.glob("Ckpt*-mpiio.fti") if is_mpiio_file(p) and p.is_file())
