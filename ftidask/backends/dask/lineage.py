"""A checkpoint cuts the lineage of the Dask arrays it wrote (issue 17).

After a commit, each protected Dask array is handed back as a new array whose chunk tasks read
that chunk from the checkpoint (:func:`ftidask.backends.dask.reads.read_lineage_chunk`) and depend
on nothing else. Nothing is read while the chunks stay in memory: on the worker that holds a chunk,
the new key is made an alias of the same object (``Worker.update_data``: no copy, no I/O), the
scheduler learns that the key is in memory there (``Scheduler.update_data``, as ``scatter`` does),
and only then is the read task sent as the key's ``run_spec`` (a task already in memory is not run;
distributed fills the ``run_spec`` of a key it learnt from a scatter). When a worker dies, the
scheduler recomputes its lost keys from their ``run_spec``: a read of the checkpoint, not the history.

The keys are ``(ftidask-lineage-ckpt{id}-s{seq}-v{var}-{token}, *grid index)``; :class:`Pins`
remembers them per checkpoint so that retention keeps a checkpoint that live arrays may still read.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dask._task_spec import Task
from dask.array.core import Array
from distributed import Client, Future, futures_of, wait

from ...engine.device import device_meta
from ...engine.runstate import CommitRecord
from ...storage import files as storage
from . import reads, recorded
from .cluster import Cluster, send_now
from .plan import VarSpec
from .restore import file_sources

if TYPE_CHECKING:
    from .context import DaskContext

log = logging.getLogger("ftidask")

TOPIC = reads.TOPIC
Place = tuple[int, tuple[int, ...]]


def _alias(pairs: Mapping[str, list[tuple[Any, Any]]], dask_worker: Any = None) -> dict[Any, int]:
    """On a worker (``Client.run``): put each ``new`` key in memory as the very object of ``old``.

    Runs in the worker's event loop, as its ``update_data`` handler does for a scatter; a key
    released meanwhile is skipped (its new key will be read from the checkpoint instead).
    Returns new key -> bytes of the keys aliased.
    """
    from dask.sizeof import sizeof

    data = {}
    for old, new in pairs.get(dask_worker.address, ()):
        ts = dask_worker.state.tasks.get(old)
        if ts is not None and ts.state == "memory" and old in dask_worker.data:
            data[new] = dask_worker.data[old]  # the same ndarray: a second reference, not a copy
    if data:
        dask_worker.update_data(data, stimulus_id=f"ftidask-lineage-{time.time()}")
    return {k: int(sizeof(v)) for k, v in data.items()}


class _KeyBook(dict):  # type: ignore[type-arg] - a dict that a WeakValueDictionary may hold
    """(ckpt_id, seq) -> the lineage keys made to read that checkpoint back."""


#: The books of the runs of this process's live Dask contexts (gone with the last context of a run).
_books: weakref.WeakValueDictionary[tuple[str, str], _KeyBook] = weakref.WeakValueDictionary()


class Pins:
    """The lineage keys made per checkpoint, to know whether a live array may still read one."""

    def __init__(self, client: Client, run: tuple[str, str] | None = None) -> None:
        self.client = client
        # One book per run in this process (``run``: its meta_dir's real path and exec_id), shared by its contexts: a
        # notebook's init cell run again makes a second context of the run, whose checkpoints retired those that the
        # first one's live arrays read (each context asked about its own keys only).
        self._keys: dict[tuple[int, int], list[Any]] = _KeyBook() if run is None else _books.setdefault(run, _KeyBook())
        # Set by a lineage cut whose graph left after the releases it made: the scheduler has handled those (its
        # stream is in order), so the next read needs no barrier. Spent by that read.
        self.settled = False
        # Checkpoints found read once (the next ask may collect garbage for them), and those it was collected for.
        self._kept: set[tuple[int, int]] = set()
        self._collected: set[tuple[int, int]] = set()

    def add(self, record: CommitRecord, keys: Iterable[Any]) -> None:
        """Note ``keys``, lineage keys made to read checkpoint ``record`` back."""
        self._keys.setdefault((record.ckpt_id, record.seq), []).extend(keys)

    def read(self, records: Iterable[CommitRecord]) -> set[tuple[int, int]]:
        """(ckpt_id, seq) of those of ``records`` that the scheduler may still read back: it knows a task
        reading it (held by a future, or kept as the dependency of a result in memory: either may be
        recomputed from it). When it cannot be asked, all of them (a later commit asks again)."""
        settled, self.settled = self.settled, False
        asked = {(r.ckpt_id, r.seq): self._keys[r.ckpt_id, r.seq] for r in records
                 if self._keys.get((r.ckpt_id, r.seq))}
        if not asked:
            return set()
        try:
            # Asked first as things stand: a key the scheduler has forgotten is gone for good (keys are never reused),
            # so only what it still knows may need the releases this client sent to land first (a barrier), unless
            # a lineage cut just made sure they had.
            out = self._still_read(asked)
            if out and not settled:
                out = self._still_read(self._narrowed(out), barrier=True)
            # Futures caught in reference cycles (a traceback's frames keep the futures a wait was given) are
            # released by a collection only: without one, a checkpoint nobody reads could be kept until Python
            # collects its oldest generation. But a full collection of the client's heap costs tens of milliseconds
            # (more in a large notebook), and a loop's checkpoint is usually read for a good reason: the array of
            # the step being checkpointed was computed from it. So one collection per checkpoint, at most, and only
            # when it is still read at the next ask (by then that step's array is usually gone).
            retry = {which for which in out if which in self._kept and which not in self._collected}
            self._kept |= out
            if retry:
                self._collected |= retry
                gc.collect()
                out = (out - retry) | self._still_read(self._narrowed(retry), barrier=True)
        except Exception as exc:  # noqa: BLE001 - keep the files rather than pull them from under an array
            log.debug("cannot ask the scheduler which checkpoints live arrays read: %s", exc)
            return set(asked)
        return out

    def _narrowed(self, which: Iterable[tuple[int, int]]) -> dict[tuple[int, int], list[Any]]:
        return {w: self._keys[w] for w in which}

    def _still_read(self, asked: dict[tuple[int, int], list[Any]], barrier: bool = False) -> set[tuple[int, int]]:
        """Those of ``asked`` whose keys the scheduler still knows (with ``barrier``, once it has handled every
        release this client sent), their keys narrowed to those."""
        if barrier:
            _barrier(self.client)
        states = self.client.sync(self.client.scheduler.get_task_status,
                                  keys=[k for keys in asked.values() for k in keys])
        out = set()
        for which, keys in asked.items():
            self._keys[which] = [k for k in keys if states.get(k) not in (None, "forgotten")]
            if self._keys[which]:
                out.add(which)
        return out

    def forget(self, record: CommitRecord) -> None:
        """Drop checkpoint ``record``'s keys: it no longer counts as read."""
        which = (record.ckpt_id, record.seq)
        self._keys.pop(which, None)
        self._kept.discard(which)
        self._collected.discard(which)


def _noop() -> None:
    return None


def _barrier(client: Client, timeout: float = 30) -> None:
    """Return once the scheduler has handled every message this client sent before (keys released by
    futures just dropped): a task sent on the same stream, which the scheduler handles in order."""
    _queued(client)
    future = client.submit(_noop, pure=False, key=f"ftidask-barrier-{uuid.uuid4().hex}")
    send_now(client)
    future.result(timeout=timeout)


async def _yield() -> None:
    await asyncio.sleep(0)


def _queued(client: Client) -> None:
    """Return once the releases of the futures dropped before are queued on the client's stream to the scheduler,
    ahead of any message sent after this call.

    A dropped future's release takes two hops through the client's event loop (``Future.release`` schedules the
    refcount's decrement, which schedules the message), a graph sent from this thread one: sent right away, a
    graph would leave before the releases of the futures dropped just before it."""
    client.sync(_yield)


def cut(ctx: DaskContext, record: CommitRecord, specs: list[VarSpec], futures: dict[Place, Future],
        held: dict[int, Any], aliasing: Aliasing) -> dict[int, Array]:
    """The protected Dask arrays of committed ``record`` with their lineage cut: var id -> new array.

    ``futures``: the chunks the checkpoint wrote; ``held``: the arrays they came from (``p.array``
    is replaced by the new array only if it is still that one: an asynchronous checkpoint commits
    while the application goes on and may have protected a newer array meanwhile). ``aliasing``: the chunks
    aliased under their new keys while the checkpoint was written, which the scheduler now learns of.
    """
    client = ctx.client
    lay = recorded.layout(record)
    workers = lay.workers
    cid, seq, level = record.ckpt_id, record.seq, record.level
    hosts = {r: (workers[r], ctx.node_file(level, cid, seq, r, storage.rank_file(cid, r)))
             for r in range(record.nranks)}
    sources = {r: src | {"exec_id": ctx.exec_id} for r, src in file_sources(ctx, record, hosts).items()}
    graphs: dict[int, tuple[str, dict[Any, Task]]] = {}
    for spec in specs:
        if spec.id not in aliasing.names:
            continue
        name = aliasing.names[spec.id]
        graph = {}
        for at in lay.chunks[spec.id]:
            key = (name, *at.index)
            graph[key] = Task(key, reads.read_lineage_chunk, sources[at.rank], spec.id, spec.name, list(at.index),
                              at.dptr, lay.raw_dtypes[spec.id], list(spec.chunk_shape(at.index)),
                              device=spec.device)
        graphs[spec.id] = (name, graph)
    aliased = _place_aliases(client, aliasing)
    pins = ctx._dask_retention.pins
    lazy: dict[int, Array] = {}
    for spec in specs:
        if spec.id not in graphs:
            continue
        name, graph = graphs[spec.id]
        meta = device_meta(len(spec.shape), spec.dtype) if spec.device else None  # CuPy chunks stay CuPy chunks
        lazy[spec.id] = Array(graph, name, spec.chunks, dtype=spec.dtype, meta=meta)
        pins.add(record, graph)
    # Until persisted below, an array reads the checkpoint when computed: the same values, but from a graph whose
    # keys the scheduler does not know yet, so that forgetting them later would prove nothing: retention would
    # retire the checkpoint under an application that held such an array. Nobody sees one (ctx.protected waits
    # for the lock: an asynchronous checkpoint cuts while the application goes on). (Were the persist to fail, the
    # next checkpoint persists it; the keys aliased stay in memory meanwhile, which keeps the checkpoint.)
    with ctx._cutting:
        held_names = {vid: getattr(arr, "name", None) for vid, arr in held.items()}
        for vid in lazy:
            p = ctx._vars.get(vid)
            if p is not None and _still_held(ctx, vid, p.array, held.get(vid)):
                p.array = lazy[vid]
        # The chunks as computed are ours no more: released before the graph goes, so that when the scheduler
        # reports the graph's keys, it has forgotten the keys of the arrays this one replaces (unless the
        # application or other results still hold them) and the retirement that follows needs no barrier to ask it.
        futures.clear()
        held.clear()
        _queued(client)
        # A chunk not aliased (released meanwhile, or its worker gone) is read from the checkpoint now.
        out = dict(zip(lazy, client.persist(list(lazy.values()), optimize_graph=False), strict=True)) if lazy else {}
        for vid, arr in out.items():
            p = ctx._vars.get(vid)
            if p is not None and p.array is lazy[vid]:
                p.array = arr
                if held_names.get(vid) is not None:
                    ctx._cut_from[vid] = (held_names[vid], arr.name)
    lazy.clear()
    send_now(client)
    # Done when the scheduler has the graphs: the aliased keys are reported in memory once they have their
    # run_spec (any chunk not aliased is read meanwhile).
    wait([f for arr in out.values() for f in futures_of(arr)])
    pins.settled = True
    missed = sum(len(g) for _n, g in graphs.values()) - aliased
    log.debug("checkpoint %d: lineage cut for %d arrays (%d chunks aliased in memory, %d to read)", cid, len(out),
              aliased, missed)
    return out


def _still_held(ctx: DaskContext, vid: int, current: Any, held: Any) -> bool:
    """Whether variable ``vid`` still holds the array ``held`` the checkpoint wrote: that very array, or the cut
    an earlier checkpoint of it made meanwhile (two asynchronous checkpoints in flight of an unchanged array:
    the second one's cut replaces the first's, which lets the first checkpoint be retired)."""
    if current is held:
        return True
    names = (getattr(held, "name", None), getattr(current, "name", None))
    return None not in names and ctx._cut_from.get(vid) == names


def cut_after_commit(ctx: DaskContext, record: CommitRecord, specs: list[VarSpec], futures: dict[Place, Future],
                     held: dict[int, Any], aliasing: Aliasing) -> dict[int, Array]:
    """:func:`cut`, or nothing when it fails: the arrays keep their history, the checkpoint stays committed."""
    try:
        return cut(ctx, record, specs, futures, held, aliasing)
    except Exception as exc:  # noqa: BLE001 - e.g. a worker lost meanwhile: Dask recomputes, as without ftidask
        aliasing.abandon()  # (unless the scheduler was told of them: then they keep the checkpoint, as keys do)
        log.warning("checkpoint %d: the arrays keep their Dask history (lineage not cut: %s)", record.ckpt_id, exc)
        return {}


#: A checkpoint of at most this many bytes of chunks has them aliased while it is written (see :class:`Aliasing`).
EARLY_ALIAS_BYTES = 32 << 20


class Aliasing:
    """A checkpoint's chunks aliased under their lineage keys on the workers that hold them (:func:`_alias`). For a
    small checkpoint (:data:`EARLY_ALIAS_BYTES`), whose time is its round trips, started with its writes so that
    this one overlaps them; for a larger one, once it is committed (a round trip is nothing beside its writes). The
    scheduler learns of the new keys only once the checkpoint is committed (:func:`cut`); until then they are the
    workers' alone, dropped again (:meth:`abandon`) when the checkpoint is not committed or its lineage not cut.
    (A client killed meanwhile leaves them on the workers, holding their chunks until the workers restart: hence
    early for small checkpoints only.)

    Each chunk is aliased on its writer (``owner``), else on a worker ``who_has`` names for it; one that holds it
    no longer skips it, and that chunk is read back from the checkpoint instead."""

    def __init__(self, cluster: Cluster, ckpt_id: int, seq: int, specs: list[VarSpec], futures: dict[Place, Future],
                 who_has: Mapping[Any, Any], owner: Mapping[Place, int], workers: list[str]) -> None:
        self.cluster, self.client = cluster, cluster.client
        self.names: dict[int, str] = {}  # var id -> the name of its lineage keys, (name, *grid index)
        pairs: dict[str, list[tuple[Any, Any]]] = {}
        nbytes = 0
        for spec in specs:
            if spec.kind != "dask" or spec.pystate:
                continue
            name = self.names[spec.id] = f"ftidask-lineage-ckpt{ckpt_id}-s{seq}-v{spec.id}-{uuid.uuid4().hex}"
            for index in spec.grid():
                nbytes += spec.chunk_nbytes(index)
                old = futures[spec.id, index].key
                holders = who_has.get(old, ())
                writer = workers[owner[spec.id, index]]  # it holds the chunk, or gets a replica for its write task
                holder = writer if writer in holders else (sorted(holders)[0] if holders else None)
                if holder is not None:
                    pairs.setdefault(holder, []).append((old, (name, *index)))
        self._pairs = pairs if pairs and nbytes > EARLY_ALIAS_BYTES else {}  # made by made(), after the commit
        self._running = cluster.run_soon(_alias, pairs) if pairs and not self._pairs else None
        self._made: dict[str, dict[Any, int]] | None = None
        self.told = False  # the scheduler knows of them (they are its keys now)

    def made(self) -> dict[str, dict[Any, int]]:
        """worker -> {new key: bytes} of the aliases made (made now if not started; waited for, once)."""
        if self._made is None:
            running, self._running = self._running, None
            pairs, self._pairs = self._pairs, {}
            if running is None and pairs:
                running = self.cluster.run_soon(_alias, pairs)
            results = running.result() if running is not None else {}
            # A worker lost meanwhile (an exception): its chunks are read back instead.
            self._made = {w: sizes for w, sizes in results.items() if not isinstance(sizes, BaseException) and sizes}
        return self._made

    def abandon(self) -> None:
        """Drop the aliases the scheduler was not told of (best effort: a worker gone took its own along)."""
        self._pairs = {}  # not made yet: never to be
        if self.told:
            return
        with contextlib.suppress(Exception):
            made = self.made()
            if made:
                self.cluster.run(_unalias, {w: list(sizes) for w, sizes in made.items()})
        self._made = {}


def _unalias(keys: Mapping[str, list[Any]], dask_worker: Any = None) -> None:
    """On a worker (``Client.run``): release its aliases ``keys[address]`` (:class:`Aliasing`), as the scheduler's
    free-keys would."""
    from distributed.worker_state_machine import FreeKeysEvent

    mine = [k for k in keys.get(dask_worker.address, ()) if k in dask_worker.state.tasks]
    if mine:
        dask_worker.handle_stimulus(FreeKeysEvent(keys=mine, stimulus_id=f"ftidask-unalias-{time.time()}"))


def _place_aliases(client: Client, aliasing: Aliasing) -> int:
    """Tell the scheduler where the aliases are (once made); the count."""
    who_has: dict[Any, list[str]] = {}
    nbytes: dict[Any, int] = {}
    for worker, sizes in aliasing.made().items():
        for key, n in sizes.items():
            who_has[key] = [worker]
            nbytes[key] = n
    aliasing.told = True  # (even were the call to fail midway: the keys it placed stay, as they always did)
    if who_has:
        # What Client.scatter does from inside a task: the scheduler now holds these keys in memory on
        # those workers, with no run_spec yet; the graph persisted next gives them theirs. Run on the
        # scheduler, in one step of its event loop (a worker gone meanwhile: its keys left out, read again).
        return int(client.run_on_scheduler(_update_data_alive, who_has, nbytes, client.id))
    return 0


def _update_data_alive(who_has: dict[Any, list[str]], nbytes: dict[Any, int], client: str,
                       dask_scheduler: Any = None) -> int:
    """On the scheduler (``Client.run_on_scheduler``, in its event loop: no worker leaves meanwhile): its
    ``update_data`` for the aliases whose worker is still there; the count. From the client, a worker that left
    between the aliases' making and the call failed the call midway, its first key left "in memory" on no worker:
    every compute of the protected array, and the next checkpoint, then waited for ever."""
    alive = {k: w for k, w in who_has.items() if all(a in dask_scheduler.workers for a in w)}
    dask_scheduler.update_data(who_has=alive, nbytes={k: nbytes[k] for k in alive}, client=client)
    return len(alive)


def watch(client: Client) -> None:
    """Log on the client each chunk that a worker restored from a checkpoint (the workers' events)."""
    try:
        client.subscribe_topic(TOPIC, _log_event)
    except Exception as exc:  # noqa: BLE001 - the log is a convenience; the events stay on the scheduler
        log.debug("cannot subscribe to %s events: %s", TOPIC, exc)


def _log_event(event: tuple[float, dict[str, Any]]) -> None:
    _t, e = event
    log.info("lineage: chunk %s of variable %s (%s) restored from checkpoint %s (level %s, %s) on worker %s "
             "in %.3f s", tuple(e["index"]), e["var"], e["name"], e["ckpt_id"], e["level"], e["how"], e["worker"],
             e["seconds"])


def restores(client: Client, exec_id: str | None = None) -> list[dict[str, Any]]:
    """The chunks restored from a checkpoint (of run ``exec_id``, else any) by lineage reads on this
    cluster, oldest first: var, name, index, ckpt_id, level, how, path, worker, nbytes, seconds."""
    return [dict(e) for _t, e in client.get_events(TOPIC) if exec_id is None or e.get("exec_id") == exec_id]
