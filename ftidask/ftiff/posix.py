"""Checkpoint files of FTI's POSIX I/O (``ckpt_io = 1``, FTI's default), read with FTI's meta file.

FTI's POSIX file ``Ckpt{id}-Rank{r}.fti`` holds the protected variables' bytes, in protection order, and
nothing else: what they are is in the meta file FTI writes for each group of processes,
``{meta_dir}/{exec_id}/l{level}/sector{s}-group{g}.fti`` (``FTI_WriteMetadata``, src/meta.c), an INI file
written by iniparser (keys lower case) with one section per process of the group, ``[0]`` to
``[group_size - 1]``::

    [0]
    ckpt_file_name                 = Ckpt1-Rank0.fti
    ckpt_file_size                 = 1272      bytes of the file
    ckpt_file_maxs                 = 1272      the largest of the group (L3's stripes)
    ckpt_checksum                  = 5d41...   MD5 (hex) of the file's bytes (FTI_Checksum, FTI_VerifyChecksum)
    var0_id                        = 0
    var0_size                      = 800
    var0_pos                       = 0         later versions only; else the sizes follow each other
    ...

Later versions (src/meta.c with ``FTIT_keymap``) add a ``[ckpt_info]`` section (``ckpt_type = full`` or ``dcp``,
``ckpt_id``), ``var{j}_pos``, ``var{j}_name`` and ``RSed_checksum``; an early FTI's checksum is 15 characters (see
:data:`HEX15`). The section is found by the file's name; the file must have the recorded size and checksum, and
it is read whole into memory and hashed there, so the bytes given to the arrays are the bytes checked. Names are
not needed and not read. FTI's POSIX differential checkpoints (``ckpt_type = dcp``, ``dcp_layer*`` keys: layers
of blocks) are FTI's ``dcp-id{f}-rank{r}.fti`` files, read by :mod:`ftidask.ftiff.fti_dcp_posix`.
"""

from __future__ import annotations

import configparser
import dataclasses
import hashlib
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..model.errors import FormatError, RecoveryError
from ..storage.files import open_read

_META_NAME = re.compile(r"sector\d+-group\d+\.fti")
_MAX_META = 16 << 20  # a meta file of thousands of processes and variables is far smaller
HEX32 = re.compile(r"[0-9a-f]{32}")
#: An early FTI_Checksum wrote each byte's two hex digits at offset i, not 2 * i, over 15 bytes, then cut the
#: string at 15: the first hex digit of each of the MD5's first 15 bytes (its FTI_VerifyChecksum computes the same).
HEX15 = re.compile(r"[0-9a-f]{15}")


@dataclasses.dataclass(frozen=True)
class PosixFile:
    """One verified POSIX checkpoint file: each variable's bytes, by id, as the meta file describes them."""

    path: str
    meta_path: str
    data: dict[int, memoryview]
    vars: dict[int, Any] = dataclasses.field(default_factory=dict)  # no dtype or shape: FTI stores bytes

    def var_nbytes(self) -> dict[int, int]:
        """Bytes held per variable id."""
        return {vid: len(buf) for vid, buf in self.data.items()}


#: FTI's other I/O modes' files not read: SIONlib's container, HDF5's files (src/IO/sion-fti.c, hdf5-fti.c). MPI-IO's
#: one file of every rank's bytes is read a rank at a time with its meta files (ftidask.ftiff.fti_mpiio).
_OTHER_MODES = ((re.compile(r"Ckpt-?\d+-sionlib\.fti"), "SIONlib (ckpt_io = 4)"),)
_MPIIO = re.compile(r"Ckpt\d{1,9}-mpiio\.fti")  # as ftidask.ftiff.fti_mpiio.MPIIO_NAME
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def other_io_mode(path: str | os.PathLike[str]) -> str:
    """'' or why ``path`` is not read as a file of its own: a checkpoint file of FTI's MPI-IO (read a rank at a time),
    SIONlib or HDF5 I/O (by its name, or HDF5's signature at its start)."""
    name = os.path.basename(os.fspath(path))
    if _MPIIO.fullmatch(name):
        return ("FTI's MPI-IO (ckpt_io = 2) checkpoint file, every rank's part in one file: one rank's is read with "
                "the meta files, recover_file(path, meta=META_DIR, rank=R) (ftidask.ftiff.fti_mpiio.read_mpiio)")
    mode = next((mode for pattern, mode in _OTHER_MODES if pattern.fullmatch(name)), "")
    if not mode:
        try:
            with open_read(path) as fh:
                head = fh.read(len(_HDF5_MAGIC))
        except OSError:
            head = b""
        mode = "HDF5 (ckpt_io = 5)" if head == _HDF5_MAGIC or name.endswith(".h5") else ""
    return (f"FTI's {mode} checkpoint file: not read by ftidask, which reads FTI-FF files (ckpt_io = 3) and, with "
            "their meta file, POSIX ones (ckpt_io = 1)") if mode else ""


def meta_files(meta: str | os.PathLike[str]) -> list[Path]:
    """``meta`` itself if a file, else the FTI meta files (``sector*-group*.fti``) in the directory ``meta``."""
    where = Path(meta)
    try:  # a path the OS refuses (a name too long, permissions) is a format error naming it, not a raw OSError
        if where.is_dir():
            found = sorted(p for p in where.iterdir() if _META_NAME.fullmatch(p.name) and p.is_file())
            if not found:
                raise FormatError("no FTI meta file (sector*-group*.fti) in this directory", path=str(where))
            return found
        if not where.is_file():
            raise FormatError("no such FTI meta file", path=str(where))
    except OSError as exc:
        raise FormatError(f"cannot read the FTI meta file or directory: {exc.strerror}", path=str(where)) from None
    return [where]


#: The last meta files parsed, by their bytes' digest: ``verify DIR --meta`` and a run's recovery look up each of a
#: group's files in the same meta files, whose parse (up to 16 MiB: about 10 s) must not be repeated per file. Keyed
#: by content, not by the file's identity (a file rewritten in place within one tick keeps its size and mtime).
#: Bounded by the bytes parsed, not a count: a run of many groups keeps one small meta file each, every one of which a
#: lookup may pass through (two entries would be evicted in turn and every file parsed again on every lookup).
_PARSED: OrderedDict[bytes, tuple[configparser.ConfigParser, int]] = OrderedDict()
_PARSED_BYTES = 32 << 20  # at most two meta files of the largest size read
_PARSED_LOCK = threading.Lock()


def read_meta(path: Path) -> configparser.ConfigParser:
    """FTI's meta file ``path`` (a group's ``sector{s}-group{g}.fti``) parsed as FTI's iniparser reads it (read-only:
    the same bytes read again give the same parse)."""
    try:
        with open_read(path) as fh:  # a regular file only: a FIFO planted there would block for ever
            raw = fh.read(_MAX_META + 1)
        if len(raw) > _MAX_META:
            raise FormatError(f"larger than {_MAX_META} bytes: not an FTI meta file", path=str(path))
        key = hashlib.blake2b(raw, digest_size=32).digest()
        with _PARSED_LOCK:
            if key in _PARSED:
                _PARSED.move_to_end(key)
                return _PARSED[key][0]
        ini = _parse_meta(raw.decode("utf-8"), str(path))
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        raise FormatError(f"not a readable FTI meta file: {exc}", path=str(path)) from None
    with _PARSED_LOCK:
        _PARSED[key] = (ini, len(raw))
        while sum(size for _ini, size in _PARSED.values()) > _PARSED_BYTES:
            _PARSED.popitem(last=False)
    return ini


def _parse_meta(text: str, source: str) -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None, strict=False, delimiters=("=",),
                                    comment_prefixes=("#", ";"), inline_comment_prefixes=(";", "#"))
    ini.read_string(text, source=source)
    return ini


#: Files of levels 2 and 3 that the meta file describes under their owner's rank file: FTI_RecvPtner names a partner
#: copy after the rank that keeps it (``Pcof{r}``: its left neighbour's bytes), FTI_RSenc a parity file after its rank.
_PCOF = re.compile(r"Ckpt(\d+)-Pcof(\d+)\.fti")
_RSED = re.compile(r"Ckpt(\d+)-RSed(\d+)\.fti")
_DCP = re.compile(r"dcp-id\d{1,9}-rank\d{1,9}\.fti")  # FTI's POSIX dCP files (ftidask.ftiff.fti_dcp_posix)
_PARITY_REFUSED = ("FTI's level-3 Reed-Solomon parity file (RSed): parity, not a checkpoint (its MD5 is checked by "
                   "ftidask verify PATH --meta META; ftidask.tools.fti_run.recover_fti_run decodes it with its group's "
                   "files to rebuild a lost level-3 rank file)")


def process_sections(ini: configparser.ConfigParser) -> dict[int, dict[str, str]]:
    """The sections of the group's processes, ``[0]`` to ``[group_size - 1]``, by group rank."""
    return {int(name): {k.lower(): v.strip() for k, v in ini.items(name)}
            for name in ini.sections() if re.fullmatch(r"\d{1,6}", name.strip())}


def _ckpt_info(ini: configparser.ConfigParser) -> dict[str, str]:
    """The ``[ckpt_info]`` section's ``ckpt_type`` (``full`` when absent) and ``ckpt_id`` (as ``ckpt_info_ckpt_id``)."""
    kind = ini.get("ckpt_info", "ckpt_type", fallback="full").strip().lower()
    return {"ckpt_type": kind} | ({"ckpt_info_ckpt_id": ini.get("ckpt_info", "ckpt_id").strip()}
                                 if ini.has_option("ckpt_info", "ckpt_id") else {})


def find_section(path: str | os.PathLike[str], meta: str | os.PathLike[str]) -> tuple[Path, dict[str, str]]:
    """The meta file and its section that describe the checkpoint file ``path`` (found by its name); the
    ``[ckpt_info]`` section's ``ckpt_type`` (later versions: ``full`` or ``dcp``) is added as ``ckpt_type``.

    A partner copy ``Ckpt{id}-Pcof{r}.fti`` is described by the section left of rank ``r``'s, ``(g + n - 1) % n``
    (FTI_GetChecksums, FTI_LoadMeta); a parity file ``Ckpt{id}-RSed{r}.fti`` by rank ``r``'s (its ``rsed_checksum``)."""
    name = os.path.basename(os.fspath(path))
    named = _PCOF.fullmatch(name) or _RSED.fullmatch(name)
    owner = f"Ckpt{named[1]}-Rank{named[2]}.fti" if named else name
    for meta_path in meta_files(meta):
        ini = read_meta(meta_path)
        info = _ckpt_info(ini)
        if not _PCOF.fullmatch(name):
            for named, values in _named_sections(ini):
                if named == owner:
                    return meta_path, values | info
            continue
        procs = process_sections(ini)
        keeper = next((g for g, values in procs.items() if values.get("ckpt_file_name") == owner), None)
        if keeper is None:
            continue
        if sorted(procs) != list(range(len(procs))):
            raise FormatError(f"the process sections are {sorted(procs)}, not [0] to [{len(procs) - 1}]: the left "
                              f"partner of {owner}, whose copy {name} is, cannot be told", path=str(meta_path))
        return meta_path, procs[(keeper - 1) % len(procs)] | info
    raise FormatError(f"no section of the FTI meta file(s) names {owner} (ckpt_file_name)"
                      + (f", the rank file whose node keeps {name}" if owner != name else ""), path=os.fspath(meta))


def _named_sections(ini: configparser.ConfigParser) -> Iterator[tuple[str, dict[str, str]]]:
    """Each section of ``ini`` in order: the checkpoint file it names (``ckpt_file_name``, '' if none) and its
    values (keys lower-cased, values stripped)."""
    for section in ini.sections():
        values = {k.lower(): v.strip() for k, v in ini.items(section)}
        yield values.get("ckpt_file_name", ""), values


def find_sections(paths: list[Path], meta: str | os.PathLike[str]) -> list[tuple[Path, dict[str, str]]]:
    """:func:`find_section` of several rank files (``Ckpt{id}-Rank{r}.fti``: a level-3 group's) at once, each meta
    file parsed once: a group of 255 looked up one by one in a 16 MiB meta file parsed it 255 times (10 s each)."""
    names = [os.path.basename(os.fspath(p)) for p in paths]
    found: dict[str, tuple[Path, dict[str, str]]] = {}
    for meta_path in meta_files(meta):
        ini = read_meta(meta_path)
        info = _ckpt_info(ini)
        for name, values in _named_sections(ini):
            if name in names and name not in found:  # the first section naming it, as find_section
                found[name] = (meta_path, values | info)
        if len(found) == len(set(names)):
            break
    missing = next((name for name in names if name not in found), None)
    if missing is not None:
        raise FormatError(f"no section of the FTI meta file(s) names {missing} (ckpt_file_name)", path=os.fspath(meta))
    return [found[name] for name in names]


def verify_posix_parity(path: str | os.PathLike[str], meta: str | os.PathLike[str]) -> str:
    """Check FTI's POSIX parity file ``Ckpt{id}-RSed{r}.fti`` against its group's meta file (FormatError if not
    sound): ``ckpt_file_maxs`` bytes (FTI_RSenc pads the group's files to the largest) of MD5 ``rsed_checksum``
    (FTI_WriteRSedChecksum). A meta file without ``rsed_checksum`` (FTI versions before it) leaves the size alone
    to check, as FTI_CheckFile does then: the returned note says so ('' when the MD5 was checked)."""
    if not _RSED.fullmatch(os.path.basename(os.fspath(path))):
        raise FormatError("not an FTI parity file name (Ckpt{id}-RSed{r}.fti)", path=os.fspath(path))
    meta_path, values = find_section(path, meta)
    where = f"{meta_path} [{values.get('ckpt_file_name')}]"
    size = meta_int(values, "ckpt_file_maxs", where)
    checksum = values.get("rsed_checksum", "").lower()
    raw = read_whole(path, size)
    if not checksum:
        return "size only: the meta file records no RSed_checksum"
    if not HEX32.fullmatch(checksum):
        raise FormatError(f"RSed_checksum = {checksum!r} is not an MD5 to verify the parity file against", path=where)
    if hashlib.md5(raw, usedforsecurity=False).hexdigest() != checksum:
        raise FormatError("MD5 does not match the meta file's RSed_checksum (damaged parity file)",
                          path=os.fspath(path))
    return ""


def read_whole(path: str | os.PathLike[str], size: int, padded: int = -1, longer: bool = False) -> bytearray:
    """The first ``size`` bytes of the regular file ``path``, which must have exactly that size, or ``padded`` bytes,
    or (``longer``) any size from ``size`` on (else FormatError: the file is cut short, or not the one described)."""
    try:
        with open_read(path) as fh:
            actual = os.fstat(fh.fileno()).st_size
            if actual != size and not size < actual == padded and not (longer and actual > size):
                cut = " (cut short)" if actual < size else ""
                raise FormatError(f"the file has {actual} bytes, its meta file says {size}{cut}", path=os.fspath(path))
            raw = buffer_for(size, path)
            got = fh.readinto(raw)  # type: ignore[attr-defined]
    except OSError as exc:
        raise FormatError(f"cannot read: {exc}", path=os.fspath(path)) from None
    if got != size:
        raise FormatError(f"the file ends at byte {got}, its meta file says {size}", path=os.fspath(path))
    return raw


def buffer_for(size: int, path: str | os.PathLike[str]) -> bytearray:
    """A buffer of ``size`` bytes to read a file of FTI's POSIX or MPI-IO I/O into, whole (its MD5 covers it
    whole); RecoveryError, not damage, where this machine cannot hold it (a size backed by a sparse file costs
    nothing on disk): a recovery tries the next level, a command says so in one line."""
    try:
        return bytearray(size)
    except MemoryError:
        raise RecoveryError(f"{os.fspath(path)}: not enough memory to read the file's {size:,} bytes whole (its MD5 "
                            "covers them whole)") from None


def meta_int(values: dict[str, str], key: str, where: str) -> int:
    """The byte count of ``key`` in a meta section (FormatError naming ``where`` when missing or not one)."""
    text = values.get(key)
    if text is None or not re.fullmatch(r"\d{1,19}", text):
        raise FormatError(f"{key} = {text!r} is not a byte count (missing or not a non-negative integer)", path=where)
    return int(text)


def meta_variables(values: dict[str, str], size: int, where: str) -> list[tuple[int, int, int]]:
    """``(id, position, size)`` of each variable, in the file's order, checked to lie inside ``size`` bytes."""
    out: list[tuple[int, int, int]] = []
    seen: set[int] = set()
    pos, j = 0, 0
    while f"var{j}_id" in values:
        text = values[f"var{j}_id"]
        if not re.fullmatch(r"-?\d{1,10}", text) or not -2**31 <= int(text) < 2**31:
            raise FormatError(f"var{j}_id = {text!r} is not a variable id", path=where)
        nbytes = meta_int(values, f"var{j}_size", where)
        start = meta_int(values, f"var{j}_pos", where) if f"var{j}_pos" in values else pos
        if start + nbytes > size:
            raise FormatError(f"variable {text}: bytes [{start}, {start + nbytes}) lie outside the file "
                              f"({size} bytes)", path=where)
        if int(text) in seen:  # a set: a meta file of 500 000 variables is checked in linear time
            raise FormatError(f"variable id {text} is listed twice", path=where)
        seen.add(int(text))
        out.append((int(text), start, nbytes))
        pos, j = start + nbytes, j + 1
    if not out:
        raise FormatError("the section lists no variable (var0_id, var0_size)", path=where)
    return out


def read_posix(path: str | os.PathLike[str], meta: str | os.PathLike[str]) -> PosixFile:
    """Read and verify FTI's POSIX checkpoint file ``path`` with its meta file (or a directory of them)."""
    other = other_io_mode(path)
    if other:
        raise FormatError(other, path=os.fspath(path))
    if _RSED.fullmatch(os.path.basename(os.fspath(path))):
        raise FormatError(_PARITY_REFUSED, path=os.fspath(path))
    if _DCP.fullmatch(os.path.basename(os.fspath(path))):  # its layers: ftidask.ftiff.fti_dcp_posix
        from .fti_dcp_posix import read_dcp_posix
        return read_dcp_posix(path, meta)
    meta_path, values = find_section(path, meta)
    where = f"{meta_path} [{os.path.basename(os.fspath(path))}]"
    if values["ckpt_type"] != "full" or any(key.startswith("dcp") for key in values):
        raise FormatError("the meta file describes a differential checkpoint (dCP layers), kept by FTI in "
                          "dcp-id{f}-rank{r}.fti files, not in this one", path=where)
    size = meta_int(values, "ckpt_file_size", where)
    checksum = values.get("ckpt_checksum", "").lower()
    if not (HEX32.fullmatch(checksum) or HEX15.fullmatch(checksum)):
        raise FormatError(f"ckpt_checksum = {checksum!r}: no MD5 to verify the file against, so it is not read",
                          path=where)
    variables = meta_variables(values, size, where)
    # FTI_Decode (src/postreco.c) pads each surviving rank file to the group's largest, ckpt_file_maxs, and cuts it
    # back once decoded: interrupted in between, it leaves the file padded. Its first ckpt_file_size bytes are the
    # checkpoint (checked by their MD5 below); the padding is never read.
    maxs = values.get("ckpt_file_maxs", "")
    raw = read_whole(path, size, int(maxs) if re.fullmatch(r"\d{1,19}", maxs) else -1)
    if not checksum_matches(hashlib.md5(raw, usedforsecurity=False).hexdigest(), checksum):
        raise FormatError("MD5 does not match the meta file's ckpt_checksum (damaged file)", path=os.fspath(path))
    view = memoryview(raw)
    data = {vid: view[start:start + nbytes] for vid, start, nbytes in variables}
    return PosixFile(os.fspath(path), str(meta_path), data)


def checksum_matches(digest: str, checksum: str) -> bool:
    """Whether the MD5 ``digest`` (32 hex digits) is the meta file's ``ckpt_checksum`` ``checksum``, in either form FTI
    wrote it (:data:`HEX15`: an early FTI's 15 characters)."""
    if HEX32.fullmatch(checksum):
        return digest == checksum
    return bool(HEX15.fullmatch(checksum)) and len(digest) == 32 and digest[0:30:2] == checksum


def posix_files(root: Path) -> list[Path]:
    """FTI's POSIX files in the directory ``root``: rank files, partner copies, parity files, dCP files, and MPI-IO's
    shared files (their meta files are the POSIX mode's)."""
    return sorted(p for pattern in ("Ckpt*-Rank*.fti", "Ckpt*-Pcof*.fti", "Ckpt*-RSed*.fti", "dcp-id*-rank*.fti",
                                    "Ckpt*-mpiio.fti")
                  for p in root.glob(pattern) if p.is_file())


def verify_posix(path: Path, meta: str | os.PathLike[str]) -> str:
    """Check one of FTI's POSIX files (a rank file, a partner copy, a parity file, or MPI-IO's shared file: every rank's
    part) against its meta file; a note on what could not be checked (or was: MPI-IO's parts), or ''."""
    if _RSED.fullmatch(path.name):
        return verify_posix_parity(path, meta)
    if _MPIIO.fullmatch(path.name):  # every rank's part
        from .fti_mpiio import verify_mpiio
        return verify_mpiio(path, meta)
    read_posix(path, meta)
    return ""
