"""The resilient loop in one process: cadence, resume after a crash, checkpoint and stop on a signal."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.resilient import ITERATION_ID
from ftidask.model.errors import FTIError


def _ctx(tmp: Path) -> ftidask.Context:
    return ftidask.init(ckpt_dir=tmp / "L", glbl_dir=tmp / "G", meta_dir=tmp / "M", verbosity=4)


def _run(tmp: Path, iterations: int, crash_at: int | None = None, signal_at: int | None = None) -> np.ndarray:
    ctx = _ctx(tmp)
    x = np.zeros(1000)

    @ftidask.resilient(ctx, arrays={1: x}, every=10, level=1, iterations=iterations, exit_on_signal=False)
    def step(i: int) -> None:
        if i == crash_at:
            raise RuntimeError("crash")
        x[:] = x * 1.01 + i
        if i == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)

    done = step()
    assert done == (iterations if signal_at is None else signal_at + 1)
    return x


def test_resume_after_crash_gives_the_same_result(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref", 45)
    with pytest.raises(RuntimeError):
        _run(tmp_path / "run", 45, crash_at=33)
    assert np.array_equal(_run(tmp_path / "run", 45), reference)


def test_signal_checkpoints_and_stops(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref", 45)
    _run(tmp_path / "run", 45, signal_at=14)  # stops after iteration 14, checkpoint "next = 15"
    ctx = _ctx(tmp_path / "run")
    assert ctx.status() == 1
    assert np.array_equal(_run(tmp_path / "run", 45), reference)


def test_reserved_id_and_bad_arguments(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(FTIError, match="reserved"):
        ftidask.ResilientLoop(ctx, arrays={ITERATION_ID: np.zeros(3)}, every=1,
                              iterations=3)
    with pytest.raises(FTIError, match="every"):
        ftidask.ResilientLoop(ctx, arrays={}, every=0, iterations=3)


def test_signal_on_another_rank_is_named_on_every_rank(tmp_path: Path, monkeypatch, caplog) -> None:
    """A rank that did not receive the signal logged 'signal None: checkpointed ...': every rank now names the
    signal and the rank that received it (here rank 1, simulated through the transport's allgather)."""
    ctx = _ctx(tmp_path)
    x = np.zeros(10)
    calls, real = [], ctx.transport.allgather

    def allgather(value):  # this process is rank 0; "rank 1" received SIGTERM at the loop's second check
        if not (isinstance(value, list) and value[:1] == ["ResilientLoop-stop"]):
            return real(value)  # a checkpoint's own agreement
        calls.append(value)
        return [value, ["ResilientLoop-stop", signal.SIGTERM if len(calls) >= 2 else None]]

    monkeypatch.setattr(ctx.transport, "allgather", allgather)
    caplog.set_level("WARNING", logger="ftidask")
    with ftidask.ResilientLoop(ctx, arrays={1: x}, every=10, level=1, iterations=100) as loop:
        for _i in loop:
            x += 1
    assert loop.stopped and ctx.last_checkpoint.id == 2 and x[0] == 2.0
    assert "SIGTERM on rank 1: checkpointed at iteration 2, stopping" in caplog.text, caplog.text
    assert "None" not in caplog.text
    ctx.finalize()


def test_a_failed_recovery_at_the_loops_start_restores_the_signal_handlers(tmp_path: Path) -> None:
    """A loop whose restart recovery is refused (an array of another size) runs nothing: its SIGTERM/SIGUSR1
    handlers stayed installed, and the process no longer died of SIGTERM."""
    ctx = _ctx(tmp_path)
    ctx.protect(1, np.zeros(10))
    ctx.checkpoint(1, 1)
    ctx._close()  # the program dies
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    again = _ctx(tmp_path)
    with pytest.raises(ftidask.RecoveryError):
        with ftidask.ResilientLoop(again, arrays={1: np.zeros(5)}, every=1, iterations=3):
            pass
    assert {sig: signal.getsignal(sig) for sig in before} == before
    again.finalize()


# --- found by a review: loops that resumed at the wrong iteration, or never -------------------------------------

def test_a_second_loop_on_one_context_is_refused(tmp_path: Path) -> None:
    """Two loops shared the counter's id: a restart resumed the first loop at the second one's iteration (wrong
    results, no error). One loop per context: the second (after the first, or inside it) is refused."""
    ctx = _ctx(tmp_path)
    x = np.zeros(3)
    with ftidask.ResilientLoop(ctx, arrays={1: x}, every=2, iterations=4) as loop:
        for _i in loop:
            with pytest.raises(FTIError, match="one loop per context"):
                ftidask.ResilientLoop(ctx, arrays={2: np.zeros(2)}, every=2, iterations=4)
            break
    with pytest.raises(FTIError, match="one loop per context"):
        ftidask.resilient(ctx, arrays={1: x}, every=2, iterations=4)(lambda i: None)()
    assert sorted(ctx.protected) == [1, ITERATION_ID]  # nothing of the refused loops


def _program(tmp: Path, crash_at: int | None, setup: bool) -> np.ndarray:
    """A loop over an array the program protected itself: first README's restart pattern (``if ctx.status():
    ctx.recover()``), or (``setup``) a checkpoint of its set-up data written once before the loop."""
    ctx = _ctx(tmp)
    u = np.zeros(4, np.int64)
    ctx.protect(1, u)
    if setup and ctx.status() == 0:
        u[:] = 100
        ctx.checkpoint(1, 1)
    elif not setup and ctx.status() != 0:
        ctx.recover()

    @ftidask.resilient(ctx, arrays={1: u}, every=10, iterations=40)
    def step(i: int) -> None:
        if i == crash_at:
            raise RuntimeError("crash")
        u[:] += i

    step()
    return u


def test_a_program_that_recovered_before_the_loop_resumes_it(tmp_path: Path) -> None:
    """The program's recover() set the status to 0: the loop started again at 0 on the recovered arrays."""
    with pytest.raises(RuntimeError):
        _program(tmp_path, 25, setup=False)
    assert _program(tmp_path, None, setup=False).tolist() == [sum(range(40))] * 4


def test_a_checkpoint_written_before_the_loop_starts_it_at_zero_with_its_data(tmp_path: Path) -> None:
    """The newest checkpoint (the set-up's) held no loop counter: every restart failed ("variable 2147480000 is
    protected but not in checkpoint file"). Its variables are recovered and the loop starts at 0."""
    with pytest.raises(RuntimeError):
        _program(tmp_path, 3, setup=True)
    assert _program(tmp_path, None, setup=True).tolist() == [100 + sum(range(40))] * 4


def test_a_generator_function_is_refused(tmp_path: Path) -> None:
    """Calling a generator function runs nothing: the loop reported its iterations done, having done none."""
    ctx = _ctx(tmp_path)

    def gen(i):
        yield i

    async def coro(i):
        return i

    class Stepper:  # an object whose __call__ is a generator function: found by a review, it ran nothing
        def __call__(self, i):
            yield i

    for fn in (gen, coro, Stepper()):
        with pytest.raises(FTIError, match="generator or coroutine function"):
            ftidask.resilient(ctx, arrays={}, every=2, iterations=4)(fn)


def test_a_body_that_returns_a_generator_is_refused_at_its_first_iteration(tmp_path: Path) -> None:
    """A plain function returning a generator (a lambda wrapping a generator function) runs nothing either."""
    ctx = _ctx(tmp_path)

    def gen(i):
        yield i

    loop = ftidask.resilient(ctx, arrays={}, every=2, iterations=4)(lambda i: gen(i))
    with pytest.raises(FTIError, match=r"<lambda>\(0\) returned a generator or coroutine"):
        loop()


def test_a_state_that_is_not_json_is_refused_before_anything_is_protected(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(ftidask.ProtectError, match="ResilientLoop"):
        ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, every=2, iterations=4, state={"when": object()})
    assert dict(ctx.protected) == {}
    with ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, every=2, iterations=4, state=ftidask.State(a=1)):
        pass  # the same context runs its loop afterwards


def test_a_loop_resumes_on_another_number_of_ranks(tmp_path: Path) -> None:
    """A loop's checkpoint (its arrays' blocks declared) restarted on fewer ranks: its counter was each rank's own
    (the restart refused, with stored_size's advice to declare the blocks, which the program had done). The counter
    is replicated now: the loop resumes after its last checkpointed iteration; with a per-rank generator it is
    refused saying why. Ranks are threads over the real engine (run_ranks), without signal handlers (a thread
    cannot install them)."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    def config(run: str):
        return load_config(None, ckpt_dir=str(tmp_path / run / "L"), glbl_dir=str(tmp_path / run / "G"),
                           meta_dir=str(tmp_path / run / "M"), local_test=1, node_size=1, verbosity=4)

    cfg, other = config("a"), config("b")

    def program(t, crash_at=None, rng=None, pre=False, cfg=cfg):
        ctx = Context(cfg, t)
        n = 12 // t.size
        u = np.arange(n * t.rank, n * (t.rank + 1), dtype=float)
        ctx.protect(1, u, global_shape=(12,), offset=(n * t.rank,))
        try:
            if pre and ctx.status():
                ctx.recover()  # the program recovers first: the loop takes its counter from the same checkpoint
            with ftidask.ResilientLoop(ctx, arrays={1: u}, every=3, iterations=10, signals=(), rng=rng) as loop:
                for i in loop:
                    if i == crash_at:
                        raise RuntimeError("crash")
                    u += 1
        except (RuntimeError, ftidask.RecoveryError) as exc:
            return str(exc)
        finally:
            ctx._close()
        return loop.start, u.tolist()

    assert run_ranks(cfg, 4, lambda t: program(t, crash_at=7), wait=60) == (["crash"] * 4, [])
    def done(size, start, shift=0.0):  # each rank's result: the loop's first iteration, the values after its last
        return [(start, list(np.arange(12 // size * r, 12 // size * (r + 1)) + 10.0 + shift)) for r in range(size)], []

    assert run_ranks(cfg, 2, program, wait=60) == done(2, 6)
    def setup(t):  # a checkpoint of the program's set-up data, before any loop: the loop starts at 0 with it
        ctx = Context(third, t)
        u = np.arange(3 * t.rank, 3 * t.rank + 3, dtype=float) - 10
        ctx.protect(1, u, global_shape=(12,), offset=(3 * t.rank,))
        ctx.checkpoint(1, 1)
        ctx._close()

    third = config("c")
    assert run_ranks(third, 4, setup, wait=60) == ([None] * 4, [])
    assert run_ranks(third, 2, lambda t: program(t, cfg=third), wait=60) == done(2, 0, -10.0)
    assert run_ranks(other, 4, lambda t: program(t, crash_at=4, cfg=other), wait=60) == (["crash"] * 4, [])
    assert run_ranks(other, 3, lambda t: program(t, pre=True, cfg=other), wait=60) == done(3, 3)
    results, errors = run_ranks(cfg, 3, lambda t: program(t, rng=np.random.default_rng(t.rank)), wait=60)
    assert errors == [] and len(set(results)) == 1, (results, errors)
    assert re.search(r"the resilient loop's checkpoint \d+ \(level 1\) was written by 2 rank\(s\), this run has 3: "
                     "a loop with rng= or state= resumes on the number of ranks that wrote it", results[0]), results[0]


@pytest.mark.parametrize("signals", [(99999,), (signal.SIGKILL,), "SIGTERM", (True,), 15])
def test_signals_a_handler_cannot_catch_are_refused_up_front(tmp_path: Path, signals) -> None:
    """``signals=(99999,)`` was a raw ValueError from signal.signal when the loop started; SIGKILL too."""
    ctx = _ctx(tmp_path)
    with pytest.raises(ftidask.FTIError, match="ResilientLoop: signals"):
        ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, every=1, iterations=3, signals=signals)
    assert 1 not in ctx.protected  # refused before any protect
    ctx.finalize()


def test_a_loop_in_another_thread_says_to_pass_no_signals(tmp_path: Path) -> None:
    """Python installs signal handlers from the main thread only: a raw ValueError at the loop's start before."""
    import threading

    ctx = _ctx(tmp_path)
    out: list[object] = []

    def body() -> None:
        try:
            ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, every=1, iterations=3)
        except ftidask.FTIError as exc:
            out.append(str(exc))
        x = np.zeros(3)
        with ftidask.ResilientLoop(ctx, arrays={1: x}, every=1, iterations=3, signals=()) as loop:
            for _i in loop:
                x += 1
        out.append(x[0])

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert len(out) == 2 and "main thread" in out[0] and "signals=()" in out[0] and out[1] == 3.0, out
    ctx.finalize()


def test_a_signal_in_the_last_iteration_checkpoints_the_loop_done(tmp_path: Path) -> None:
    """SIGTERM received in the last iteration was dropped: the loop ended normally, its handlers went, and the
    batch system's request to stop was never acted on. Now it is acted on as in any iteration: a checkpoint of the
    completed loop, ``stopped``; a restart runs no iteration."""
    ctx = _ctx(tmp_path)
    x = np.zeros(4)
    with ftidask.ResilientLoop(ctx, arrays={1: x}, every=10, iterations=5) as loop:
        for i in loop:
            x += 1
            if i == 4:
                os.kill(os.getpid(), signal.SIGTERM)
    assert loop.stopped and loop.last_checkpoint == 5 and ctx.last_checkpoint.id == 5
    ctx._close()  # the job ends there
    again = _ctx(tmp_path)
    y = np.zeros(4)
    with ftidask.ResilientLoop(again, arrays={1: y}, every=10, iterations=5) as loop:
        ran = list(loop)
    assert ran == [] and (y == 5).all() and not loop.stopped
    again.finalize()


def test_a_signal_the_loop_could_not_act_on_goes_to_the_handler_it_replaced(tmp_path: Path) -> None:
    """A loop left by ``break`` after SIGUSR1 arrived: the signal was swallowed with the loop's handler. It now
    reaches the handler that was there before the loop."""
    ctx = _ctx(tmp_path)
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        x = np.zeros(2)
        with ftidask.ResilientLoop(ctx, arrays={1: x}, every=10, iterations=5) as loop:
            for i in loop:
                if i == 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    break
        assert got == [signal.SIGUSR1] and not loop.stopped
    finally:
        signal.signal(signal.SIGUSR1, previous)
    ctx.finalize()
