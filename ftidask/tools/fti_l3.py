"""A rank's level-3 file of an FTI run rebuilt from its group's other files and FTI's parity, as FTI_Decode does.

FTI_RecoverL3 (src/postreco.c) checks the group's ``2k`` files (``k = group_size``: each member's
``Ckpt{id}-Rank{r}.fti`` and ``Ckpt{id}-RSed{r}.fti`` in its node's ``l3`` directory), counts the missing or damaged
ones as erased, and decodes when at most ``k`` are (:mod:`ftidask.ftiff.fti_rs`). Here the same is done for one
rank: its own file counts as lost, every other file is checked before it is read (POSIX: size and MD5 from the
group's meta file, ``ckpt_checksum`` and ``RSed_checksum``; FTI-FF: a rank file's own hashes, a parity file's MD5 in
its record), too many losses is a :class:`RecoveryError` naming each, and the rebuilt file is written at a temporary
name, cut to its size, checked as a rank file is (POSIX: ``ckpt_checksum``; FTI-FF: every hash) and only then put in
place of the lost one (rename), as FTI writes it back in place. Nothing else of the run is changed.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

from ..ftiff import fti_rs
from ..ftiff.ftiparity import parity_problem, sniff_parity
from ..ftiff.posix import checksum_matches, find_sections
from ..ftiff.reader import parse_ftiff, verify_data
from ..ftiff.structs import FB_SIZE, FileBlock
from ..ftiff.verify import md5_hex
from ..levels.blockio import clear_directory
from ..model.config import Config
from ..model.errors import FormatError, RecoveryError
from ..storage.files import create_temp, fsync_dir, makedirs, open_read
from .fti_ranks import global_rank


def group_members(cfg: Config, rank: int) -> tuple[int, list[tuple[int, Path]]]:
    """``(g, members)``: rank ``rank``'s place ``g`` in its level-3 group and, for each place, the member's rank and
    its ``l3`` directory (nodes placed as :func:`ftidask.tools.fti_run.fti_run_files` places them). ``rank``: a
    global rank (heads included, as in the file names); a head's is refused (ConfigError). With heads the group
    is the same: FTI_RSenc, run by the heads, encodes each place ``p`` of the node with the heads' group, i.e. the
    files of the processes at place ``p`` on the group's nodes, in node order, as the processes do inline."""
    rank = global_rank(cfg, rank, "global")
    per_node, k = cfg.node_size, cfg.group_size
    node = rank // per_node
    first = node - node % k
    root = Path(cfg.ckpt_dir)
    members = [((first + i) * per_node + rank % per_node,
                root / (f"node{first + i}" if cfg.local_test else "") / str(cfg.exec_id) / "l3") for i in range(k)]
    return node % k, members


def l3_checkpoint_ids(cfg: Config, rank: int) -> list[int]:
    """The checkpoint ids of which the group of ``rank`` keeps a level-3 rank or parity file, newest first."""
    ids = set()
    for _member, folder in group_members(cfg, rank)[1]:
        try:  # a member's directory the OS refuses to list: that member's files are lost, as on a lost node
            names = [path.name for path in folder.iterdir()] if folder.is_dir() else []
        except OSError:
            names = []
        for name in names:
            named = re.fullmatch(r"Ckpt(\d+)-(?:Rank|RSed)\d+\.fti", name)
            if named:
                ids.add(int(named[1]))
    return sorted(ids, reverse=True)


def _posix_plan(cfg: Config, ckpt_id: int, members: list[tuple[int, Path]], g: int, stack: contextlib.ExitStack,
                lost: list[str]) -> tuple[int, int, dict[int, fti_rs.Reader], dict[str, str]]:
    """maxFs, the lost file's size, the sound files' readers, and the lost file's meta section (POSIX I/O)."""
    k = len(members)
    meta = Path(cfg.meta_dir) / str(cfg.exec_id) / "l3"
    try:  # the meta file parsed once for the whole group
        sections = [values for _path, values in
                    find_sections([folder / f"Ckpt{ckpt_id}-Rank{member}.fti" for member, folder in members], meta)]
    except FormatError as exc:
        raise RecoveryError(f"the group's meta file cannot be read: {exc}") from None
    maxs = {_count(s, "ckpt_file_maxs") for s in sections}
    max_fs = maxs.pop() if len(maxs) == 1 else None
    sizes = [size for size in (_count(s, "ckpt_file_size") for s in sections)
             if size is not None and max_fs is not None and size <= max_fs]
    if max_fs is None or len(sizes) != k:
        said = ", ".join(f"[{i}] {v.get('ckpt_file_size')} of {v.get('ckpt_file_maxs')}"
                         for i, v in enumerate(sections))
        raise RecoveryError("the group's meta sections disagree on ckpt_file_maxs, or give a ckpt_file_size that is "
                            f"missing or past it: {said}")
    _check_room(members[g][1], max_fs, "the group's ckpt_file_maxs")
    if not sections[g].get("ckpt_checksum"):
        raise RecoveryError("the meta file records no ckpt_checksum of the lost file: a rebuilt file could not be "
                            "verified")
    readers: dict[int, fti_rs.Reader] = {}
    for i, (member, folder) in enumerate(members):
        for fid, path, expect, size in ((i, folder / f"Ckpt{ckpt_id}-Rank{member}.fti", "ckpt_checksum", sizes[i]),
                                        (k + i, folder / f"Ckpt{ckpt_id}-RSed{member}.fti", "rsed_checksum", max_fs)):
            if fid == g:
                continue
            why, fd = _open_checked(path, size, max_fs, sections[i].get(expect, "").lower(), stack)
            if why:
                lost.append(f"{path.name}: {why}")
            else:
                readers[fid] = fti_rs.padded_reader(fd, size, max_fs, size_word=False)
    return max_fs, sizes[g], readers, sections[g]


def _check_room(folder: Path, max_fs: int, said: str) -> None:
    """RecoveryError unless ``max_fs`` bytes, the size of the file a rebuild writes, are free where it is written
    (``folder``, or its nearest existing parent: a lost node's directory is made again). Checked before any file of
    the group is read: a size in a meta file or parity record, backed by sparse files, then never fills the disk,
    nor sends the rebuild through terabytes of zeros."""
    where = folder
    try:
        while not where.exists() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free
    except OSError as exc:
        raise RecoveryError(f"cannot tell the free space of {where}: {exc}") from None
    if max_fs > free:
        raise RecoveryError(f"{said} is {max_fs} bytes, the size of the file to rebuild, and {where} has {free} bytes "
                            "free: not rebuilt")


def _count(values: dict[str, str], key: str) -> int | None:
    text = values.get(key, "")
    return int(text) if re.fullmatch(r"\d{1,19}", text) else None


def _open_checked(path: Path, size: int, max_fs: int, checksum: str,
                  stack: contextlib.ExitStack) -> tuple[str, int]:
    """('', fd) for a POSIX file of ``size`` bytes (or left padded to ``max_fs``) whose MD5 is ``checksum`` (none
    recorded: the size alone, as FTI_CheckFile), else (why, -1)."""
    try:
        fh = stack.enter_context(open_read(path))
    except OSError as exc:
        return ("missing" if isinstance(exc, FileNotFoundError) else f"cannot be read: {exc}"), -1
    actual = os.fstat(fh.fileno()).st_size
    if actual not in (size, max_fs):
        return f"{actual} bytes, the meta file says {size}", -1
    if checksum and not checksum_matches(md5_hex(fh.fileno(), 0, size), checksum):
        return "MD5 does not match the meta file (damaged)", -1
    return "", fh.fileno()


def _ftiff_plan(ckpt_id: int, members: list[tuple[int, Path]], g: int, stack: contextlib.ExitStack,
                lost: list[str]) -> tuple[int, int | None, dict[int, fti_rs.Reader], bool]:
    """maxFs, the lost file's size if its parity record says it, the sound files' readers, and whether the group is
    FTI 1.1's (FTI-FF). FTI 1.1's FTI_RSenc pads the rank files with zeros only (no size word): its files say their
    size in the file block at their start."""
    k = len(members)
    parities: dict[int, tuple[int, int, int, bool]] = {}  # id: (fd, maxFs, rank file size, FTI 1.1)
    for i, (member, folder) in enumerate(members):
        path = folder / f"Ckpt{ckpt_id}-RSed{member}.fti"
        try:
            fd = stack.enter_context(open_read(path)).fileno()
            parity = sniff_parity(fd, os.fstat(fd).st_size)
            if parity is not None:  # the room first: the MD5 of a sparse terabyte would take hours
                _check_room(members[g][1], parity.parity_size, f"{path.name}'s maxFs")
            why = ("not an FTI parity file (no parity record at its end)" if parity is None else
                   parity_problem(fd, parity))
        except FileNotFoundError:
            why = "missing"
        except OSError as exc:
            why = f"cannot be read: {exc}"
        except RecoveryError as exc:
            why = str(exc)
        if why:
            lost.append(f"{path.name}: {why}")
        else:
            legacy = parity.record == "FTI 1.1"  # type: ignore[union-attr]
            parities[k + i] = (fd, parity.parity_size, parity.rank_size, legacy)  # type: ignore[union-attr]
    if not parities:
        raise RecoveryError("no sound parity file in the group: " + "; ".join(lost))
    # Parity files that disagree on maxFs or FTI version: the most of them (the lost rank's own on a tie) give the
    # group's, the others count as lost (a rebuild needs k of the 2k files, not every parity file).
    votes = collections.Counter((p[1], p[3]) for p in parities.values())
    own_kind = (parities[k + g][1], parities[k + g][3]) if k + g in parities else None
    max_fs, legacy = max(votes, key=lambda kind: (votes[kind], kind == own_kind))
    for fid in [fid for fid, p in parities.items() if (p[1], p[3]) != (max_fs, legacy)]:
        lost.append(f"parity file {fid - k} of the group: its maxFs or FTI version is not the group's "
                    f"({parities[fid][1]}, {'1.1' if parities[fid][3] else 'later'})")
        del parities[fid]
    readers = {fid: fti_rs.padded_reader(p[0], max_fs, max_fs, size_word=False) for fid, p in parities.items()}
    for i, (member, folder) in enumerate(members):
        path = folder / f"Ckpt{ckpt_id}-Rank{member}.fti"
        if i == g:
            continue
        try:
            fh = stack.enter_context(open_read(path))
            if os.fstat(fh.fileno()).st_size > max_fs:  # first: the MD5s of a sparse terabyte would take hours
                raise FormatError(f"larger than the group's maxFs of {max_fs} bytes")
            parsed = parse_ftiff(fh, str(path))
            verify_data(fh, parsed)
            size = parsed.file_size  # a file left padded: its padding is never read, the reader makes FTI's
            readers[i] = fti_rs.padded_reader(fh.fileno(), size, max_fs, size_word=size < max_fs and not legacy)
        except FileNotFoundError:
            lost.append(f"{path.name}: missing")
        except (OSError, FormatError) as exc:
            lost.append(f"{path.name}: {exc}".replace(f"{path}: ", ""))
    own = parities.get(k + g)
    return max_fs, (own[2] if own else None), readers, legacy


def rebuild_rank_file(cfg: Config, rank: int, ckpt_id: int) -> Path:
    """Rebuild rank ``rank``'s level-3 file of checkpoint ``ckpt_id`` from its group (module docstring) and put it in
    place; its path. RecoveryError saying why when it cannot be (too many losses, damaged parity, a result that does
    not verify, a file that cannot be read or written): the run is then left as it was."""
    try:
        return _rebuild(cfg, rank, ckpt_id)
    except (OSError, FormatError) as exc:  # a file cut or unreadable meanwhile, a full disk: this rebuild fails
        raise RecoveryError(f"the rebuild failed: {exc}") from None


def _rebuild(cfg: Config, rank: int, ckpt_id: int) -> Path:
    g, members = group_members(cfg, rank)
    k = len(members)
    target = members[g][1] / f"Ckpt{ckpt_id}-Rank{rank}.fti"
    lost = [f"{target.name}: the file to rebuild"]
    with contextlib.ExitStack() as stack:
        if cfg.ckpt_io in (1, 2):  # MPI-IO's levels 1-3 are POSIX files
            max_fs, size, readers, section = _posix_plan(cfg, ckpt_id, members, g, stack, lost)
        else:
            max_fs, size, readers, legacy = _ftiff_plan(ckpt_id, members, g, stack, lost)
        if len(readers) < k:
            raise RecoveryError(f"{len(lost)} of the group's {2 * k} files are lost or damaged, FTI's parity rebuilds "
                                f"at most {k}: " + "; ".join(lost))
        _no_link_below(Path(cfg.ckpt_dir), target)
        makedirs(target.parent)  # a lost node's directory is gone with its files: FTI makes it again too
        fd, tmp = create_temp(target)
        try:
            with os.fdopen(fd, "w+b") as out:
                exact_end = fti_rs.rebuild(k, max_fs, readers, {g: out})
                if cfg.ckpt_io in (1, 2):
                    _finish_posix(out, max_fs, size, exact_end, section.get("ckpt_checksum", "").lower())
                else:
                    _finish_ftiff(out, max_fs, size, exact_end, tmp, legacy)
                out.flush()
                os.fsync(out.fileno())
            clear_directory(target)  # a rank file replaced by a directory is lost: the rebuilt one takes its place
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fsync_dir(target.parent)
    return target


def _no_link_below(root: Path, target: Path) -> None:
    """Refuse a rebuild into ``target`` through a symbolic link below the run's ``root`` (a node's or level's
    directory replaced by a link): it wrote outside the run, in place of whatever the link's target held there."""
    path = root
    for part in target.relative_to(root).parts:
        path = path / part
        if path.is_symlink():
            raise RecoveryError(f"{path} is a symbolic link: the rank file is not rebuilt through it (outside the run)")


def _finish_posix(fh: BinaryIO, max_fs: int, size: int, exact_end: bool, checksum: str) -> None:
    """Cut the rebuilt POSIX file to ``size`` and check its MD5; an unknown last byte (odd maxFs) is the one of the
    256 values that gives the recorded MD5."""
    fh.truncate(size)
    fh.flush()
    fd = fh.fileno()
    if not exact_end and size == max_fs:
        head = hashlib.md5(usedforsecurity=False)
        for pos in range(0, size - 1, fti_rs.PIECE):
            head.update(os.pread(fd, min(fti_rs.PIECE, size - 1 - pos), pos))
        for byte in range(256):
            trial = head.copy()
            trial.update(bytes([byte]))
            if checksum_matches(trial.hexdigest(), checksum):
                os.pwrite(fd, bytes([byte]), size - 1)
                break
    if not checksum_matches(md5_hex(fd, 0, size), checksum):
        raise RecoveryError("the rebuilt file does not match the meta file's ckpt_checksum: the group's files are not "
                            "those of one checkpoint (or FTI's parity was damaged undetected); it is not used")


def _finish_ftiff(fh: BinaryIO, max_fs: int, size: int | None, exact_end: bool, tmp: Path, legacy: bool) -> None:
    """Cut the rebuilt FTI-FF file to the size in its last 8 bytes (FTI 1.1: its file block's ``fs``) and check
    every hash of it."""
    fd = fh.fileno()
    fh.flush()
    if legacy:
        fs_field = FileBlock.unpack(os.pread(fd, FB_SIZE, 0)).fs if max_fs >= FB_SIZE else -1
        found, room = (size if size is not None else fs_field), max_fs
    else:
        word = bytearray(os.pread(fd, fti_rs.SIZE_WORD, max_fs - fti_rs.SIZE_WORD))
        if not exact_end:  # byte maxFs - 1: the size's top byte, 0 for any size the file can have
            word[-1] = 0
        (found,) = struct.unpack("<q", bytes(word))
        room = max_fs - fti_rs.SIZE_WORD
    if not 0 < found <= room or (size is not None and found != size):
        raise RecoveryError(f"the rebuilt file says it has {found} bytes (its parity record: {size}, maxFs {max_fs}): "
                            "the group's files are not those of one checkpoint; it is not used")
    fh.truncate(found)
    fh.flush()
    try:
        with open_read(tmp) as check:
            verify_data(check, parse_ftiff(check, str(tmp)))
    except (OSError, FormatError) as exc:
        raise RecoveryError(f"the rebuilt file does not verify: {exc}") from None
