"""Checkpoints in flight: the handle an asynchronous checkpoint returns, and the one background thread
that finishes them in order.

Why one thread and a FIFO: checkpoints of a run depend on each other (the next file's layout starts
from the last one's containers, a differential checkpoint patches the spare the previous one left, a
commit retires what came before), so they are finished one after the other, in the order the
application asked for them, on every rank alike. At most ``max_inflight`` are queued or running; the
next call waits for the oldest.

A failure is never lost: the handle raises it (``result``, ``wait``, ``exception`` return or raise
it), and if nobody asked the handle, the context raises it at its next ``checkpoint``, ``wait``,
``snapshot`` or ``finalize`` call (:meth:`Inflight.raise_unobserved`), once.
"""

from __future__ import annotations

import collections
import concurrent.futures.thread  # noqa: F401 - its exit hook registered first: ours runs before it (see below)
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..model.errors import CheckpointError
from .checkpointing import CheckpointInfo

log = logging.getLogger("ftidask")


class CheckpointHandle:
    """An asynchronous checkpoint: ``checkpoint(..., wait=False)`` returns it once the snapshot is taken.

    ``mechanism`` says how the snapshot was taken: ``"cow"`` (copy-on-write: the application's pages
    are copied aside only when it writes them before they are written out), ``"copy"`` (copied into
    staging buffers at the call), ``"blocking"`` (neither could be used: the checkpoint was written
    before the call returned), or ``"immutable"`` on Dask (chunks never change: no snapshot is needed).
    """

    def __init__(self, ckpt_id: int, level: int, mechanism: str, future: Future[CheckpointInfo]) -> None:
        self.ckpt_id, self.level, self.mechanism = ckpt_id, level, mechanism
        self._future = future
        self._observed = False
        self._pid = os.getpid()

    def _ours(self) -> None:
        if os.getpid() != self._pid:  # a forked child's copy: the parent finishes the checkpoint, not this process
            raise CheckpointError(f"checkpoint {self.ckpt_id} is written by the process this one was forked from: "
                                  "ask its handle there")

    def done(self) -> bool:
        """Whether the checkpoint is committed or has failed (never blocks)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit: the checkpoint's :class:`CheckpointInfo`, or its error raised
        (:class:`CheckpointError`; the previous checkpoint stays recoverable)."""
        self._observed = True
        self._ours()
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """:meth:`result` under FTI's name."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the end: the checkpoint's error, or None when it was committed."""
        self._observed = True
        self._ours()
        return self._future.exception(timeout)

    def settled(self) -> None:
        """Wait for the end without taking the outcome (an unobserved failure stays for the next call)."""
        self._future.exception()

    @property
    def observed(self) -> bool:
        """Whether the application has asked for the outcome (an unobserved failure is raised later)."""
        return self._observed

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "committed")
        return f"<ftidask.CheckpointHandle id={self.ckpt_id} level={self.level} {self.mechanism} {state}>"


_LIVE: weakref.WeakSet[Inflight] = weakref.WeakSet()


def _finish_at_exit() -> None:
    """At the interpreter's exit, before thread pools refuse new work (concurrent.futures' own exit hook,
    registered earlier, runs after this one): the checkpoints in flight are finished, not failed."""
    for inflight in list(_LIVE):
        inflight.drain()


# threading's exit hooks run before the interpreter joins its threads, the last registered first.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_at_exit)


def _forget_in_child() -> None:
    """A child forked while checkpoints were in flight has their queue but not the thread that finishes them (the
    parent does), and maybe a condition the parent's thread held at the fork: it waited for them for ever at its exit.
    The child forgets them; its context writes no checkpoint (the run's files are the parent's)."""
    for inflight in list(_LIVE):
        inflight._cond = threading.Condition()
        inflight._jobs.clear()
        inflight._handles.clear()
        inflight._thread = None
        inflight._kept = None
        inflight._stop = True
        inflight._forked = True


os.register_at_fork(after_in_child=_forget_in_child)


class Inflight:
    """The background thread of one context and the checkpoints it has not finished."""

    def __init__(self, max_inflight: int = 1) -> None:
        self.max_inflight = max(1, int(max_inflight))
        self._handles: collections.deque[CheckpointHandle] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], CheckpointInfo], Future[CheckpointInfo]]] = (
            collections.deque())
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None  # alive while jobs are queued
        self._stop = False
        self._forked = False  # this process is a child forked from the context's (see _forget_in_child)
        self._owner: Callable[[], Any] = lambda: None  # what the jobs write for (weak: see keep_while_busy)
        self._kept: Any = None  # the owner, held while jobs are queued
        _LIVE.add(self)

    def keep_while_busy(self, owner: Any) -> None:
        """Hold ``owner`` (the context) alive while checkpoints are queued or being written. A context dropped
        without finalize (a function that raised, a notebook's ``del ctx``) was collected with a checkpoint in flight:
        its run lock was released under the job, and a new init of the run collected the job's renamed files as an
        interrupted checkpoint's; the job's commit then named files gone and retired the previous checkpoint."""
        self._owner = weakref.ref(owner)

    def submit(self, job: Callable[[], CheckpointInfo], ckpt_id: int, level: int, mechanism: str) -> CheckpointHandle:
        """Queue ``job`` (it writes and commits one checkpoint) behind those in flight; its handle."""
        future: Future[CheckpointInfo] = Future()
        handle = CheckpointHandle(ckpt_id, level, mechanism, future)
        with self._cond:
            if self._forked:
                raise CheckpointError("this process was forked from the one whose context this is: it writes the "
                                      "run's checkpoints, not this one")
            if self._stop:
                raise CheckpointError("the context is finalized")
            self._handles.append(handle)
            self._jobs.append((job, future))
            self._kept = self._owner()
            if self._thread is None:
                # Not a daemon, and gone when the queue is empty: at exit the interpreter waits for the
                # checkpoints queued (_finish_at_exit), and a context never finalized does not keep it alive.
                self._thread = threading.Thread(target=self._serve, name="ftidask-checkpoint", daemon=False)
                self._thread.start()
            self._cond.notify_all()
        return handle

    def done_now(self, ckpt_id: int, level: int, mechanism: str,
                 job: Callable[[], CheckpointInfo]) -> CheckpointHandle:
        """Run ``job`` here and now (nothing may be in flight); a finished handle with its outcome."""
        future: Future[CheckpointInfo] = Future()
        handle = CheckpointHandle(ckpt_id, level, mechanism, future)
        future.set_running_or_notify_cancel()
        try:
            future.set_result(job())
        except Exception as exc:  # the handle's to raise (an interrupt propagates)
            future.set_exception(exc)
            with self._cond:
                self._handles.append(handle)
        return handle

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._thread = None
                    kept, self._kept = self._kept, None
                    break
                job, future = self._jobs[0]
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as exc:  # every error is the handle's (and the next call's) to raise
                    future.set_exception(exc)
                    log.warning("asynchronous checkpoint failed: %s", exc)
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()
        del kept  # the owner let go outside the lock: its collection may close it

    def holds(self, job: Callable[[], CheckpointInfo]) -> bool:
        """Whether ``job`` is queued or running (a submit interrupted once it was queued: the job goes on)."""
        with self._cond:
            return any(queued is job for queued, _future in self._jobs)

    @property
    def busy(self) -> bool:
        """Whether a checkpoint is queued or being written."""
        with self._cond:
            return bool(self._jobs)

    def throttle(self) -> None:
        """Before a new checkpoint: wait until fewer than ``max_inflight`` are in flight."""
        with self._cond:
            while len(self._jobs) >= self.max_inflight:
                self._cond.wait()

    def make_room(self) -> None:
        """Before a new asynchronous checkpoint: raise an unobserved failure, wait until fewer than
        ``max_inflight`` are in flight, then raise the failure of one waited for."""
        self.raise_unobserved()
        self.throttle()
        self.raise_unobserved()

    def drain(self) -> None:
        """Wait until every checkpoint in flight is committed or has failed."""
        with self._cond:
            while self._jobs:
                self._cond.wait()

    def raise_unobserved(self) -> None:
        """Raise the first failure nobody asked its handle for (once), forgetting finished handles."""
        failed: CheckpointHandle | None = None
        with self._cond:
            while self._handles and self._handles[0].done():
                handle = self._handles.popleft()
                if failed is None and not handle.observed and handle._future.exception() is not None:
                    failed = handle
        if failed is not None:
            failed._observed = True
            exc = failed._future.exception()
            if isinstance(exc, CheckpointError):
                raise CheckpointError(f"asynchronous checkpoint {failed.ckpt_id} (level {failed.level}) "
                                      f"failed: {exc}") from exc
            raise CheckpointError(f"asynchronous checkpoint {failed.ckpt_id} (level {failed.level}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def settle(self) -> None:
        """Wait for every checkpoint in flight, then raise the first unobserved failure."""
        self.drain()
        self.raise_unobserved()

    def close(self) -> None:
        """Finish what is queued and stop the thread (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
