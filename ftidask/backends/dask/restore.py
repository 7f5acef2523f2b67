"""Recovery on a Dask cluster: find the newest checkpoint whose files verify (rebuilding what
lost workers held from L2 copies or L3 parity), then read each chunk on the worker that sees
its file. Works on a cluster of any size: ranks of the checkpoint are mapped onto live workers.

Each byte is read once when nothing is damaged: the search checks each file's metadata (its own
hashes, the file block's hash against the commit record, every chunk where the record places it),
and the read of each chunk checks its container's hash. A chunk that fails its check makes the
recovery check that checkpoint's files in full, as a damaged file is found (then rebuilt, or the
checkpoint passed over), before any array is filled or rebound.

Each compressed container is decoded once, by the read that puts it into its chunk: a check that
must hash every byte first (a rebuild reads the group's files) does not decode them. A container that
does not decode fails its read like a damaged one, and only the full check that follows decodes
every container, to find it.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.array.core import Array, normalize_chunks

from ...api.context import Protected
from ...engine import pystate
from ...engine.device import chunks_on_device, onto_devices
from ...engine.recovering import newest_recoverable
from ...engine.recoverplan import handed_back, normalize_request
from ...engine.recovery import check_writeable
from ...engine.runstate import CommitRecord
from ...model.arrays import copy_items
from ...model.errors import FTIError, RecoveryError
from ...storage import files as storage
from . import reads, recorded, stitch
from .cluster import TaskFailed, WorkerLost
from .plan import VarSpec, compute_items, rechunk_items
from .restore_files import Unreadable, record_topology, restore_files

if TYPE_CHECKING:
    from .context import DaskContext

log = logging.getLogger("ftidask")


def dask_records(ctx: DaskContext, ckpt_id: int | None, level: int | None) -> list[CommitRecord]:
    """The Dask checkpoints to recover, newest first: the committed ones and the previous differential
    checkpoints kept as spares (see :mod:`.fallback`)."""
    return [r for r in ctx.recovery.all_candidates(ckpt_id, level) if r.extra.get("backend") == "dask"]


def _target_chunks(ctx: DaskContext, spec: VarSpec, chunks: Any) -> Any:
    """The chunks asked for ``spec``'s array (argument first, then a protected Dask array's)."""
    if isinstance(chunks, dict):
        chunks = chunks.get(spec.id)
    if chunks is None:
        held = ctx.variables.get(spec.id)
        if held is not None and hasattr(held.array, "chunks") and tuple(held.array.shape) == spec.shape:
            chunks = held.array.chunks
    if chunks is None:
        return spec.chunks
    try:
        target = normalize_chunks(chunks, spec.shape, dtype=spec.dtype)
    except (ValueError, TypeError, ArithmeticError) as exc:  # chunks of 0: dask divides by them
        raise RecoveryError(f"variable {spec.id}: chunks {chunks!r} do not fit its shape {spec.shape}: "
                            f"{exc}") from None
    if any(size != size for dim in target for size in dim):  # nan: unknown sizes, which a recovery knows
        raise RecoveryError(f"variable {spec.id}: chunks {chunks!r} have unknown (nan) sizes; give them in full")
    return target


def _check_protected(ctx: DaskContext, specs: list[VarSpec], ids: list[int] | None = None) -> None:
    """Refuse before anything is read or rebound: every protected variable (of ``ids``) must be in
    the checkpoint with its dtype and shape (or Python-state kind), and a NumPy one must be writeable."""
    stored = {s.id: s for s in specs}
    for vid, p in ctx.variables.items():
        if ids is not None and vid not in ids:
            continue
        spec = stored.get(vid)
        if spec is None:
            raise RecoveryError(f"variable {vid} is protected but not in the checkpoint (it holds ids "
                                f"{sorted(stored)})")
        if p.state is not None or spec.pystate:
            if p.state is None or spec.pystate != p.state.kind:
                raise RecoveryError(f"variable {vid}: the checkpoint holds {spec.pystate or 'an array'}, the "
                                    f"protected variable is {p.state.kind if p.state else 'an array'}; protect "
                                    "what was protected when it was written")
            continue
        if np.dtype(p.array.dtype) != spec.dtype or tuple(p.array.shape) != spec.shape:
            raise RecoveryError(f"variable {vid}: checkpoint holds {spec.dtype} {spec.shape}, the protected array "
                                f"is {p.array.dtype} {tuple(p.array.shape)}")
        problem = check_writeable(vid, p.array)
        if problem:
            raise RecoveryError(problem)


def file_sources(ctx: DaskContext, record: CommitRecord, hosts: dict[int, tuple[str, str]]) -> dict[int, dict]:
    """rank -> what a read task needs to find that rank's file again on any worker
    (see :func:`ftidask.backends.dask.reads.read_recovered_chunk`): the file, and its L2 copy or L3 group."""
    n, level, cid, seq = record.nranks, record.level, record.ckpt_id, record.seq
    topo = record_topology(record)
    sizes = {f.rank: f.size for f in record.files}
    out = {}
    for f in record.files:
        r = f.rank
        worker, path = hosts[r]
        src: dict[str, Any] = {"ckpt_id": cid, "level": level, "rank": r, "path": path, "fb_hash": f.fb_hash,
                               "worker": worker}
        if level == 2 and n > 1:
            holder = topo.right_partner(r)
            src["copies"] = [ctx.node_file(2, cid, seq, holder, storage.partner_file(cid, holder))]
        elif level == 3 and n > 1:
            group = topo.group_ranks(r)
            src["group"] = {"position": group.index(r), "sizes": [sizes[g] for g in group],
                            "data": [ctx.node_file(3, cid, seq, g, storage.rank_file(cid, g)) for g in group],
                            "parity": [ctx.node_file(3, cid, seq, g, storage.parity_file(cid, g)) for g in group]}
        out[r] = src
    return out


class Refused(RecoveryError):
    """A request refused for a checkpoint whose files' metadata verified, their data not read yet."""


def _requested(ctx: DaskContext, record: CommitRecord, chunks: Any, ids: list[int] | None) -> tuple[list, Any]:
    """The specs to recover from ``record``, the request checked against it (ids, chunks, protected arrays)."""
    lay = recorded.layout(record)
    specs = lay.specs
    if ids is not None:
        missing = sorted(set(ids) - {s.id for s in specs})
        if missing:
            raise RecoveryError(f"variables {missing} are not in checkpoint {record.ckpt_id} (it holds ids "
                                f"{sorted(s.id for s in specs)}); nothing was recovered")
        specs = [s for s in specs if s.id in ids]
    unknown = sorted(set(chunks) - {s.id for s in lay.specs}, key=str) if isinstance(chunks, dict) else []
    if unknown:  # a mistyped id: never ignored
        raise RecoveryError(f"recover(chunks=...) names variables {unknown} "
                            f"that checkpoint {record.ckpt_id} does not hold (it holds ids "
                            f"{sorted(s.id for s in lay.specs)}); nothing was recovered")
    _check_protected(ctx, specs, ids)
    return specs, lay


def build_arrays(ctx: DaskContext, record: CommitRecord, hosts: dict[int, tuple[str, str]],
                 chunks: Any = None, ids: list[int] | None = None) -> dict[int, Any]:
    """Dask arrays whose chunks are read (and hash-checked) on the workers that serve the files.

    The reads are placed loosely: if a serving worker dies later, Dask reads its chunks again on
    another worker, from the file, its copy or its rebuilt version (:mod:`ftidask.backends.dask.reads`).
    Only variables ``ids`` if given: the others are neither read nor touched.
    """
    try:
        specs, lay = _requested(ctx, record, chunks, ids)
    except RecoveryError as exc:  # about this checkpoint, whose data is not read yet
        raise Refused(str(exc)) from None
    # What each variable becomes, decided before anything is read, filled or rebound: a NumPy
    # array filled in place (target None), or a new Dask array with these chunks.
    plans = []
    for spec in specs:
        held = ctx.variables.get(spec.id)
        # A variable checkpointed as a NumPy array and protected now as a Dask array is rebound to a Dask array
        # of the held one's chunks (filling nothing, it kept the stale array, which the next checkpoint wrote)
        in_place = spec.pystate or (isinstance(held.array, np.ndarray) if held is not None else spec.kind == "numpy")
        plans.append((spec, held, None if in_place else _target_chunks(ctx, spec, chunks)))
    sources = file_sources(ctx, record, hosts)
    token = uuid.uuid4().hex
    arrays: dict[int, Array] = {}
    futures = []
    calls: dict[str, dict[Any, tuple[Any, tuple[Any, ...]]]] = {}  # worker -> the reads placed there, by key
    for spec in specs:
        name = f"ftidask-read-{spec.id}-{token}"
        for at in lay.chunks[spec.id]:  # every chunk of the grid (checked by recorded.layout)
            src = sources[at.rank]
            calls.setdefault(src["worker"], {})[(name, *at.index)] = (reads.read_recovered_chunk, (
                src, spec.id, at.dptr, lay.raw_dtypes[spec.id], list(spec.chunk_shape(at.index))))
    placed: dict[Any, Any] = {}
    for worker, group in calls.items():  # one message per worker, not one per chunk
        placed.update(ctx.cluster.submit_group(group, worker, loose=True))
    for spec in specs:
        name = f"ftidask-read-{spec.id}-{token}"
        graph = {(name, *at.index): placed[(name, *at.index)] for at in lay.chunks[spec.id]}
        futures.extend(graph.values())
        ctx._dask_retention.pins.add(record, graph)  # retention keeps the files while the array may read them
        arrays[spec.id] = Array(graph, name, spec.chunks, dtype=spec.dtype)
    # Every chunk is read and verified before anything is handed back (a read whose worker dies
    # meanwhile is done again elsewhere: no worker to watch).
    ctx.cluster.wait_all(futures, (), f"reading checkpoint {record.ckpt_id}", gather=False)
    # Every NumPy value is computed before the first array is filled (a worker lost meanwhile fails
    # the recovery with every array as it was).
    values = {spec.id: compute_items(arrays[spec.id]) for spec, _held, target in plans if target is None}
    # Python states decoded (and checked) before anything is filled, too.
    states = {spec.id: (held.state.decode(values[spec.id], f"variable {spec.id}") if held is not None
                        and held.state is not None else pystate.loads(values[spec.id], f"variable {spec.id}"))
              for spec, held, _t in plans if spec.pystate}
    built = {}  # every Dask array made (rechunked, onto the devices) before the first variable is filled or rebound
    for spec, held, target in plans:
        if not spec.pystate and target is not None:
            arr = arrays[spec.id]
            try:
                if target != spec.chunks:
                    arr = rechunk_items(arr, target)
                if chunks_on_device(getattr(held, "array", None), spec.device):
                    arr = onto_devices(arr)
            except (ValueError, TypeError, ImportError) as exc:  # CuPy missing, chunks dask cannot take
                raise RecoveryError(f"variable {spec.id} cannot be rebuilt as chunked here: {exc} "
                                    "(no variable was changed)") from exc
            built[spec.id] = arr
    out: dict[int, Any] = {}
    for spec, held, target in plans:
        if spec.pystate:
            if held is not None and held.state is not None:
                held.state.apply(states[spec.id])
                held.array = values.pop(spec.id)
                out[spec.id] = held.state.obj
            else:  # stored but not protected now: its value
                out[spec.id] = states[spec.id]
            continue
        if target is None:
            value = values.pop(spec.id)
            if held is not None and isinstance(held.array, np.ndarray):
                copy_items(held.array, value)
                value = handed_back(spec.id, held, record.ckpt_id)  # a CuPy array: its mirror was filled
            out[spec.id] = value
            continue
        arr = out[spec.id] = built[spec.id]
        # its compressor stays: the next checkpoint writes it as the one recovered was written
        ctx.variables[spec.id] = Protected(spec.id, held.name if held is not None else spec.name, arr,
                                           held.compressor if held is not None else None)
    return out


def _restore_retrying(ctx: DaskContext, record: CommitRecord, data: bool,
                      attempts: int = 3) -> dict[int, tuple[str, str]]:
    """:func:`restore_files`, tried again when a worker leaves meanwhile (a loss the scheduler had not
    noticed yet when the tasks were placed)."""
    for _attempt in range(attempts - 1):
        try:
            with ctx.cluster.batch():
                return restore_files(ctx, record, data)
        except WorkerLost:
            log.info("a worker left while checkpoint %d was being checked; trying again", record.ckpt_id)
    with ctx.cluster.batch():
        return restore_files(ctx, record, data)


def recover(ctx: DaskContext, ckpt_id: int | None, level: int | None, chunks: Any,
            ids: Any = None) -> dict[int, Any]:
    """The newest recoverable checkpoint's arrays (see :meth:`DaskContext.recover`)."""
    ckpt_id, level, wanted = normalize_request(ckpt_id, level, ids)  # "2" would name no checkpoint
    records = dask_records(ctx, ckpt_id, level)
    if not records:  # written by the MPI or single-process backend: stitched into global arrays if declared
        other = ctx.recovery.all_candidates(ckpt_id, level)  # their fallbacks too (read from their spares)
        if other:
            return stitch.recover(ctx, other, chunks, wanted)

    def verifier(data: bool) -> Any:
        def verify(record: CommitRecord) -> tuple[dict[int, tuple[str, str]] | None, str]:
            try:
                return _restore_retrying(ctx, record, data), ""
            except Unreadable:
                raise
            except RecoveryError as exc:
                if "no workers" in str(exc):  # no checkpoint can be read on an empty cluster
                    raise
                why = str(exc)
            except FTIError as exc:  # lost or damaged files, a worker lost or a task failed while checking
                why = str(exc)
            if ctx.config.enable_dcp:
                ctx.spares.sound.discard(record.seq)  # passed over: its files never replace the spares
                if record.fallback:  # nor are the spares patched as if they were whole
                    ctx.spares.distrust(record.level)
            return None, why
        return verify

    # The engine's search, as for every backend: the newest checkpoint whose files verify or are rebuilt.
    # Each byte is read once: the search checks the files' metadata, the reads every chunk's hash. A chunk
    # that does not verify (damaged data) sends the search back to that checkpoint with every file's data
    # checked, which finds the damaged files, rebuilds them from L2/L3 or passes over to an older one.
    record, hosts = newest_recoverable(records, verifier(False), ctx.paths, ckpt_id, level,
                                       "no checkpoint can be recovered")
    try:
        out = build_arrays(ctx, record, hosts, chunks, wanted)
    except (TaskFailed, Refused) as exc:  # nothing was filled or rebound
        # A refusal (the protected arrays' shapes...) is about a checkpoint whose data is not read yet: if that data
        # is damaged, the recovery is of an older one, whose shapes the application may have protected; refused
        # for a damaged newest one, it could never recover. So its files are checked in full first.
        log.warning("checkpoint %d (level %d): %s; checking every file of it in full", record.ckpt_id, record.level,
                    exc)
        later = records[next(i for i, r in enumerate(records) if r is record):]
        checked, hosts = newest_recoverable(later, verifier(True), ctx.paths, ckpt_id, level,
                                            "no checkpoint can be recovered")
        if isinstance(exc, Refused) and checked is record:
            raise
        record = checked
        out = build_arrays(ctx, record, hosts, chunks, wanted)
    if ctx.config.enable_dcp:  # a fallback's spares are left alone by the next checkpoint of its level
        ctx.spares.recovered(record)
    ctx.progress.restored(record.ckpt_id, record.level, None)  # Dask files have no layout to reuse
    log.info("recovered checkpoint %d from level %d on %d workers%s", record.ckpt_id, record.level,
             len(ctx.cluster.workers()),
             " (the previous differential checkpoint, kept as the spares)" if record.fallback else "")
    return out


def stored_size(ctx: DaskContext, vid: int) -> int:
    """Bytes of variable ``vid`` in the newest committed checkpoint; 0 when none holds it (FTI_GetStoredSize)."""
    records = dask_records(ctx, None, None)
    if not records:
        other = ctx.recovery.candidates(None, None)
        if other:  # an MPI checkpoint's sizes are per old rank; recover() returns its global arrays
            raise RecoveryError(f"checkpoint {other[0].ckpt_id} was written by the MPI or single-process backend "
                                f"({other[0].nranks} rank(s)): its stored sizes are per old rank; recover() returns "
                                "its variables as global arrays (their .nbytes)")
        return 0  # nothing committed: FTI's "no size stored"
    damaged = []
    for record in records:  # newest first; one whose record is damaged would not be recovered either
        try:
            specs = recorded.layout(record).specs
        except recorded.DamagedRecord as exc:
            damaged.append(str(exc))
            continue
        for spec in specs:
            if spec.id == vid:
                return math.prod(spec.shape) * spec.dtype.itemsize
        return 0  # not in the checkpoint: FTI's "no size stored"
    raise RecoveryError(f"no committed checkpoint has a sound commit record: {'; '.join(damaged[:2])}")
