"""Resilient loops: checkpoint an iteration loop every N steps, resume it after a restart, stop cleanly on signals.

::

    with ftidask.init(cfg, comm=MPI.COMM_WORLD) as ctx:
        @ftidask.resilient(ctx, arrays={1: u}, every=50, level=2, iterations=1000)
        def step(i):
            ...  # one iteration, updating u in place
        last = step()          # runs iterations [resume point, 1000)

or, as a context manager::

    with ftidask.ResilientLoop(ctx, arrays={1: u}, every=50, level=2, iterations=1000) as loop:
        for i in loop:
            ...

On a restart (``ctx.status() != 0``) the arrays are recovered and the loop resumes after the
last checkpointed iteration. The loop's counter is checkpointed with them, and so are, if given,
a NumPy random generator (``rng=``: it continues the exact same stream) and a dict of JSON values
(``state=``, e.g. an ``ftidask.State``), all recovered in place (see :mod:`ftidask.engine.pystate`).
``arrays`` may hold Python states too (``ftidask.Value``, ``ftidask.State``, generators). When the job
is told its time is up (SIGTERM or SIGUSR1, as batch schedulers send before the walltime), every rank
finishes its current iteration, the ranks agree, a checkpoint is written and the loop stops: the
decorator then exits the process with status 0 (``exit_on_signal``), the context manager sets ``loop.stopped``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..engine.pystate import Value, check_json
from ..model.errors import FTIError, RecoveryError
from ..transport.collective import agree_call

if TYPE_CHECKING:  # for the signatures only: context.py does not import this module
    from .context import Context

log = logging.getLogger("ftidask")

#: Variable id of the loop's own counter (next iteration to run); user ids must differ.
ITERATION_ID = 2_147_480_000
RNG_ID = ITERATION_ID + 1  #: the loop's ``rng=`` (a numpy.random Generator or BitGenerator)
STATE_ID = ITERATION_ID + 2  #: the loop's ``state=`` (a dict of JSON values)
RESERVED_IDS = (ITERATION_ID, RNG_ID, STATE_ID)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_LOOPS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # the contexts that made a loop


class ResilientLoop:
    """Iterate ``range(iterations)`` with checkpoints every ``every`` iterations at ``level``.

    ``with ResilientLoop(ctx, arrays={1: u}, every=50, iterations=1000) as loop: for i in loop: ...``: on a
    restart the arrays (and ``rng``, ``state``, as for :func:`resilient`) are recovered and the loop resumes after
    the last checkpointed iteration. Every ``check_every`` iterations the ranks agree whether one received one of
    ``signals`` (SIGTERM, SIGUSR1; ``()`` in a thread other than the main one, where Python installs no handler); if
    so, a checkpoint at ``stop_level`` (default: ``level``) is written (unless that iteration was just checkpointed),
    the loop ends and ``loop.stopped`` is True. The last iteration is looked at too (its checkpoint says the loop is
    done: a restart runs no iteration). A signal the loop could not act on (received after that, or when the loop is
    left by an exception or ``break``) is delivered to the handler it replaced when the loop exits.
    """

    def __init__(self, ctx: Context, *, arrays: Mapping[int, Any], every: int, level: int = 1,
                 iterations: int, stop_level: int | None = None, signals: tuple[int, ...] = STOP_SIGNALS,
                 check_every: int = 1, rng: Any = None, state: dict[str, Any] | None = None) -> None:
        if not callable(getattr(ctx, "protect", None)) or not callable(getattr(ctx, "_check_level", None)):
            raise FTIError(f"ResilientLoop: ctx must be the context ftidask.init() returns, got {type(ctx).__name__}")

        def check() -> tuple[dict[str, Any], None]:
            if not isinstance(arrays, Mapping):  # before: "'int' object is not iterable", or ctx's AttributeError
                raise FTIError(f"ResilientLoop: arrays must be a dict of variable id -> array, got "
                               f"{type(arrays).__name__}")
            for value in (level, level if stop_level is None else stop_level):
                ctx._check_level(value)  # LevelError now, not at the first checkpoint, iterations later
            for what, value in (("every", every), ("iterations", iterations), ("check_every", check_every)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):  # "10" fails a comparison
                    raise FTIError(f"ResilientLoop: {what} must be an int, got {value!r}")
            if rng is not None and not isinstance(rng, (np.random.Generator, np.random.BitGenerator)):
                raise FTIError(f"ResilientLoop: rng must be a numpy.random.Generator or BitGenerator, got {rng!r}")
            if state is not None and not isinstance(state, dict):
                raise FTIError(f"ResilientLoop: state must be a dict of JSON values, got {type(state).__name__}")
            if state is not None:  # before any protect: a refused state left the arrays protected without a loop
                check_json(dict(state), "ResilientLoop(state=...)")
            if every < 1 or iterations < 0 or check_every < 1:
                raise FTIError(f"ResilientLoop: every={every}, check_every={check_every} must be >= 1 and "
                               f"iterations={iterations} >= 0")
            if ctx in _LOOPS:  # its counter would replace the first one's: a restart resumed either at the other's
                raise FTIError("ResilientLoop: this context ran a resilient loop already; one loop per context (a "
                               "restart could not tell two loops' checkpoints apart and would resume the first at "
                               "the second's iteration): make one loop whose body does each phase, or init anew")
            _check_signals(signals)
            taken = sorted(set(arrays) & set(RESERVED_IDS))
            if taken:
                raise FTIError(f"variable ids {taken} are reserved for the loop (counter, rng, state): use other ids")
            return {"every": int(every), "iterations": int(iterations), "check_every": int(check_every),
                    "level": str(level), "stop_level": str(stop_level)}, None

        # Collective: the ranks check and compare the loop's schedule before any protect; one rank's own value
        # (or refusal) would make it checkpoint at other iterations than the others, in calls they never make.
        transport = getattr(ctx, "transport", None)
        if transport is not None:  # (one rank: agree_call is the check alone)
            agree_call(transport, "ResilientLoop", check, FTIError)
        else:
            check()
        self.ctx, self.every, self.level, self.iterations = ctx, every, level, iterations
        self.stop_level = level if stop_level is None else stop_level
        self.signals, self.check_every = tuple(signals), check_every
        self.counter = Value(0)  # the next iteration to run, checkpointed with the arrays
        before = dict(ctx.variables)
        try:
            for vid, array in arrays.items():
                ctx.protect(vid, array)
            # Replicated (every rank runs the same iterations): a restart on another number of ranks reads it too
            replicated = {"replicated": True} if "replicated" in inspect.signature(ctx.protect).parameters else {}
            ctx.protect(ITERATION_ID, self.counter, name="ftidask.loop.next_iteration", **replicated)
            if rng is not None:
                ctx.protect(RNG_ID, rng, name="ftidask.loop.rng")
            if state is not None:
                ctx.protect(STATE_ID, state, name="ftidask.loop.state")
        except BaseException:  # a refused array: no loop, so none of its protects stays (a checkpoint wrote them)
            ctx.variables.clear()
            ctx.variables.update(before)
            raise
        _LOOPS[ctx] = True
        self.start = 0
        self.stopped = False  # True when a signal ended the loop early
        self.last_checkpoint: int | None = None
        self._signalled: int | None = None
        self._moved = False  # the checkpoint resumed is one of another number of ranks (redistributed)
        self._old: dict[int, Any] = {}

    # --- signals ---------------------------------------------------------------------------------

    def _handler(self, signum: int, frame: types.FrameType | None) -> None:
        self._signalled = signum  # acted upon between iterations, never inside one

    def __enter__(self) -> ResilientLoop:
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._handler)
        try:
            self._resume()
        except BaseException:  # no loop runs: its handlers go (left, SIGTERM no longer ended the process)
            self.__exit__()
            raise
        return self

    def _resume(self) -> None:
        """On a restart, the loop's checkpoint recovered and :attr:`start` set after its last iteration."""
        ctx = self.ctx
        if ctx.status() != 0:
            if not self._holds_counter():  # written before the loop's first one (the program's set-up data)
                ids = [vid for vid in ctx.protected if vid not in RESERVED_IDS]
                if ids:
                    self._recover_only(ids)
                log.info("restart: recovered checkpoint %s, written before the loop's first: starting at iteration 0",
                         ctx.recovered_from)
                return
            ctx.recover()
        elif ctx.recovered_from is not None and int(self.counter.value) == 0:
            # The program recovered before the loop protected its counter (``if ctx.status(): ctx.recover()``): the
            # status is 0 since, and the loop's own values come from the same checkpoint, if it holds them.
            if not self._holds_counter():
                return
            self._recover_only([vid for vid in RESERVED_IDS if vid in ctx.protected], *ctx.recovered_from)
        else:
            return
        self.start = int(self.counter.value)
        ckpt_id, level = ctx.recovered_from or (None, None)
        log.info("restart: recovered checkpoint %s (level %s), resuming at iteration %d", ckpt_id, level, self.start)

    def _recover_only(self, ids: list[int], *which: int) -> None:
        """recover(``*which``) of the variables ``ids`` only. On another number of ranks, where recover(ids=...) is
        refused (it recovers on the checkpoint's own layout), the other variables are left out of the recovery."""
        ctx = self.ctx
        if not self._moved:
            ctx.recover(*which, ids=ids)
            return
        before = dict(ctx.variables)
        ctx.variables.clear()
        ctx.variables.update({vid: p for vid, p in before.items() if vid in ids})
        try:
            ctx.recover(*which)
        finally:
            ctx.variables.clear()
            ctx.variables.update(before)

    def _holds_counter(self) -> bool:
        """Whether the checkpoint a restart recovers holds the loop's counter (collective). One of another number of
        ranks is redistributed: the counter is replicated, but the loop's generator and state are each rank's own,
        which no redistribution can share out (refused, saying so: stored_size's own error told to declare the
        arrays' blocks)."""
        try:
            return self.ctx.stored_size(ITERATION_ID) != 0
        except RecoveryError as exc:
            record = getattr(exc, "redistributed", None)
            if record is None:
                raise
            if RNG_ID not in self.ctx.protected and STATE_ID not in self.ctx.protected:
                self._moved = True
                return ITERATION_ID in self.ctx._stored_names()  # the old files' tables (a checkpoint of set-up data)
            raise RecoveryError(f"the resilient loop's checkpoint {record.ckpt_id} (level {record.level}) was written "
                                f"by {record.nranks} rank(s), this run has {self.ctx.transport.size}: a loop with rng= "
                                "or state= resumes on the number of ranks that wrote it (its random generator and "
                                f"state are each rank's own). Restart on {record.nranks} rank(s) (without them, its "
                                "counter and the arrays whose blocks are declared are redistributed)") from None

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if self._signalled is not None and not self.stopped:  # received after the loop's last look (or in a loop
            # left by an exception or a break): delivered to the handler it was taken from, as if never deferred
            signum, self._signalled = self._signalled, None
            signal.raise_signal(signum)

    # --- the loop ----------------------------------------------------------------------------------

    def _stop_requested(self) -> str:
        """Which rank received which signal (e.g. ``"SIGTERM on rank 0"``), '' when none did. Ranks receive the
        signal at different moments: they agree, so that all checkpoint together, and all name the same one."""
        t = self.ctx.transport
        got = t.allgather(["ResilientLoop-stop", self._signalled])  # tagged: never taken for another rank's call
        if any(not (isinstance(g, list) and len(g) == 2 and g[0] == "ResilientLoop-stop") for g in got):
            raise FTIError("the ranks made different collective calls: some check the loop's stop signals, others "
                           "make another call (every rank runs the loop with the same every, check_every and "
                           "iterations)")
        rank, signum = next(((r, g[1]) for r, g in enumerate(got) if g[1] is not None), (None, None))
        if signum is None:
            return ""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"{name} on rank {rank}"

    def _checkpoint(self, next_iteration: int, level: int) -> None:
        self.counter.value = next_iteration
        self.ctx.checkpoint(next_iteration, level)
        self.last_checkpoint = next_iteration

    def __iter__(self) -> Iterator[int]:
        for i in range(self.start, self.iterations):
            yield i
            done = i + 1
            if done % self.every == 0 and done < self.iterations:
                self._checkpoint(done, self.level)
            # The last iteration looks too: a signal received in it is acted on as in any other (a checkpoint of the
            # loop completed, ``stopped``), never dropped once the loop's handlers are gone.
            received = self._stop_requested() if done % self.check_every == 0 or done == self.iterations else ""
            if received:
                if self.last_checkpoint != done:
                    self._checkpoint(done, self.stop_level)
                log.warning("%s: checkpointed at iteration %d, stopping", received, done)
                self.stopped = True
                return


def _check_signals(signals: Any) -> None:
    """``signals``: signal numbers Python can catch, installed from the main thread; else an FTIError now (before: a
    raw ValueError when the loop started)."""
    if isinstance(signals, (str, bytes)) or not isinstance(signals, (tuple, list, frozenset, set)):
        raise FTIError(f"ResilientLoop: signals must be a tuple of signal numbers (e.g. (signal.SIGTERM,)), got "
                       f"{signals!r}")
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, (int, np.integer)) or sig not in signal.valid_signals() \
                or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise FTIError(f"ResilientLoop: signals: {sig!r} is not a signal a handler can catch (SIGKILL and "
                           "SIGSTOP cannot be caught)")
    if signals and threading.current_thread() is not threading.main_thread():
        raise FTIError("ResilientLoop: signal handlers can be installed from the main thread only (Python's signal "
                       "module); in another thread pass signals=()")


def resilient(ctx: Context, *, arrays: Mapping[int, Any], every: int, level: int = 1, iterations: int,
              stop_level: int | None = None, exit_on_signal: bool = True, check_every: int = 1,
              rng: Any = None, state: dict[str, Any] | None = None, signals: tuple[int, ...] = STOP_SIGNALS
              ) -> Callable[[Callable[[int], Any]], Callable[[], int]]:
    """Decorate ``fn(i)`` (one iteration) into a resilient loop; calling it runs the loop.

    ``rng`` (a ``numpy.random.Generator``) and ``state`` (a dict of JSON values) are checkpointed
    with the arrays and the loop counter, and recovered in place on a restart. ``stop_level``,
    ``check_every`` and ``signals`` (default SIGTERM and SIGUSR1; ``()`` outside the main thread) are
    :class:`ResilientLoop`'s.

    The call returns the number of iterations done in total (``iterations`` unless stopped by a
    signal); with ``exit_on_signal`` a stopped loop finalizes nothing and exits with status 0
    (the checkpoint stays for the next job).
    """

    def wrap(fn: Callable[[int], Any]) -> Callable[[], int]:
        call = fn if inspect.isroutine(fn) else getattr(type(fn), "__call__", fn)  # an object's: its __call__'s
        if any(test(f) for f in (fn, call) for test in (inspect.isgeneratorfunction, inspect.iscoroutinefunction,
                                                         inspect.isasyncgenfunction)):
            raise FTIError(f"resilient: {getattr(fn, '__name__', fn)} is a generator or coroutine function: calling "
                           "it runs nothing; decorate a plain function of one iteration, fn(i)")

        @functools.wraps(fn)
        def run() -> int:
            loop = ResilientLoop(ctx, arrays=arrays, every=every, level=level, iterations=iterations,
                                 stop_level=stop_level, check_every=check_every, rng=rng, state=state,
                                 signals=signals)
            with loop:
                for i in loop:
                    if inspect.isgenerator(out := fn(i)) or inspect.isawaitable(out) or inspect.isasyncgen(out):
                        raise FTIError(f"resilient: {getattr(fn, '__name__', fn)}({i}) returned a generator or "
                                       "coroutine, which runs nothing; decorate a plain function of one iteration")
            if loop.stopped:
                if exit_on_signal:
                    raise SystemExit(0)
                return int(loop.counter.value)
            return iterations

        return run

    return wrap
