"""Recovery of an MPI checkpoint on another number of ranks (or another node layout).

A restart whose layout differs from the checkpoint's never loads rank r's old file into rank r
blindly. Every protected variable must say where its data sits (:mod:`ftidask.model.decomposition`):

* a block of a global array: each new rank's block is filled from whichever old files hold its
  pieces; only the containers that hold needed bytes are read, each checked against its hash
  before its bytes are used;
* replicated: filled from one old file;
* undeclared: only when the number of ranks is unchanged (rank r still gets old rank r's data,
  read from its old node's directory).

A checkpoint of the Dask backend (its workers' files hold chunks) is always redistributed
(:mod:`.reshard_dask`); one process may protect its arrays whole, undeclared.

Data goes first into private buffers (fresh arrays: pages moved under them), or, for an array in use, its
pieces are only verified; the ranks agree (allgather) that every one of them has all its data before any
protected array is written. Otherwise every rank raises the same
:class:`~ftidask.model.errors.RecoveryError` and no array is touched. Arrays in use are then read from the
files verified, unchanged since, as on the same layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.arrays import copy_items
from ..model.errors import FormatError, FTIError, NoCheckpointError, RecoveryError
from ..storage.files import SPARE_DIR, spare_file
from . import pagemove, recoverplan, reshard_dask, reshard_plan, reshard_read
from .dcpstore import distrust_spare
from .device import holders
from .recovery import check_writeable
from .reshard_files import StatesRefused, open_old, read_pieces, state_sizes, table_of
from .reshard_read import first_said
from .reshard_read import why as _why
from .reshard_rebuild import old_groups, rebuild_group
from .retention import rank_path
from .runstate import CommitRecord

if TYPE_CHECKING:
    from .recovering import Recovery

log = logging.getLogger("ftidask")

HOW = ("To recover it, either restart on the checkpoint's layout ({n} ranks{nodes}), or declare where each "
       "variable sits, in the run that writes checkpoints and in this one: ctx.protect(id, local, "
       "global_shape=..., offset=...) (or ftidask.Block(global_shape, offset)) for a block of a global array, "
       "replicated=True for an array every rank holds whole; or move the data with `ftidask export --to-zarr` "
       "and `ftidask import`.")


def layout_change(record: CommitRecord, size: int, nodes: list[int]) -> str:
    """What differs between the checkpoint's layout and this run's ('' when nothing does).

    ``nodes``: this run's node per rank. L4 files are global, so only the number of ranks counts there.
    """
    if record.extra.get("backend") == "dask":  # chunks in the workers' order: never loaded as rank r's block
        return f"checkpoint {record.ckpt_id} (level {record.level}) was written by the Dask backend " \
               f"({record.nranks} worker(s)), this run recovers on {size} rank(s)"
    if record.nranks != size:
        return f"checkpoint {record.ckpt_id} (level {record.level}) was written by {record.nranks} ranks, " \
               f"this run recovers on {size}"
    old = [f.node for f in sorted(record.files, key=lambda f: f.rank)]
    if record.level != 4 and old != list(nodes):
        return (f"checkpoint {record.ckpt_id} (level {record.level}) was written with ranks on nodes {_short(old)}, "
                f"this run has them on nodes {_short(nodes)}")
    return ""


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 16 else f"[{', '.join(map(str, values[:16]))}, ...]"


DASK = ("It was written by the Dask backend, whose workers' files hold chunks of each array: protect each variable "
        "whole (one process), or declare each rank's block (ctx.protect(id, local, global_shape=..., offset=...)) or "
        "replicated=True, and recover() redistributes the chunks; or recover it on a Dask cluster of any number of "
        "workers (ftidask.init(client=...)), or move the data with `ftidask export --to-zarr` and `ftidask import`.")


def advice(record: CommitRecord) -> str:
    """How to recover ``record`` when this run cannot redistribute it."""
    if record.extra.get("backend") == "dask":
        return DASK
    nodes = "" if record.level == 4 else \
        f" on nodes {_short([f.node for f in sorted(record.files, key=lambda f: f.rank)])}"
    return HOW.format(n=record.nranks, nodes=nodes)


def states_advice(record: CommitRecord, older: Sequence[CommitRecord]) -> str:
    """How to go on when ``record`` holds per-rank Python states and this run has another number of ranks. An older
    checkpoint is never recovered in its place unasked (the application would silently go back in time, while a
    restart on the checkpoint's ranks recovers the newest): ``older`` (the run's checkpoints) names those to ask for."""
    named: dict[int, CommitRecord] = {}  # by id, the newest of each (the one recover(ckpt_id=...) tries first)
    for r in sorted(older, key=lambda r: r.seq, reverse=True):
        if r.seq < record.seq and r.ckpt_id != record.ckpt_id:  # that id would find this checkpoint again
            named.setdefault(r.ckpt_id, r)
    listed = ", ".join(f"{r.ckpt_id} (level {r.level}, {r.nranks} "
                       f"{'Dask workers' if r.extra.get('backend') == 'dask' else 'ranks'})"
                       for r in list(named.values())[:6])
    return (f"An older checkpoint is not recovered in its place unasked: restart on {record.nranks} ranks to recover "
            f"checkpoint {record.ckpt_id}, or recover an older one by its id, ctx.recover(ckpt_id=...) "
            + (f"(older checkpoints of this run: {listed}{', ...' if len(named) > 6 else ''})." if named
               else "(this run has no older checkpoint)."))


def old_path(ctx: Any, record: CommitRecord, rank: int) -> Path:
    """Old rank ``rank``'s file of ``record``, in its own node's directory (a fallback's: the spare there)."""
    return rank_path(ctx.paths, record, next(f.node for f in record.files if f.rank == rank), rank)


# --- recovery ------------------------------------------------------------------------------------

def by_layout(ctx: Recovery, records: list[CommitRecord]) -> list[tuple[str, list[CommitRecord]]]:
    """``records`` (newest first) in runs of one kind, newest first: ``(change, run)``, ``change`` saying how the
    run's checkpoints differ from this run's layout ("" for this run's own). Collective (the nodes are gathered)."""
    t = ctx.transport
    nodes = t.allgather(t.node)
    runs: list[tuple[str, list[CommitRecord]]] = []
    for record in records:
        change = layout_change(record, t.size, nodes)
        if runs and bool(runs[-1][0]) == bool(change):
            runs[-1][1].append(record)
        else:
            runs.append((change, [record]))
    return runs


def recover_other_layout(ctx: Recovery, records: list[CommitRecord], change: str, ids: list[int] | None = None,
                         older: Sequence[CommitRecord] = ()) -> dict[int, np.ndarray]:
    """Redistribute the newest of ``records`` (written on another layout than this run's, as ``change`` says) that can
    be; the same NoCheckpointError on every rank, nothing touched, when none can. Collective. A partial recovery
    (``ids``) is not redistributed: it is refused, on every rank, before anything is read. ``older``: the run's
    checkpoints a refusal may name (:func:`states_advice`)."""
    if ids is not None:
        raise RecoveryError(f"{change}: recover(ids=...) recovers on the checkpoint's own layout only; recover every "
                            "variable (no ids) to redistribute it")
    for holder in holders(ctx.variables).values():
        holder.mirror_written()  # before any byte of the recovery reaches it
    record, arrays = recover_resharded(ctx, records, change, older)
    if record.fallback or ctx.config.enable_dcp:  # a fallback: the old ranks' spares are all that a crash would
        ctx.spares.get().redistributed(record.level, record.seq, record.fallback)  # recover (the next one leaves them)
    ctx.progress.restored(record.ckpt_id, record.level, None)  # None: the next checkpoint plans its containers afresh
    ctx.progress.resharded = (record, change)  # stored_size and realloc refuse it as such
    devices = {vid: d for vid, d in holders(ctx.variables).items() if vid in arrays}
    recoverplan.upload(devices)  # CuPy arrays: their mirrors were filled
    return {**arrays, **{vid: d.obj for vid, d in devices.items()}}


def redistributed(message: str, record: CommitRecord) -> RecoveryError:
    """The error of stored_size/realloc when the checkpoint a restart recovers, ``record``, has another layout
    (recover() redistributes it); it names the record (``.redistributed``: var_id reads its names,
    :func:`old_names`)."""
    error = RecoveryError(message)
    error.redistributed = record  # type: ignore[attr-defined]
    return error


def sizes_refused(record: CommitRecord, change: str) -> RecoveryError:
    """stored_size's and realloc's error when the checkpoint of a restart, ``record``, is (or was) redistributed."""
    return redistributed(f"{change}: its stored sizes are per old rank, and recover() redistributes it into the arrays "
                         "as this run declares them (the size of each block is the application's choice). "
                         f"{advice(record)}", record)


def old_names(ctx: Recovery, record: CommitRecord) -> dict[int, str]:
    """The variables' names (by id) on a restart that redistributes ``record`` (``ctx.var_id``), read from its old
    files' tables (each old file by one rank); {} when they cannot all be read. Collective. An id named otherwise
    in another old file is left out: a name given a new id then is refused by the recovery, never filled
    with another variable's data."""
    t = ctx.transport
    mine: list[list[Any]] = []
    ok = True
    for old in range(t.rank, record.nranks, t.size):
        try:
            parsed = open_old(old_path(ctx, record, old), record, old)
            mine += [[vid, info.name] for vid, info in parsed.vars.items()]
        except Exception:  # noqa: BLE001 - agreed below: a rank that raised alone would leave the others waiting
            ok = False
    parts = t.allgather([ok, mine])
    if not all(part[0] for part in parts):
        return {}
    names: dict[int, str] = {}
    clash: set[int] = set()
    for _ok, pairs in parts:
        for vid, name in pairs:
            if names.setdefault(int(vid), str(name)) != name:
                clash.add(int(vid))
    return {vid: name for vid, name in names.items() if vid not in clash}


def recover_resharded(ctx: Recovery, records: list[CommitRecord], change: str,
                      older: Sequence[CommitRecord] = ()) -> tuple[CommitRecord, dict[int, Any]]:
    """Fill ``ctx``'s protected arrays from the newest of ``records`` (layouts other than this run's).

    Collective. Returns the record and the arrays; raises the same error on every rank otherwise.
    """
    t = ctx.transport
    arrays = {vid: p.array for vid, p in ctx.variables.items()}
    decls = {vid: getattr(p, "decomp", None) for vid, p in ctx.variables.items()}
    holders = {vid: p.state for vid, p in ctx.variables.items() if getattr(p, "state", None) is not None}
    first = records[0]
    if not any(t.allgather(bool(arrays))):  # before: {} returned, status 0, and the next checkpoint lost it
        raise RecoveryError(f"{change}: {recoverplan.NOTHING_PROTECTED}")
    problem = next((m for m in (check_writeable(vid, a) for vid, a in arrays.items()) if m), "")
    dask = first.extra.get("backend") == "dask"  # one process takes a Dask checkpoint's arrays whole
    if not problem and (first.nranks != t.size or dask) and t.size > 1:  # one process: each array whole (reshard_plan)
        undeclared = sorted(vid for vid, d in decls.items() if not d and vid not in holders)  # states: below
        if undeclared:
            problem = f"variable(s) {undeclared} declare no decomposition, so their data cannot be redistributed"
    problems = [(r, p) for r, p in enumerate(t.allgather(problem)) if p]
    if problems:
        r, p = problems[0]
        raise RecoveryError(f"{change}: rank {r}: {p}. {advice(first)}")
    reasons, staged = [], {}
    for record in records:
        states = holders  # stored as bytes (a Dask worker holds each whole): decoded, agreed, then applied
        try:
            staged, later = _stage(ctx, record, {v: a for v, a in arrays.items() if v not in states}, decls,
                                   list(states))
            # (refused below: released at once; any other exception: unmapped when ``staged`` goes)
            contents, problem = {}, ""
            try:  # each rank decodes its own holders (a dict may refuse what a Value takes): agreed, or they part ways
                contents = {vid: holder.decode(staged.pop(vid), f"variable {vid}") for vid, holder in states.items()}
            except RecoveryError as exc:
                problem = str(exc)
            _agree(t, problem, RecoveryError)
        except _Refused as exc:  # the user's declarations do not fit this checkpoint: an older one will not fit either
            how = states_advice(record, older) if isinstance(exc, StatesRefused) else advice(record)
            raise RecoveryError(f"{layout_change(record, t.size, t.allgather(t.node))}: {exc}. {how}") from None
        except RecoveryError as exc:
            # a checkpoint refused after staging (a state that did not decode): its buffers and pages, filled
            # (resident), go now, not once an older checkpoint was staged beside them (twice the arrays' memory)
            pagemove.release_all({vid: d for vid, d in staged.items() if isinstance(d, pagemove.Staged)})
            staged = {}
            if record.fallback:  # an old rank's spare failed, perhaps this rank's own (same node and name): none of
                # them is patched as if it were whole (see Recovery.find), each rank's next one is written in full
                distrust_spare(ctx.spares.store, record.level, ctx.paths.level_dir(record.level, t.node)
                               / SPARE_DIR / spare_file(t.rank))
            reasons.append(f"checkpoint {record.ckpt_id} (level {record.level}): {exc}")
            log.warning("cannot recover checkpoint %d (level %d) on this layout: %s", record.ckpt_id, record.level,
                        exc)
            continue
        try:  # every rank has all its data, verified: now, and only now, the arrays
            _load_later(t, record, later, arrays)
        except RecoveryError:
            pagemove.release_all({vid: d for vid, d in staged.items() if isinstance(d, pagemove.Staged)})
            raise
        for vid in list(staged):
            data = staged.pop(vid)
            if isinstance(data, pagemove.Staged):
                data.commit()  # fresh array: the verified pages moved under it
            else:
                copy_items(arrays[vid], data)
        for vid, content in contents.items():
            states[vid].apply(content)
        log.info("recovered checkpoint %d from level %d, written by %d %s, on %d", record.ckpt_id, record.level,
                 record.nranks, "Dask workers" if record.extra.get("backend") == "dask" else "ranks", t.size)
        return record, arrays
    raise NoCheckpointError(f"{change}; no checkpoint can be redistributed onto this layout:"
                            + "".join(f"\n  - {r}" for r in reasons)
                            + "\nOld files must be reachable from the ranks that read them (L4, or every node "
                              "directory with local_test, where files lost from a node are first rebuilt from "
                              f"L2/L3 partner copies or parity). {advice(records[0])}")


_Refused = reshard_dask.Refused  # the declarations of this run do not match the checkpoint's


def _agree(t: Any, problem: str, kind: type[FTIError], what: str = "") -> None:
    """Raise ``kind`` on every rank when any rank has a problem (the first one, with its rank; after ``what``)."""
    first = first_said(t.allgather(problem))
    if first:
        raise kind(f"{what}{': ' if what else ''}{first}")


def _stage(ctx: Any, record: CommitRecord, arrays: dict[int, np.ndarray], decls: dict[int, Any],
           states: Sequence[int] = ()) -> tuple[dict[int, Any], list[tuple[Any, list[Any]]]]:
    """Every rank's new arrays in private buffers or staged pages, from the old files, or their pieces verified to
    be read into them later (those pieces by old file: :func:`_load_later`); and the stored bytes of the Python
    states ``states`` (their sizes are the old files'). Collective."""
    t = ctx.transport
    n, m = record.nranks, t.size
    if record.level in (2, 3) and not record.fallback:  # 0. Lost old files come back first, on the
        # old layout's groups (a fallback's redundancy was the committed checkpoint's: never rebuilt).
        problem = ""
        try:  # the groups a sealed record lists may be malformed (a forgery): damage, an older checkpoint may do
            groups = old_groups(record, ctx.config.group_size)
            for j in range(t.rank, len(groups), m):
                problem = problem or rebuild_group(ctx.config, record, groups[j], lambda r: old_path(ctx, record, r))
        except Exception as exc:  # noqa: BLE001 - shared, as below
            problem = problem or _why(exc)
        _agree(t, problem, RecoveryError)
    # 1. The old files' variable tables, each old file parsed by one rank, shared.
    opened: dict[int, Any] = {}
    mine, problem = {}, ""
    for old in range(t.rank, n, m):
        try:
            opened[old] = open_old(old_path(ctx, record, old), record, old)
            mine[old] = table_of(opened[old])
        except Exception as exc:  # noqa: BLE001 - shared: a rank that raised alone would leave the others waiting
            problem = problem or _why(exc)
    _agree(t, problem, RecoveryError)
    tables: dict[int, dict[str, Any]] = {}
    for part in t.allgather(mine):
        tables.update({int(k): v for k, v in part.items()})
    # 2. The plan: which old file holds which piece of which variable.
    try:
        sizes = state_sizes(tables, n, m, t.rank, arrays, states)
        arrays = {**arrays, **{vid: np.empty(size, np.uint8) for vid, size in sizes.items()}}
        plan = reshard_plan.plan(tables, arrays, decls, t.rank, n, m)
        problem, kind = "", _Refused
    except Exception as exc:  # noqa: BLE001 - a malformed table too: every rank must hear of it
        plan, problem = {}, _why(exc)
        kind = RecoveryError if isinstance(exc, FormatError) else StatesRefused if isinstance(exc, StatesRefused) \
            else _Refused
    # A malformed record (FormatError) is damage, as a failed hash: an older checkpoint may be recovered. Only
    # declarations that do not fit refuse the recovery outright. Agreed, or the ranks would part ways.
    kinds = set(t.allgather(kind.__name__))  # damage first, then per-rank states (their own advice), else _Refused
    _agree(t, problem, next(k for k in (RecoveryError, StatesRefused, _Refused) if k.__name__ in kinds))
    # 3. Read and check the pieces into private buffers: for a fresh array (a restart's), pages to move under it
    # once every rank has all its data (no copy after the verification). An array in use (no pages to move) has its
    # pieces verified now and read into it once every rank agreed, as a recovery on the same layout does
    # (:func:`_load_later`): no buffer of its size beside it. A container two ranks need is hashed by one of them.
    def parsed_of() -> dict[int, Any]:
        return {old: opened.get(old) or open_old(old_path(ctx, record, old), record, old) for old in plan}

    return reshard_read.stage(t, plan, parsed_of, arrays, set(sizes))


#: A test seam: called after every rank verified and agreed, before the arrays in use are read (files changed there).
BEFORE_LOAD: Any = None


def _load_later(t: Any, record: CommitRecord, later: list[tuple[Any, list[Any]]], arrays: dict[int, Any]) -> None:
    """Read the verified pieces ``later`` into the arrays in use (collective: every rank raises the same error when
    one fails: the file changed since it was verified, a disk error; the arrays may then hold part of it)."""
    problem = ""
    try:
        if BEFORE_LOAD is not None:
            BEFORE_LOAD()
        for parsed, wanted in later:  # from the files verified, unchanged since (checked before and after each)
            read_pieces(parsed, wanted, arrays, verified=True)
    except Exception as exc:  # noqa: BLE001 - shared: a rank that raised alone would leave the others waiting
        problem = _why(exc)
    _agree(t, problem, RecoveryError, f"recovering checkpoint {record.ckpt_id} (level {record.level}) failed while "
           "loading, and the protected arrays in use may hold part of it: recover again")
