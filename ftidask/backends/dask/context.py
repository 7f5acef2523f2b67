"""The Dask backend: protected Dask arrays checkpointed by the workers that hold their chunks.

Each live worker is an FTI rank (its position in the sorted worker addresses at checkpoint
time) and an FTI node: it writes ``{ckpt_dir}/node{rank}/{exec_id}/l{level}/ckpt{id}.s{seq}/
Ckpt{id}-Rank{rank}.fti`` from the chunks it holds (see :mod:`ftidask.backends.dask.plan`). Every level
runs as Dask tasks pinned to the workers that hold the chunks or the files; no chunk passes
through the client or the scheduler. The client writes the commit record, last (how a checkpoint is
written: :mod:`ftidask.backends.dask.writing`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client

from ...api.callguard import one_at_a_time
from ...api.context import Context, Protected
from ...engine.device import is_device_array
from ...engine.inflight import CheckpointHandle
from ...engine.recoverplan import var_id_of
from ...engine.retention import in_l4
from ...engine.runstate import CommitRecord, SeqReservation
from ...engine.variables import check_name, compressor_config, encode_states
from ...model.arrays import check_bool, check_ckpt_id, check_described, check_id
from ...model.config import Config
from ...model.errors import (
    CheckpointError,
    ConfigError,
    FTIError,
    ProtectError,
    RecoveryError,
    UnkeepableCheckpoint,
    says_disk_failure,
)
from ...storage import dirchecks
from ...storage import files as storage
from . import (
    channel,
    codecthreads,
    icp,
    lineage,
    modes,
    recorded,
    report,
    restore,
    tasks,
)
from .cluster import Cluster, check_client
from .dcp_levels import DaskSpares
from .report import DaskCheckpointInfo
from .retention import DaskRetention
from .transport import DaskTransport, is_dask_array, is_dask_collection
from .writing import DaskWriting


class DaskContext(DaskWriting, Context):
    """A :class:`Context` whose ranks are the workers of a ``distributed`` cluster."""

    def __init__(self, config: Config, client: Client) -> None:
        cluster = Cluster(client, config.progress, verbosity=config.verbosity)
        self._cutting = threading.RLock()  # held while a lineage cut swaps the arrays (see lineage.cut)
        self._cut_from: dict[int, tuple[str, str]] = {}  # var id -> (name of the array cut, name of its cut)
        modes.register(client, cluster, config.permissions)  # the workers' files' modes (also those joining later)
        channel.register(client)  # L2/L3 blocks go worker to worker (every worker, also those joining later)
        codecthreads.register(client)  # compressed frames on the worker's share of the cores, not 8 threads
        lineage.watch(client)  # chunks read back after a worker loss are logged here
        # Init collects garbage on the workers: the Retention it makes is given the cluster.
        super().__init__(config, DaskTransport(cluster), retention=functools.partial(DaskRetention, cluster))
        self.client = client
        self.cluster = cluster
        self._keep_state_bytes = False  # finalize_icp: the Python states' bytes as init_icp took them
        # Never a number of an earlier client of the run: its tasks may still run on the workers (SeqReservation).
        self._seqs = SeqReservation(self.state)
        if config.enable_dcp:
            self._dcp = DaskSpares(self)
        self._check_node_dirs()

    def _check_node_dirs(self) -> None:
        """Init checks node 0's directories (the client's rank); each worker's node directories are checked here, on
        the workers, which see their own disks: one another user could write to is refused as on MPI."""
        dirs = [str(d) for r in range(len(self.cluster.workers()))
                for d in dirchecks.run_dirs(self.paths, r, self.state.records_dir)]
        problems = sorted({p for mine in self.client.run(_unsafe_dirs, dirs).values() for p in mine})
        if problems:
            self._close()  # the run lock released: nothing was written
            raise ConfigError(dirchecks.explain(problems))

    def _check_open(self) -> None:
        super()._check_open()
        check_client(self.client)

    @one_at_a_time
    def finalize(self) -> None:
        """FTI_Finalize, as :meth:`Context.finalize`; with a closed client, the run is left for a restart."""
        if not self._closed and str(self.client.status) in ("closing", "closed"):
            try:
                check_client(self.client)
            except FTIError as exc:  # the lock released, nothing removed: the checkpoints stay recoverable
                self._unfinished = exc
                self._close()
                raise
        with self._calls.nested("finalize"):
            super().finalize()

    def _stored_names(self) -> dict[int, str]:  # var_id: the names in the commit records
        return {} if self._status == 0 else recorded.names(restore.dask_records(self, None, None))

    # --- protection ------------------------------------------------------------------------------

    @one_at_a_time
    def protect(self, id: int, array: Any, name: str | None = None, compressor: Any = None) -> None:
        """Register a Dask array (of NumPy or CuPy chunks; or a NumPy array) under ``id``.

        Dask arrays are immutable: protect the new array after each step (or use the one
        :attr:`protected` holds after a checkpoint, which is persisted on the cluster).
        ``compressor`` (else ``[advanced] compressor``): each chunk's container is compressed by the
        worker that writes it, as the engine compresses a container (full checkpoints, levels 1-4).
        """
        if not is_dask_array(array):
            # a bag, a delayed value, a dataframe: no fixed-size chunks to write (an xarray object: said below)
            if is_dask_collection(array) and type(array).__module__.startswith("dask"):
                raise ProtectError(f"protect takes Dask arrays (dask.array.Array), got {type(array).__name__}; "
                                   "make it one (e.g. dask.array.from_delayed) or protect a NumPy array")
            with self._calls.nested("protect"):
                super().protect(id, array, name, compressor)
            return
        self._check_open()
        vid = check_id(id, "variable id")
        check_name(name, vid, self._vars, self._names.owner(name))
        if np.dtype(array.dtype).hasobject:
            raise ProtectError(f"dtype {array.dtype} holds Python objects, which have no fixed bytes")
        check_described(np.dtype(array.dtype))  # recorded as another dtype (bfloat16 as |V2): never recovered as is
        meta = getattr(array, "_meta", None)  # CuPy chunks are written from their bytes copied to the host
        if not is_device_array(meta) and (isinstance(meta, np.ma.MaskedArray) or not isinstance(meta, np.ndarray)):
            raise ProtectError(f"the array's chunks are {type(meta).__name__}s, not plain NumPy (or CuPy) arrays "
                               "(a masked array's mask is not checkpointed): protect a NumPy-backed array")
        if any(np.isnan(c) for dim in array.chunks for c in dim):
            raise ProtectError("the array has unknown chunk sizes; call .compute_chunk_sizes() first")
        old = self._vars.get(vid)
        name = name if name is not None else self._names.name_of(vid)
        self._names.check_default(vid, name, self._vars)
        self._vars[vid] = Protected(vid, str(name if name is not None else old.name if old else f"var{vid}"), array,
                                    compressor_config(compressor, old))

    @property
    def protected(self) -> Mapping[int, Any]:
        """As :attr:`Context.protected`; never an array a lineage cut is swapping (an asynchronous checkpoint's
        thread cuts while the application goes on): the one before, or the one persisted."""
        with self._cutting:
            return super().protected

    # --- checkpoint ------------------------------------------------------------------------------

    @one_at_a_time
    def checkpoint(self, id: int, level: int, *, dcp: bool = False,
                   wait: bool | None = None) -> DaskCheckpointInfo | CheckpointHandle:
        """Write checkpoint ``id`` at ``level``: each worker writes the chunks it holds, then the level's
        redundancy runs as tasks; committed only when every worker's part succeeded.

        ``wait=False`` (or ``async_ckpt = 1``): return a handle once the chunks are referenced (they are
        immutable: no snapshot is needed); the tasks run while the client goes on."""
        self._check_open()
        ckpt_id = check_ckpt_id(id)
        parsed = self._check_level(level, dcp)
        asynchronous = self._asynchronous(wait)
        if asynchronous:
            self._async.inflight.make_room()
        else:
            self._async.settle()
        # Python states: their bytes now
        error = "" if self._keep_state_bytes else encode_states(self._vars, self.transport.rank)
        if error:
            raise CheckpointError(f"checkpoint {ckpt_id} failed; the previous checkpoint is kept: {error}")
        start = time.perf_counter()
        # The chunks' futures keep them alive on the workers until the checkpoint is written.
        specs, futures = self._chunk_futures(copy=asynchronous)
        held = {vid: p.array for vid, p in self._vars.items()}  # the arrays whose lineage the commit cuts
        # Taken now, as the arrays are: a protect() while an asynchronous checkpoint runs is for the next one.
        # Differential files are never compressed (a compressed container cannot be patched in place).
        codecs = {} if parsed.differential else {vid: c for vid, (_codec, c) in self._writer.codecs().items()}
        write = functools.partial(self._closed_said, ckpt_id, functools.partial(
            self._write_checkpoint, ckpt_id, parsed, specs, futures, start, held, codecs))
        if not asynchronous:
            return write()
        self._async.next_id = max(self._async.next_id, ckpt_id + 1)
        return self._async.inflight.submit(write, ckpt_id, parsed.number, "immutable")

    def _closed_said(self, ckpt_id: int, write: Callable[[], DaskCheckpointInfo]) -> DaskCheckpointInfo:
        """``write()``; a client closed meanwhile (a notebook's cluster closed while an asynchronous checkpoint ran)
        said as such, not as distributed's AttributeError or CommClosedError from deep inside."""
        try:
            return write()
        except Exception as exc:  # (an FTIError too: chunks "held by no live worker" as the scheduler closed)
            try:
                check_client(self.client)
            except FTIError as closed:
                raise CheckpointError(f"checkpoint {ckpt_id} failed; the previous checkpoint is kept: "
                                      f"{closed}") from exc
            raise

    def node_file(self, level: int, ckpt_id: int, seq: int, rank: int, name: str) -> str:
        """Internal: the path of file ``name`` of a checkpoint in rank (node) ``rank``'s level directory."""
        return str(self.paths.level_dir(level, rank) / storage.ckpt_dirname(ckpt_id, seq) / name)

    def rank_meta(self, ckpt_id: int, level: int, seq: int, rank: int, workers: list[str]) -> dict[str, Any]:
        """Internal: the metadata a worker's rank file records (full and differential checkpoints alike)."""
        return {"format": "ftidask", "exec_id": self.exec_id, "ckpt_id": ckpt_id, "level": level, "seq": seq,
                "rank": rank, "nranks": len(workers), "node": rank, "backend": "dask", "worker": workers[rank],
                "time": time.time()}

    # --- incremental checkpoints (see ftidask.backends.dask.icp) ---------------------------------------------

    @one_at_a_time
    def init_icp(self, id: int, level: int, activate: bool = True) -> None:
        """FTI_InitICP: open checkpoint ``id`` for :meth:`add_var_icp`; ``activate`` false: the next do nothing."""
        self._async.settle()
        icp.init_icp(self, id, level, activate)

    @one_at_a_time
    def add_var_icp(self, var_id: int) -> None:
        """FTI_AddVarICP: pin protected variable ``var_id`` as it is now (persisted on the workers)."""
        icp.add_var_icp(self, var_id)

    @one_at_a_time
    def finalize_icp(self) -> DaskCheckpointInfo | None:
        """FTI_FinalizeICP: the workers write every pinned array; refused if a variable is missing (None if
        not activated)."""
        return icp.finalize_icp(self)  # type: ignore[no-any-return]

    def _abort_icp(self, why: str = "") -> None:
        self._icp_slot.take()  # one client: nobody else to tell

    # --- cleanup -----------------------------------------------------------------------------------

    @property
    def spares(self) -> DaskSpares:
        """Internal: the spare files of differential checkpoints (``enable_dcp = 1`` only)."""
        assert isinstance(self._dcp, DaskSpares)
        return self._dcp

    @property
    def _dask_retention(self) -> DaskRetention:
        """The Retention made at init (a :class:`DaskRetention`: removals are tasks on the workers)."""
        assert isinstance(self._retention, DaskRetention)
        return self._retention

    def _close(self) -> None:
        # Workers delete retired checkpoints in the background: wait for them, so that a finished
        # run leaves no trash behind (what a killed worker left is collected at the next start).
        with contextlib.suppress(Exception):  # a cluster already gone has nothing left to wait for
            self.cluster.run(tasks.wait_removals)
        super()._close()

    def _flush_to_l4(self, record: CommitRecord) -> None:
        """keep_last_ckpt: copy the last checkpoint's files (rebuilt if needed) to the global directory; a committed
        L4 checkpoint's files are only verified where they are."""
        try:  # its files checked (rebuilt where lost) first: only their damage passes over it, not the flush's
            with self.cluster.batch():
                hosts = restore.restore_files(self, record)
        except FTIError as exc:  # damaged or lost files: finalize tries the next older one (not for a disk that
            kind = CheckpointError if says_disk_failure(str(exc)) else UnkeepableCheckpoint  # cannot take the rebuild)
            raise kind(f"keep_last_ckpt: checkpoint {record.ckpt_id} (level {record.level}) cannot be kept: {exc}") \
                from exc
        if in_l4(record):
            return
        seq = self._seqs.take()
        try:
            with self.cluster.batch(), self.cluster.cleaning(self._dask_retention.dir_patterns(record.ckpt_id, seq)):
                self._flush_files(record, seq, hosts)
        except FTIError as exc:  # the global directory full or read-only: raised, the newest stays where it is
            self._dask_retention.remove_dirs(record.ckpt_id, seq, 4, record.nranks)
            raise CheckpointError(f"keep_last_ckpt: checkpoint {record.ckpt_id} (level {record.level}) cannot be "
                                  f"flushed to L4: {exc}") from exc
        # If the copy cannot be committed, the last checkpoint stays where it is, committed; the copy goes.
        self._committer.seal(record.committed_copy(seq=seq, level=4, timestamp=time.time()),
                             "keep_last_ckpt: flushing the last checkpoint to L4 failed",
                             lambda: self._dask_retention.remove_dirs(record.ckpt_id, seq, 4, record.nranks))

    def _flush_files(self, record: CommitRecord, seq: int, hosts: dict[int, tuple[str, str]]) -> None:
        futures, token = [], uuid.uuid4().hex[:8]  # keys of this run's (another run on the cluster has ids too)
        for r, (worker, path) in hosts.items():
            dst = self.node_file(4, record.ckpt_id, seq, r, storage.rank_file(record.ckpt_id, r))
            futures.append(self.cluster.submit(tasks.flush, path, dst, keep_src=True,
                                               key=f"ftidask-flush-{record.ckpt_id}-{seq}-{token}-{r}", worker=worker))
        self.cluster.wait_all(futures, [w for w, _p in hosts.values()], "keep_last_ckpt flush")

    # --- recovery ----------------------------------------------------------------------------------

    @one_at_a_time
    def recover(self, ckpt_id: int | None = None, level: int | None = None,
                chunks: Any = None, *, ids: int | Iterable[int] | None = None) -> dict[int, Any]:
        """Rebuild the newest checkpoint that verifies; returns id -> array (a new Dask array for Dask
        variables: rebind it; NumPy variables are filled in place).

        ``chunks``: the chunks of the returned Dask arrays (a dask ``chunks`` value, or a dict
        id -> chunks); by default a protected Dask array's own chunks, else the stored ones.
        ``ids``: recover only these variables (FTI_RecoverVar); the other protected ones are untouched.
        Python states (ftidask.State, Value, numpy.random generators) are recovered in place.
        A checkpoint written by the MPI backend comes back as global arrays when its variables declare
        their place (global_shape/offset or replicated; see :mod:`ftidask.backends.dask.stitch`).
        """
        self._check_open()
        self._icp_slot.check_none_open(RecoveryError)  # its pinned arrays and the recovered ones would be mixed
        self._async.drain()  # never a checkpoint half written by this run
        out = restore.recover(self, ckpt_id, level, chunks, ids)
        self.progress.recovered_all |= ids is None  # FTI_Status is 0 after a full recovery, as FTI_Recover sets it
        self.progress.recovered_ids.update(out)  # what snapshot() no longer recovers
        return out

    @one_at_a_time
    def recover_var(self, id: int, ckpt_id: int | None = None, level: int | None = None) -> Any:
        """FTI_RecoverVar: recover variable ``id`` only (every other protected variable is untouched)."""
        vid = var_id_of(id, "recover_var(...)")
        with self._calls.nested("recover"):
            return self.recover(ckpt_id, level, ids=[vid])[vid]

    @one_at_a_time
    def stored_size(self, id: int, *, total: bool = False) -> int:
        """Bytes of variable ``id`` in the checkpoint to recover (or the last one written): the whole array's, the
        client's view, so ``total=True`` changes nothing."""
        self._check_open()
        vid, _total = check_id(id, "variable id"), check_bool(total, "stored_size(total=...)", RecoveryError)
        self._async.drain()
        return restore.stored_size(self, vid)

    @one_at_a_time
    def realloc(self, id: int, array: Any = None) -> Any:
        """FTI_Realloc has no use here (an FTIError says so): :meth:`recover` returns arrays of the stored shape."""
        raise FTIError("realloc is not needed with Dask: recover() returns new arrays of the stored shape")

    # --- display -------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return report.context_repr(self)

    def _repr_html_(self) -> str:
        return report.context_html(self)


def _unsafe_dirs(dirs: list[str]) -> list[str]:  # on a worker: why each of its run directories is unsafe
    return dirchecks.unsafe_dirs([Path(d) for d in dirs])


def make_dask_context(cfg: Config, client: Client) -> DaskContext:
    """The Context of ``ftidask.init(config, client=...)``."""
    if not isinstance(client, Client):
        raise FTIError(f"client= must be a distributed.Client, got {type(client).__name__}")
    check_client(client)
    if getattr(client, "asynchronous", False):  # its calls return coroutines: nothing would run (or a raw TypeError)
        raise FTIError("client= must be a synchronous distributed.Client: ftidask's calls block until done; from "
                       "asyncio code, make the Client without asynchronous=True and call ftidask in a thread "
                       "(loop.run_in_executor)")
    if cfg.l4_format == "zarr":  # said, as init says of a ckpt_io that is not written: never ignored silently
        logging.getLogger("ftidask").warning(
            "l4_format = zarr is not used on Dask: level 4 is written as FTI-FF files by the workers (export a "
            "checkpoint to Zarr with ftidask export --to-zarr)")
    return DaskContext(cfg, client)


__all__ = ["DaskContext", "DaskTransport", "make_dask_context"]
