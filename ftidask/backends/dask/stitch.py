"""Recovery on a Dask cluster of a checkpoint written by the MPI (or single-process) backend.

Every variable must declare its place (:mod:`ftidask.model.decomposition`: ``global_shape``/``offset``,
or ``replicated``); a checkpoint of one rank needs no declaration (its arrays are whole). Each
variable comes back as one Dask array of the global shape whose chunks are the old ranks' blocks
(cut further where blocks do not form a grid), each chunk read by a task on a worker from the old
rank's file with the MPI reshard's reader (:func:`ftidask.engine.reshard_files.read_pieces`: only the containers that
hold the chunk, each checked against its hash before its bytes are used). Old files must be
visible to the workers: L4 (global directory), L1-L3 with ``local_test`` or shared node
directories; at L2/L3 lost files are first rebuilt on the old layout's groups
(:mod:`ftidask.engine.reshard_rebuild`), one task per group.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.array.core import Array

from ...api.context import Protected
from ...engine import pystate, reshard, reshard_files, reshard_plan
from ...engine.device import chunks_on_device, onto_devices
from ...engine.recoverplan import handed_back
from ...engine.recovery import check_writeable
from ...engine.reshard_rebuild import old_groups, rebuild_group
from ...engine.runstate import CommitRecord
from ...model.arrays import copy_items, dtype_from_json, dtype_to_json
from ...model.decomposition import Piece, Placement, overlap
from ...model.errors import FormatError, FTIError, NoCheckpointError, RecoveryError
from . import reads, tasks
from .cluster import send_now, wait_for
from .fallback import Placer
from .plan import VarSpec, compute_items, rechunk_items

if TYPE_CHECKING:
    from .context import DaskContext

log = logging.getLogger("ftidask")

HOW = ("The Dask backend stitches such a checkpoint into one Dask array per variable when every variable declares "
       "its place: ctx.protect(id, local, global_shape=..., offset=...) (or ftidask.Block(global_shape, offset)) "
       "or replicated=True in the run that writes it. Otherwise recover it with ftidask.init(comm=...) on its own "
       "number of ranks, or export it with `ftidask export --to-zarr` and read it with dask.array.from_zarr.")


class _Refused(FTIError):
    """The checkpoint's declarations do not allow one global array (an older checkpoint would not either)."""


# --- tasks (run on the workers) -------------------------------------------------------------------

def rebuild_task(cfg: Any, record_json: dict[str, Any], group: list[int], paths: dict[int, str]) -> str:
    """Rebuild an old L2/L3 group's lost files (:func:`ftidask.engine.reshard_rebuild.rebuild_group`); '' or why not."""
    record = CommitRecord.from_json(record_json)
    return rebuild_group(cfg, record, group, lambda r: Path(paths[r]))  # type: ignore[arg-type]


def table_task(path: str, record_json: dict[str, Any], rank: int) -> dict[str, Any]:
    """Old rank ``rank``'s variable table (the reshard planner's, plus names and Python-state kinds)."""
    record = CommitRecord.from_json(record_json)
    parsed = reshard_files.open_old(Path(path), record, rank)  # type: ignore[arg-type]
    return {"table": reshard_files.table_of(parsed),
            "names": {str(v): i.name for v, i in parsed.vars.items()},
            "pystate": {str(v): i.extra[pystate.EXTRA_KEY] for v, i in parsed.vars.items()
                        if pystate.EXTRA_KEY in i.extra}}


def read_task(path: str, record_json: dict[str, Any], rank: int, vid: int, piece: Piece, dtype: Any,
              worker: str) -> np.ndarray:
    """One chunk: the piece of old rank ``rank``'s block, read and hash-checked on this worker."""
    here = reads._here()
    if here is not None and here != worker and reads._alive(worker):
        # Moved by work stealing while the worker chosen for it lives: back there.
        from distributed import Reschedule

        raise Reschedule()
    record = CommitRecord.from_json(record_json)
    parsed = reshard_files.open_old(Path(path), record, rank)  # type: ignore[arg-type]
    out = {vid: np.empty(piece.shape, dtype_from_json(dtype))}  # dtype_to_json's: a structured one too
    reshard_files.read_pieces(parsed, [(vid, piece)], out)
    return out[vid]


# --- planning (on the client) -----------------------------------------------------------------------

def _grid(blocks: dict[int, tuple[Placement, tuple[int, ...], str]], shape: tuple[int, ...],
          itemsize: int, vid: int) -> tuple[tuple[tuple[int, ...], ...], dict[tuple[int, ...], tuple[int, Piece]]]:
    """The chunks of the global array (every block edge is a chunk edge, so that each chunk lies in one
    old block) and, per chunk index, the old rank and the piece of its block that holds it (none for
    an array without elements: one empty chunk)."""
    if not math.prod(shape):
        return tuple((g,) for g in shape), {}
    edges = [sorted({0, g, *(p.offset[d] for p, s, _o in blocks.values() if math.prod(s)),
                     *(p.offset[d] + s[d] for p, s, _o in blocks.values() if math.prod(s))})
             for d, g in enumerate(shape)]
    chunks = tuple(tuple(b - a for a, b in itertools.pairwise(e)) for e in edges)
    owner: dict[tuple[int, ...], tuple[int, Piece]] = {}
    for old, (place, bshape, order) in sorted(blocks.items()):
        if not math.prod(bshape):
            continue
        ranges = [range(bisect.bisect_left(e, o), bisect.bisect_left(e, o + n))
                  for e, o, n in zip(edges, place.offset, bshape)]
        for index in itertools.product(*ranges):
            offset = tuple(e[i] for e, i in zip(edges, index))
            cshape = tuple(e[i + 1] - e[i] for e, i in zip(edges, index))
            piece = overlap(place.offset, bshape, order, itemsize, offset, cshape)
            assert piece is not None and piece.shape == cshape  # the chunk lies inside the block
            owner[index] = (old, piece)
    for index in itertools.product(*(range(len(c)) for c in chunks)):
        if index not in owner:
            hole = tuple(e[i] for e, i in zip(edges, index))
            raise _Refused(f"variable {vid}: no old file holds element {hole} of the global array {shape}")
    return chunks, owner


def _variable(vid: int, tables: dict[int, dict[str, Any]], n: int) -> tuple[np.dtype, tuple[int, ...], Any]:
    """A variable's dtype, global shape and chunk plan ``(chunks, owner)``; :class:`_Refused` when the old ranks'
    records do not make one global array, RecoveryError (damage: the next older checkpoint is tried) when they cannot
    be right (:func:`ftidask.engine.reshard_plan.old_blocks`: malformed, overlapping, leaving a hole)."""
    entries = {old: tables[old]["table"].get(str(vid)) for old in range(n)}
    missing = [old for old, e in entries.items() if e is None]
    if missing:
        raise _Refused(f"variable {vid} is not in the checkpoint file(s) of old rank(s) {missing[:8]}")
    try:
        olds = reshard_plan.old_blocks(vid, entries)
    except FormatError as exc:
        raise RecoveryError(str(exc)) from None
    dtype = reshard_files.stored_dtype(entries[0]["dtype"])
    assert dtype is not None
    kinds = {p.kind for p, _s, _o in olds.values()}
    if n == 1 or kinds == {"replicated"}:  # one array, from one file (spread over the files)
        keep = vid % n
        _p, shape, order = olds[keep]
        return dtype, shape, _grid({keep: (Placement("block", shape, (0,) * len(shape)), shape, order)}, shape,
                                   dtype.itemsize, vid)
    if kinds != {"block"}:
        raise _Refused(f"variable {vid} declares no place in a global array")
    (shape,) = {p.global_shape for p, _s, _o in olds.values()}  # one (old_blocks)
    return dtype, shape, _grid(olds, shape, dtype.itemsize, vid)


# --- recovery -----------------------------------------------------------------------------------------

def _paths(ctx: DaskContext, record: CommitRecord) -> dict[int, str]:
    return {f.rank: str(reshard.old_path(ctx, record, f.rank)) for f in record.files}


def _wait(ctx: DaskContext, futures: list[Any], what: str, gather: bool = True) -> list[Any]:
    """The results of loose tasks (Dask reruns them elsewhere if their worker dies); the first task's
    error as a :class:`RecoveryError` (its own message: which file, which container)."""
    send_now(ctx.cluster.client)
    while not wait_for(futures, ctx.cluster.poll):
        if any(f.status == "error" for f in futures):
            break
        if not ctx.cluster.workers():
            ctx.cluster.cancel(futures)
            raise RecoveryError(f"{what}: the cluster has no workers") from None
    failed = [f for f in futures if f.status in ("error", "cancelled")]
    if failed:
        try:
            exc: Any = failed[0].exception(timeout=ctx.cluster.poll * 4)
        except Exception as err:  # noqa: BLE001 - released meanwhile: say that much
            exc = err
        ctx.cluster.cancel(futures)
        raise RecoveryError(f"{what}: {exc}")
    return ctx.cluster.client.gather(futures) if gather else []


def _run(ctx: DaskContext, calls: list[tuple[Any, tuple[Any, ...], str, str]], what: str) -> list[Any]:
    """Run ``(fn, args, key, worker)`` tasks; a failed one is a :class:`RecoveryError` saying why."""
    return _wait(ctx, [ctx.cluster.submit(fn, *args, key=key, worker=w, loose=True) for fn, args, key, w in calls],
                 what)


def _servers(ctx: DaskContext, paths: list[str]) -> dict[str, str]:
    """path -> the worker that reads it (the least loaded of those that see it)."""
    workers = ctx.cluster.workers()
    if not workers:
        raise RecoveryError("the cluster has no workers")
    placer = Placer(workers, ctx.cluster.run(tasks.sizes, paths), paths)
    out = {}
    for path in paths:
        worker = placer.pick(path)
        if worker is None:
            raise RecoveryError(f"{path}: missing, or not visible to any worker (L1-L3 files are visible with "
                                "local_test = 1 or node directories shared by the workers)")
        out[path] = worker
    return out


def _check_protected(ctx: DaskContext, shapes: dict[int, tuple[np.dtype, tuple[int, ...]]],
                     states: dict[int, str], wanted: list[int]) -> None:
    """Refuse before anything is read: each protected variable must match the global array it gets."""
    for vid, p in ctx.variables.items():
        if vid not in wanted:
            continue
        if vid not in shapes:
            raise _Refused(f"variable {vid} is protected but not in the checkpoint (it holds ids {sorted(shapes)})")
        if p.state is not None or vid in states:
            if p.state is None or states.get(vid) != p.state.kind:
                raise _Refused(f"variable {vid}: the checkpoint holds {states.get(vid) or 'an array'}, the "
                               f"protected variable is {p.state.kind if p.state else 'an array'}")
            continue
        dtype, shape = shapes[vid]
        if np.dtype(p.array.dtype) != dtype or tuple(p.array.shape) != shape:
            raise _Refused(f"variable {vid}: the checkpoint's global array is {dtype} {shape}, the protected array "
                           f"is {p.array.dtype} {tuple(p.array.shape)}")
        problem = check_writeable(vid, p.array)
        if problem:
            raise _Refused(problem)


def _recover_record(ctx: DaskContext, record: CommitRecord, chunks: Any, ids: list[int] | None) -> dict[int, Any]:
    from .restore import _target_chunks

    n = record.nranks
    rj = record.to_json()
    paths = _paths(ctx, record)
    token = f"{record.ckpt_id}-{record.seq}-{uuid.uuid4().hex[:8]}"
    workers = ctx.cluster.workers()
    if record.level in (2, 3) and not record.fallback:  # lost old files come back first, on the old layout's
        # groups (a fallback's redundancy was the committed checkpoint's: never rebuilt)
        calls = [(rebuild_task, (ctx.config, rj, g, {r: paths[r] for r in g}), f"ftidask-stitch-rebuild-{token}-{i}",
                  workers[i % len(workers)]) for i, g in enumerate(old_groups(record, ctx.config.group_size))]
        problem = next((p for p in _run(ctx, calls, f"rebuilding checkpoint {record.ckpt_id}") if p), "")
        if problem:
            raise RecoveryError(problem)
    server = _servers(ctx, [paths[r] for r in range(n)])
    calls = [(table_task, (paths[r], rj, r), f"ftidask-stitch-table-{token}-{r}", server[paths[r]])
             for r in range(n)]
    tables = dict(enumerate(_run(ctx, calls, f"reading the variable tables of checkpoint {record.ckpt_id}")))
    stored = sorted({int(v) for t in tables.values() for v in t["table"]})
    if ids is not None:
        missing = sorted(set(ids) - set(stored))
        if missing:
            raise _Refused(f"variables {missing} are not in checkpoint {record.ckpt_id} (it holds ids {stored})")
    wanted = stored if ids is None else [v for v in stored if v in ids]
    states = {int(v): k for t in tables.values() for v, k in t["pystate"].items()}
    if n > 1 and any(v in states for v in wanted):
        raise _Refused(f"variable(s) {sorted(v for v in wanted if v in states)} are Python states, which each rank "
                       "holds for itself; recover the arrays with recover(ids=[...])")
    undeclared = [v for v in wanted if n > 1 and any(
        not {"global_shape", "offset", "replicated"} & set(e["extra"])
        for e in (tables[old]["table"].get(str(v)) for old in range(n)) if e is not None)]
    if undeclared:
        raise _Refused(f"variable(s) {undeclared} declare no place in a global array")
    plans = {vid: _variable(vid, tables, n) for vid in wanted}
    _check_protected(ctx, {v: (d, s) for v, (d, s, _p) in plans.items()}, states, wanted)
    # Every chunk read and hash-checked on a worker before anything is handed back or filled.
    arrays: dict[int, Array] = {}
    futures = []
    for vid, (dtype, shape, (grid, owner)) in plans.items():
        name = f"ftidask-stitch-read-{vid}-{token}"
        graph = {}
        for index, (old, piece) in owner.items():
            path = paths[old]
            graph[(name, *index)] = ctx.cluster.submit(read_task, path, rj, old, vid, piece, dtype_to_json(dtype),
                                                       server[path], key=(name, *index), worker=server[path],
                                                       loose=True)
        futures.extend(graph.values())
        if not owner:  # no elements, no bytes to read
            graph[(name, *(0,) * len(shape))] = np.empty(shape, dtype)
        arrays[vid] = Array(graph, name, grid, dtype=dtype)
    _wait(ctx, futures, f"reading checkpoint {record.ckpt_id}", gather=False)
    values = {}
    for vid in plans:  # NumPy variables and Python states: computed before anything is filled
        held = ctx.variables.get(vid)
        if vid in states or (held is not None and isinstance(held.array, np.ndarray)):
            try:
                values[vid] = np.ascontiguousarray(compute_items(arrays[vid]))
            except Exception as exc:  # noqa: BLE001 - a chunk lost meanwhile: nothing is filled yet
                raise RecoveryError(f"reading checkpoint {record.ckpt_id}: {exc}") from None
    decoded = {vid: (ctx.variables[vid].state.decode(values[vid], f"variable {vid}")  # type: ignore[union-attr]
                     if vid in ctx.variables else pystate.loads(values[vid], f"variable {vid}")) for vid in states
               if vid in plans}
    names = tables[0]["names"]
    out: dict[int, Any] = {}
    for vid, (dtype, shape, (grid, _owner)) in plans.items():
        held = ctx.variables.get(vid)
        if vid in decoded:
            if held is not None and held.state is not None:
                held.state.apply(decoded[vid])
                held.array = values[vid]
                out[vid] = held.state.obj
            else:
                out[vid] = decoded[vid]
        elif vid in values:
            copy_items(held.array, values[vid])  # type: ignore[union-attr]
            out[vid] = handed_back(vid, held, record.ckpt_id)  # a CuPy array protected as such: its mirror was filled
        else:
            spec = VarSpec(vid, names.get(str(vid), f"var{vid}"), dtype, shape, grid)
            target = _target_chunks(ctx, spec, chunks)
            arr = arrays[vid] if target == grid else rechunk_items(arrays[vid], target)
            out[vid] = arr = onto_devices(arr) if chunks_on_device(getattr(held, "array", None), False) else arr
            ctx.variables[vid] = Protected(vid, held.name if held is not None else spec.name, arr,
                                           held.compressor if held is not None else None)
    return out


def recover(ctx: DaskContext, records: list[CommitRecord], chunks: Any, ids: list[int] | None) -> dict[int, Any]:
    """The newest of ``records`` (written by the MPI or single-process backend) as global arrays.

    A checkpoint whose declarations do not make global arrays is refused at once (an older one would
    not either); one whose files are lost or damaged is skipped for the next older one.
    """
    reasons = []
    for record in records:
        try:
            out = _recover_record(ctx, record, chunks, ids)
        except _Refused as exc:
            raise RecoveryError(f"checkpoint {record.ckpt_id} (level {record.level}) of run {ctx.exec_id} was "
                                f"written by the MPI or single-process backend ({record.nranks} rank(s)): {exc}. "
                                + HOW) from None
        except RecoveryError as exc:
            if "no workers" in str(exc):
                raise
            reasons.append(f"checkpoint {record.ckpt_id} (level {record.level}): {exc}")
            log.warning("cannot recover checkpoint %d (level %d): %s", record.ckpt_id, record.level, exc)
            continue
        if ctx.config.enable_dcp:  # a fallback's spares are left alone by the next checkpoint of its level
            ctx.spares.recovered(record)
        ctx.progress.restored(record.ckpt_id, record.level, None)
        log.info("recovered checkpoint %d (level %d), written by %d MPI rank(s), as global arrays on %d workers",
                 record.ckpt_id, record.level, record.nranks, len(ctx.cluster.workers()))
        return out
    raise NoCheckpointError(f"no checkpoint of run {ctx.exec_id} (written by the MPI or single-process backend) can "
                            "be recovered on the Dask cluster:" + "".join(f"\n  - {r}" for r in reasons)
                            + "\nOld files must be visible to the workers (L4, or every node directory with "
                              "local_test = 1 or shared directories; lost L2/L3 files are rebuilt first).")
