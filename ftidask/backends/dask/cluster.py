"""The client's side of the cluster: place tasks on workers, wait for them while watching for
lost workers, show progress with Dask's own bar."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from dask._task_spec import Task
from distributed import Client, Future, wait
from distributed.client import FuturesCancelledError
from distributed.diagnostics.progressbar import TextProgressBar, is_kernel

from ...engine.progress import DELAY
from ...model.errors import FTIError
from . import fence

try:  # dask >= 2025: Client.get wraps a dict graph in this expression, whose name tokenizes every task's arguments
    from dask._expr import LLGExpr
except ImportError:  # pragma: no cover - older dask sends the dict as it is
    LLGExpr = None

log = logging.getLogger("ftidask")


class ClusterError(FTIError):
    """Work on the cluster failed: ``what`` was being done, ``detail`` says why (one sentence)."""

    def __init__(self, what: str, detail: str) -> None:
        self.what, self.detail = what, detail
        super().__init__(f"{what}: {detail}")


class WorkerLost(ClusterError):
    """A worker that a task was placed on left the cluster before the task finished."""


class TaskFailed(ClusterError):
    """A task raised an exception on its worker."""


def _listed(names: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_client(client: Client) -> None:
    """Refuse a client that is closed (or closing): distributed would fail deep inside, with an AttributeError."""
    status = str(getattr(client, "status", "running"))
    if status in ("closing", "closed"):
        raise FTIError(f"the Dask client is {status}: ftidask works through a running distributed.Client; a run "
                       "whose client was closed keeps its checkpoints: ftidask.init(config, client=Client(...)) "
                       "restarts from them")


#: Worker statuses of a live worker: a paused one (memory pressure: it runs no new task until its memory is spilled)
#: holds its chunks and files and resumes; taken for gone, a checkpoint failed saying it had left the cluster.
_ALIVE = ("running", "paused")
PAUSED_SAID = 30.0  # seconds a wait for a paused worker goes on before it is said


class Cluster:
    """Task placement and waiting on one ``distributed.Client``."""

    def __init__(self, client: Client, progress: str = "auto", poll: float = 0.25, verbosity: int = 2) -> None:
        self.client = client
        self.progress, self.verbosity = progress, verbosity
        self.poll = poll
        self._batch: list[Future] | None = None
        self._placed: dict[Any, str] = {}  # key -> worker of each pinned task not yet waited for or released
        self.run_id: str | None = None  # the run this client writes (set at init): its tasks are fenced (.fence)
        self._cleanup = threading.local()  # the directories of the checkpoint this thread's tasks write
        self._workers: list[str] | None = None  # as the scheduler last listed them
        self._paused: set[str] = set()  # the workers paused then (memory pressure: they run no task until resumed)

    def take_over(self, run: str) -> None:
        """At ``init``, before the garbage collection: this client writes ``run`` now; the tasks that a dead client
        of the run left running on the workers are orphans (see :mod:`.fence`)."""
        self.run_id = run
        self.run(fence.take_over, run, self.client.id)

    @contextlib.contextmanager
    def cleaning(self, dirs: Sequence[str]) -> Iterator[None]:
        """The tasks this thread submits in the block write into ``dirs``: an orphan removes them."""
        outer, self._cleanup.dirs = getattr(self._cleanup, "dirs", ()), list(dirs)
        try:
            yield
        finally:
            self._cleanup.dirs = outer

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Release every future submitted inside the block when it ends.

        A finished level task whose result the client still held would be recomputed if its
        worker died later: the client must forget them once the checkpoint is decided.
        """
        outer, self._batch = self._batch, []
        try:
            yield
        finally:
            for f in self._batch:
                self._placed.pop(f.key, None)
                try:
                    f.release()
                except Exception:  # noqa: BLE001 - best effort on a failing cluster
                    pass
            self._batch = outer

    def workers(self) -> list[str]:
        """Addresses of the live workers, sorted: a worker's position is its rank."""
        # Not Client.scheduler_info(): a periodic refresh may replace its cache with one that lists no worker.
        info = self.client.sync(self.client.scheduler.identity)
        self._workers = sorted(a for a, w in info["workers"].items() if w.get("status", "running") in _ALIVE)
        self._paused = {a for a, w in info["workers"].items() if w.get("status") == "paused"}
        return list(self._workers)

    def workers_holding(self, keys: list[Any]) -> tuple[list[str], dict[Any, list[str]]]:
        """:meth:`workers`, and the workers holding each of ``keys`` (``Client.who_has``): both asked at once."""
        scheduler = self.client.scheduler

        async def ask() -> list[Any]:
            return list(await asyncio.gather(scheduler.identity(), scheduler.who_has(keys=keys)))

        info, who_has = self.client.sync(ask)
        self._workers = sorted(a for a, w in info["workers"].items() if w.get("status", "running") in _ALIVE)
        return list(self._workers), dict(who_has)

    def last_workers(self) -> list[str]:
        """:meth:`workers` as last asked (asked now if never): for what a list a moment old serves as well, such
        as how many node directories to look into, which every live worker does for its own anyway."""
        return list(self._workers) if self._workers is not None else self.workers()

    def submit(self, fn: Callable[..., Any], *args: Any, key: Any, worker: str, loose: bool = False,
               **kwargs: Any) -> Future:
        """Run ``fn`` on ``worker`` only (its files or chunks are there), under a readable key.

        ``loose``: on ``worker`` while it lives, else on any worker (Dask's ``allow_other_workers``);
        for tasks that cope with running elsewhere, such as recovered chunks read again after their
        worker died (a strictly pinned task would then wait for its dead worker forever).
        """
        if self.run_id is not None:  # refused on the workers once another client took the run over
            fn, args = fence.call, (fn, self.run_id, self.client.id, getattr(self._cleanup, "dirs", ()), *args)
        future = self.client.submit(fn, *args, key=key, workers=[worker], allow_other_workers=loose, pure=False,
                                    **kwargs)
        if self._batch is not None:
            self._batch.append(future)
        if not loose:
            self._placed[future.key] = worker
        return future

    def submit_group(self, calls: Mapping[Any, tuple[Callable[..., Any], tuple[Any, ...]]], worker: str,
                     loose: bool = False) -> dict[Any, Future]:
        """:meth:`submit` of every ``key: (fn, args)`` of ``calls`` on ``worker``, sent to the scheduler as one
        graph: a ``submit`` is a message and a serialization each (a recovery of 1024 chunks spent 3.8 s of
        the client's time submitting its reads one by one)."""
        if not calls:
            return {}
        graph = {key: Task(key, fn, *args) for key, (fn, args) in calls.items()}
        keys = list(graph)
        futures = dict(zip(keys, self.client.get(_untokenized(graph), keys, workers=[worker], allow_other_workers=loose,
                                                 sync=False), strict=True))
        for future in futures.values():
            if self._batch is not None:
                self._batch.append(future)
            if not loose:
                self._placed[future.key] = worker
        return futures

    def run(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """``fn(*args)`` on every live worker (small values only).

        Always every worker the scheduler has when it gets the call, never a list of addresses: an address named
        after its worker died is dialled again and again until the connect timeout (30 s by default), where the
        scheduler's own list no longer has it. A function meant for some workers picks its part by
        ``dask_worker.address``."""
        return self.client.run(fn, *args, on_error="return")

    def run_soon(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """:meth:`run`, started now: its future's result is waited for later, so that its round trip to the workers
        overlaps the caller's next ones. The caller always waits for it (never left running unobserved)."""
        coro = self.client.run(fn, *args, on_error="return", asynchronous=True)
        return asyncio.run_coroutine_threadsafe(coro, self.client.loop.asyncio_loop)

    def _show_progress(self, futures: Sequence[Future]) -> threading.Event | None:
        """Dask's text bar for ``futures``, drawn from a thread once they took :data:`~ftidask.engine.progress.DELAY`
        seconds (as ftidask's own bars: short steps draw none); the event returned, set when they are done."""
        enabled = self.progress == "on" or (self.progress == "auto" and self.verbosity <= 2 and is_kernel())
        if not enabled or not futures:
            return None
        keys = [f.key for f in futures]
        address = self.client.scheduler.address
        done = threading.Event()

        def bar() -> None:
            if done.wait(DELAY):
                return
            try:
                TextProgressBar(keys, scheduler=address, complete=True)
            except Exception as exc:  # noqa: BLE001 - a progress bar must never fail a checkpoint
                log.debug("progress bar stopped: %s", exc)

        threading.Thread(target=bar, name="ftidask-progress", daemon=True).start()
        return done

    def wait_all(self, futures: Sequence[Future], addresses: Iterable[str], what: str,
                 gather: bool = True, ranks: Sequence[str] = (), cancel: bool = True) -> list[Any]:
        """The results of ``futures``; :class:`WorkerLost` or :class:`TaskFailed` on failure.

        Tasks are pinned to their workers, so a lost worker would leave them waiting forever:
        the loop checks that every worker they were placed on is still alive. ``ranks``: the
        workers in rank order, to name a lost worker with its rank. ``cancel``: the futures are cancelled on a
        failure (ftidask's own tasks, pinned to their workers); not the chunks of the application's arrays.
        """
        needed = set(addresses)
        send_now(self.client)  # the tasks just submitted leave now, not at the end of the client's batching interval
        shown = self._show_progress(futures)
        start, said = time.monotonic(), set()
        try:
            while not wait_for(futures, self.poll):
                if any(f.status in ("error", "cancelled", "lost") for f in futures):
                    break
                if needed - set(self.workers()):
                    break
                paused = (needed & self._paused) - said
                if paused and time.monotonic() - start > PAUSED_SAID:  # a wait with no end in sight, said once
                    said |= paused
                    log.warning("%s: waiting for worker(s) %s, paused by distributed (memory use over "
                                "distributed.worker.memory.pause): they run no task until they spill enough and "
                                "resume", what, _listed(sorted(paused)))
            if all(f.status == "finished" for f in futures):
                if not gather:
                    return []
                results = self._results(futures, needed)
                if results is not None:
                    return results
            # What failed is read before the cancel (which turns a failed future into a cancelled one).
            gone = needed - set(self.workers())
            error: ClusterError = (WorkerLost(what, self._lost(sorted(gone), list(ranks))) if gone
                                   else TaskFailed(what, self._failed(futures)))
            if cancel:
                self.cancel(futures)
            raise error
        finally:
            if shown is not None:
                shown.set()
            for f in futures:
                self._placed.pop(f.key, None)

    def _results(self, futures: Sequence[Future], needed: set[str]) -> list[Any] | None:
        """The results of ``futures`` (all finished), or None when a worker holding one left meanwhile, or a future
        failed. Gathered with a timeout: a worker lost after its task finished, before its result was fetched, made
        distributed reschedule the task, pinned to that worker, and wait for it for ever (a checkpoint that hung)."""
        timeout = max(1.0, 8 * self.poll)
        while True:
            try:
                return self.client.sync(self.client._gather, list(futures), callback_timeout=timeout)
            except (TimeoutError, asyncio.TimeoutError):
                pass
            except Exception as exc:  # noqa: BLE001 - a result lost or failed on the way: said below, as a loss
                log.debug("gathering %d results failed: %r", len(futures), exc)
                return None
            if needed - set(self.workers()) or any(f.status in ("error", "cancelled", "lost") for f in futures):
                return None
            timeout = min(2 * timeout, 60.0)  # large results, a slow network: the workers are all there

    def _lost(self, gone: list[str], ranks: list[str]) -> str:
        """One sentence: which workers left, and which of our tasks were on them.

        Not the errors of the futures: a lost task's future holds no exception (Dask reschedules
        it, or would, were it not pinned), and what the user needs is the worker that died.
        """
        names = [f"{w} (rank {ranks.index(w)})" if w in ranks else w for w in gone]
        keys = [str(k) for k, w in self._placed.items() if w in gone]
        who = f"worker {names[0]}" if len(names) == 1 else f"workers {_listed(names)}"
        return (f"{who} left the cluster (killed, crashed or retired)"
                + (f", losing tasks {_listed(keys)}" if keys else ""))

    def _failed(self, futures: Sequence[Future]) -> str:
        """The exceptions the failed tasks raised (tasks cancelled or lost meanwhile are only counted)."""
        errors, echoes, other = [], [], []
        for f in futures:
            if f.status == "error":
                try:
                    exc = f.exception(timeout=self.poll * 4)
                except Exception as err:  # noqa: BLE001 - the future may be released meanwhile
                    exc = err
                # A task that only stopped because another one failed (``echo``) is named when alone.
                (echoes if getattr(exc, "echo", False) else errors).append(f"{f.key}: {type(exc).__name__}: {exc}")
            elif f.status != "finished":
                other.append(str(f.key))
        errors = errors or echoes
        if not errors:
            return f"task(s) {_listed(other)} were cancelled or lost by the cluster"
        return "; ".join(errors[:8]) + (f" (and {len(errors) - 8} more)" if len(errors) > 8 else "")

    def cancel(self, futures: Sequence[Future]) -> None:
        """Cancel ``futures`` (forced); best effort: a failure is only logged."""
        try:
            self.client.cancel(list(futures), force=True)
        except Exception as exc:  # noqa: BLE001 - best effort on a failing cluster
            log.debug("cancel failed: %s", exc)


def _untokenized(graph: dict[Any, Task]) -> Any:
    """``graph`` for ``Client.get``, its name drawn at random instead of hashed from every task's arguments.

    The tasks' keys are ftidask's own and never reused (``pure=False``): a deterministic name buys nothing, and
    computing it walked every argument of every task on the client (77 ms for a recovery of 16 chunks, growing
    with the chunks) before the graph could leave for the scheduler."""
    if LLGExpr is None:
        return graph
    try:
        return LLGExpr(graph, _determ_token=uuid.uuid4().hex)
    except TypeError:  # pragma: no cover - a dask whose expressions take no given token
        return graph


def send_now(client: Client) -> None:
    """Send what ``client`` has queued for the scheduler (a graph just submitted) now.

    The client batches its messages to the scheduler: one sent, the next ones wait until 10 ms have passed
    (``distributed.batched.BatchedSend``). A checkpoint's graph sent right after a release of futures (the
    application's, or the checkpoint's own) would wait there for most of that interval, twice per checkpoint:
    a third of a small checkpoint's time. Called after a graph the client then waits for; the batching of
    every other message is left as it is. Only a speed-up: a client without the attributes batches as before.
    """
    client.loop.add_callback(_send_now, client)  # after the sends queued before it: callbacks run in order


def _send_now(client: Client) -> None:
    bcomm = getattr(client, "scheduler_comm", None)
    if bcomm is None or not getattr(bcomm, "buffer", None) or getattr(bcomm, "next_deadline", None) is None:
        return  # nothing queued, or nothing held back (an idle stream sends at once)
    waker = getattr(bcomm, "waker", None)
    if waker is not None:
        bcomm.next_deadline = None  # its sender wakes and sends the buffer, then waits the interval again
        waker.set()


def wait_for(futures: Sequence[Future], timeout: float) -> bool:
    """Whether every one of ``futures`` is done (finished, failed or cancelled) within ``timeout`` seconds
    (``distributed.wait``, without its ``TimeoutError`` left behind).

    That error is kept by a reference cycle through distributed's ``sync`` (a closure's cell) until the next
    garbage collection, and its traceback by then holds the frames it went through, each frame its caller: a
    checkpoint's frame, with the futures and the arrays whose lineage it cut. A checkpoint that nothing reads
    would look read, kept or retired only after a full collection (tens of milliseconds per commit).
    """
    try:
        wait(list(futures), timeout=timeout)
        return True
    except FuturesCancelledError as exc:  # cancelled by the cluster (a worker killed in a task): the caller reads
        traceback.clear_frames(exc.__traceback__)  # each future's status and says what failed, as for an error
        exc.__traceback__ = None
        return True
    except TimeoutError as exc:
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        return False
