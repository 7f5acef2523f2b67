"""The resilient loop in one process: cadence, resume after a crash, checkpoint and stop on a signal."""

from __future__ import annotations

import os
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
