"""What ``ftidask list`` prints: the checkpoints found under a run's directories, grouped by run and sequence number,
each checked against its commit record (files damaged, rank files missing, not committed)."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

from ..engine.runstate import CommitRecord, RunState, check_exec_id, unsealed_record
from ..model.errors import FormatError, FTIError
from ..storage.files import SPARE_DIR, find_paths, read_json
from ..zarrfmt.store import read_manifest
from .file_checks import (
    ftiff_files,
    table_of,
    verdict_of,
    whole_file_problem,
    zarr_stores,
)

#: A rank's own file (an FTI-FF file or a level-4 Zarr store): what a commit record lists, one per rank; or its spare
#: (``{level dir}/dcp/Spare-Rank{r}.fti``), the file of the previous differential checkpoint (the fallback record's).
_RANK_FILE = re.compile(r"(?:Ckpt-?\d+|Spare)-Rank(\d+)\.(fti|zarr)")
_SPARE = re.compile(r"Spare-Rank\d+\.fti")
#: A checkpoint file FTI itself wrote, where FTI keeps it (``{exec_id}/l{level}/Ckpt{id}-Rank{r}.fti``, at level 2
#: ``Ckpt{id}-Pcof{keeper}.fti`` too): a directory less deep than ftidask's ``{exec_id}/l{level}/ckpt{id}.s{seq}/``.
_FTI_FILE = re.compile(r"Ckpt(\d+)-(?:(?:Rank|Pcof)\d+|mpiio)\.fti")  # (MPI-IO: every rank's part in one file)
FTI_RUN = " (FTI)"  # the exec_id of a run FTI wrote is listed so: its files are grouped by checkpoint id, no seq
HEADER = f"{'exec_id':32} {'id':>5} {'level':>5} {'seq':>5} {'time':19} {'files':>5} {'bytes':>14}  state"
Found = list[tuple[Path, str, object]]  # (path, "ok" or "damaged", the parsed file or the problem)


def _size(path: Path) -> int:
    """Bytes of a file or a store's files; 0 for what is gone or a dangling link (deleted meanwhile, or planted)."""
    try:
        if not path.is_dir():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for p in find_paths(path, "*"):
        with contextlib.suppress(OSError):  # deleted meanwhile
            total += p.stat().st_size if p.is_file() else 0
    return total


def _key(path: Path, kind: str, detail: object, meta: Path) -> tuple[str, int]:
    """``(exec_id, seq)`` of a file: its path's (``{exec_id}/l*/ckpt*.s{seq}``; keep_last_ckpt's L4 copy has a seq
    of its own, its files the first one's); a spare's, its level's fallback record's (the previous differential
    checkpoint's: a damaged spare's own table cannot be read); else its variable table's."""
    if (fti := _FTI_FILE.fullmatch(path.name)) and re.fullmatch(r"l[1-4]", path.parent.name):
        run = path.parent.parent.name  # not the node's or the global directory's name, as ftidask's nesting gave
        with contextlib.suppress(FTIError):
            return check_exec_id(run) + FTI_RUN, int(fti[1])
        return ascii(run) + FTI_RUN, int(fti[1])
    table = table_of(detail) if kind == "ok" else {}
    found = re.fullmatch(r"ckpt\d+\.s(\d+)", path.parent.name)
    exec_id = str(table.get("exec_id", path.parent.parent.parent.name))
    try:
        exec_id = check_exec_id(exec_id)
    except FTIError:  # a forged table's, or an odd directory's: printed escaped (no terminal control), never a path
        return ascii(exec_id), int(table.get("seq", 0))
    if found:
        return exec_id, int(found[1])
    if (fallback := _fallback_of(path, meta)) is not None:
        return path.parent.parent.parent.name, fallback.seq
    return exec_id, int(table.get("seq", 0))


def _fallback_of(path: Path, meta: Path) -> CommitRecord | None:
    """The fallback record whose spare ``path`` is (``{exec_id}/l{level}/dcp/Spare-Rank{r}.fti``), else None."""
    level = re.fullmatch(r"l([1-4])", path.parent.parent.name)
    if not (_SPARE.fullmatch(path.name) and path.parent.name == SPARE_DIR and level):
        return None
    try:
        run = check_exec_id(path.parent.parent.parent.name)
    except FTIError:
        return None
    return next((r for r in RunState(meta, run).fallbacks() if r.level == int(level[1])), None)


def collect(roots: list[Path], meta: Path) -> dict[tuple[str, int], Found]:
    """The files found under ``roots``, checked, by ``(exec_id, seq)``; a committed checkpoint of a run under
    ``meta`` none of whose files is found has an empty entry (it is not recoverable: it must be told)."""
    groups: dict[tuple[str, int], Found] = {}
    for root in roots:
        for path in ftiff_files(root) + zarr_stores(root):  # level 4 may be written as Zarr stores
            kind, detail = verdict_of(path)
            if kind == "ok" and (problem := whole_file_problem(path)):  # an L3 file its parity does not encode
                kind, detail = "damaged", problem
            groups.setdefault(_key(path, kind, detail, meta), []).append((path, kind, detail))
    for run in sorted(meta.iterdir()) if meta.is_dir() else ():
        if (run / "commits").is_dir():
            with contextlib.suppress(FTIError):  # not a run's name: none of its records is listed
                for record in RunState(meta, check_exec_id(run.name)).records():
                    groups.setdefault((run.name, record.seq), [])
    return groups


def _not_named(path: Path, parsed: Any, named: dict[int, Any]) -> bool:
    """Whether FTI-FF file ``path`` (``parsed``) differs from the rank file its commit record names (hash, size); a
    Zarr store, whether its manifest is not the one the record names (a sound store of another checkpoint)."""
    m = _RANK_FILE.fullmatch(path.name)
    expected = named.get(int(m[1])) if m else None
    if expected is not None and path.suffix == ".zarr":
        try:
            read_manifest(path, expected.fb_hash)
        except FormatError:
            return True
        return False
    fb = getattr(parsed, "fb", None)
    if expected is None or fb is None:  # no rank named
        return False
    return expected.fb_hash != fb.hash.hex() or expected.size != parsed.file_size


def row(exec_id: str, seq: int, files: Found, meta: Path) -> str:
    """One line of the listing: the checkpoint ``seq`` of run ``exec_id`` and the state of ``files``."""
    if exec_id.endswith(FTI_RUN):
        return _fti_row(exec_id, seq, files)
    commit = meta / exec_id / "commits" / f"s{seq:08d}.json"
    record = unsealed_record(read_json(commit)) if commit.is_file() else None  # None: torn or damaged too
    fallback = None if record is not None else next((f for f in RunState(meta, exec_id).fallbacks() if f.seq == seq),
                                                    None)
    record = record or fallback  # the spares' record: what they are even when none of them reads (damaged)
    if record is not None:  # each file the one its record names, as recover() checks (a sound file put in its place)
        named = {f.rank: f for f in record.files}
        files = [(p, "damaged", "not the file its commit record names") if k == "ok" and _not_named(p, d, named)
                 else (p, k, d) for p, k, d in files]
    sound = [d for _p, k, d in files if k == "ok"]
    table = table_of(sound[0]) if sound else {}
    if record is not None:  # the commit record says what it is (a file's own table may be another checkpoint's)
        table = {**table, "ckpt_id": record.ckpt_id, "level": record.level, "time": table.get("time", record.timestamp)}
    size = sum(_size(p) for p, _k, _d in files)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(table.get("time", 0))) if table else "?"
    state = "sound" if len(sound) == len(files) else f"DAMAGED ({len(files) - len(sound)} of {len(files)} files)"
    if record is not None:
        found = {int(m[1]) for p, _k, _d in files if (m := _RANK_FILE.fullmatch(p.name))}
        if missing := {f.rank for f in record.files} - found:
            redundancy = {2: " (a restart rebuilds them from the partner copies if those hold)",
                          3: " (a restart rebuilds them from the parity if enough of the group holds)"}
            state = (f"MISSING {len(missing)} of {len(record.files)} rank files{redundancy.get(record.level, '')}"
                     + ("" if state == "sound" else f", {state}"))
        if fallback is not None:
            state += ", the previous differential checkpoint (a restart falls back to it if it must)"
    elif not meta.is_dir():  # files found elsewhere than under a run's directories: no record to look at
        state += f", commit not checked (no {meta}: give the run's config, --config)"
    else:
        state += ", commit record damaged" if commit.is_file() else ", not committed"
    level = record.level if record is not None else table.get("level", "?")  # (raised to L4 after the write)
    return (f"{exec_id:32} {table.get('ckpt_id', '?'):>5} {level:>5} {seq:>5} {when:19} "
            f"{len(files):>5} {size:>14}  {state}")


def _fti_row(exec_id: str, ckpt_id: int, files: Found) -> str:
    """The line of checkpoint ``ckpt_id`` of a run FTI wrote: no commit record (FTI keeps none), no seq; its FTI-FF
    files checked by their own hashes, its POSIX ones (raw bytes) said to be checked with their meta file."""
    posix = [p for p, k, d in files if k != "ok" and ("not an FTI-FF file" in str(d) or p.name.endswith("-mpiio.fti"))]
    damaged = [p for p, k, _d in files if k != "ok" and p not in posix]
    levels = ",".join(sorted({p.parent.name[1:] for p, _k, _d in files}))
    state = "sound" if not damaged else f"DAMAGED ({len(damaged)} of {len(files)} files)"
    if posix:
        state = f"{len(posix)} of {len(files)} files of FTI's POSIX or MPI-IO I/O (checked with their meta file: " \
            "verify --meta)" \
            + ("" if len(posix) == len(files) else f", the others {state}")
    size = sum(_size(p) for p, _k, _d in files)
    return (f"{exec_id:32} {ckpt_id:>5} {levels:>5} {'-':>5} {'?':19} {len(files):>5} {size:>14}  {state}, written by "
            "FTI (no commit record: read it with ftidask.tools.fti_run.recover_fti_run)")
