"""A context makes one API call at a time (ftidask/api/callguard.py).

Before: two threads checkpointing one context (or a SIGTERM handler checkpointing while the program was inside
``checkpoint``) took the same sequence number, collected each other's files and committed records over each other:
a restart found no checkpoint at all. Calls of other threads now wait their turn; a call re-entered on the thread
whose call is in progress (a signal handler) is refused with an FTIError, and the call it interrupted fails as an
interrupted checkpoint does (the previous one kept).
"""

from __future__ import annotations

import gc
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine import checkpointing
from ftidask.storage import runlock


def _paused_writes(monkeypatch, thread_name: str, at_pause=None):
    """Checkpoints of thread ``thread_name`` pause inside their file's write until released (a test seam)."""
    paused, resume = threading.Event(), threading.Event()
    write = checkpointing.write_ftiff

    def hooked(*args, **kwargs):
        if threading.current_thread().name == thread_name:
            paused.set()
            if at_pause is not None:
                at_pause()
            else:
                resume.wait(60)
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "write_ftiff", hooked)
    return paused, resume


def _checkpoint_paused_in_another_thread(dirs, monkeypatch):
    """A context whose checkpoint 2, made by thread "first", is paused inside its write: (context, thread, resume)."""
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    paused, resume = _paused_writes(monkeypatch, "first")
    worker = threading.Thread(target=ctx.checkpoint, args=(2, 1), name="first")
    worker.start()
    assert paused.wait(60)
    return ctx, worker, resume


def test_a_checkpoint_of_another_thread_waits_for_the_one_in_progress(dirs, monkeypatch):
    ctx = ftidask.init(**dirs)
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    paused, resume = _paused_writes(monkeypatch, "first")
    done: dict[str, object] = {}

    def run(name: str, ckpt_id: int) -> None:
        try:
            done[name] = ctx.checkpoint(ckpt_id, 1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            done[name] = exc

    first = threading.Thread(target=run, args=("first", 2), name="first")
    second = threading.Thread(target=run, args=("second", 3), name="second")
    first.start()
    assert paused.wait(60)
    second.start()
    second.join(1.0)
    assert "second" not in done  # waits for the first (before: it ran, and retired what the first was writing)
    resume.set()
    first.join(60)
    second.join(60)
    assert isinstance(done["first"], ftidask.CheckpointInfo) and isinstance(done["second"], ftidask.CheckpointInfo)
    ctx._close()
    again = ftidask.init(**dirs)
    back = np.zeros(1000)
    again.protect(1, back)
    again.recover()
    assert again.recovered_from == (3, 1) and back.tobytes() == a.tobytes()
    again.finalize()


@pytest.mark.parametrize(("call", "during"), [("checkpoint", "checkpoint"), ("finalize", "checkpoint"),
                                              ("checkpoint", "snapshot")])
def test_a_signal_handler_calling_the_context_during_a_checkpoint_is_refused(dirs, monkeypatch, call, during):
    """``during`` snapshot(): its own checkpoint is a call it makes itself, allowed; the handler's is not (the
    first guard let any call through while snapshot's ran)."""
    ctx = ftidask.init(**dirs, **({"ckpt_l1": 1, "snapshot_unit": "iterations"} if during == "snapshot" else {}))
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    refused: list[BaseException] = []

    def handler(signum, frame):
        try:
            ctx.checkpoint(99, 1) if call == "checkpoint" else ctx.finalize()
        except ftidask.FTIError as exc:
            refused.append(exc)
            raise

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        _paused_writes(monkeypatch, threading.current_thread().name,
                       at_pause=lambda: signal.raise_signal(signal.SIGUSR1))
        a[:] = -1
        with pytest.raises(ftidask.FTIError):
            ctx.checkpoint(2, 1) if during == "checkpoint" else ctx.snapshot()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(refused) == 1 and f"{call}() was called while {during}() of this context is in progress on the " \
        "same thread (from a signal handler?)" in str(refused[0])
    monkeypatch.undo()
    assert not ctx.finalized  # the context goes on: the previous checkpoint is the newest, the next one works
    ctx.recover()
    assert ctx.recovered_from == (1, 1) and a.tobytes() == np.arange(1000.0).tobytes()
    ctx.checkpoint(3, 1)
    ctx.finalize()


def test_an_init_whose_claim_fails_releases_the_run_lock_at_once(dirs):
    """Before: the lock was held by the failed claim's frames, kept by the error's traceback (a notebook keeps the
    last one): another process saw the run in use until the garbage collector ran."""
    (Path(dirs["meta_dir"]) / "r15" / "run.json").mkdir(parents=True)  # run.json cannot be written
    gc.disable()
    try:
        with pytest.raises(ftidask.FTIError) as refused:
            ftidask.init(**dirs, exec_id="r15")
        assert not runlock.held_here(Path(dirs["meta_dir"]) / "r15"), refused.value
    finally:
        gc.enable()


def test_a_process_forked_while_another_thread_makes_a_call_is_not_blocked_by_it(dirs, monkeypatch):
    """Before: the child waited for ever for the guard of a call made by a thread that is not in the child."""
    import os

    ctx, worker, resume = _checkpoint_paused_in_another_thread(dirs, monkeypatch)
    pid = os.fork()
    if pid == 0:  # the child: a call returns (refused or done) instead of waiting
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # (pytest-timeout's handler would raise, and be caught)
        signal.alarm(10)
        try:
            ctx.wait()
        except BaseException:  # noqa: BLE001 - only a wait for ever is wrong here
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    resume.set()
    worker.join(60)
    assert os.waitstatus_to_exitcode(status) == 0
    ctx.finalize()


def test_a_with_block_left_by_an_error_waits_for_another_threads_call(dirs, monkeypatch):
    """Before: the context was closed (its run lock released) under another thread's checkpoint, which committed
    after a new run had taken the run over."""
    ctx, worker, resume = _checkpoint_paused_in_another_thread(dirs, monkeypatch)
    closed = threading.Event()

    def leave_with_an_error() -> None:
        with pytest.raises(RuntimeError), ctx:
            raise RuntimeError("the application failed")
        closed.set()

    leaving = threading.Thread(target=leave_with_an_error)
    leaving.start()
    assert not closed.wait(1.0) and not ctx.finalized  # waits for the checkpoint in progress
    resume.set()
    worker.join(60)
    leaving.join(60)
    assert closed.is_set() and ctx.finalized
    again = ftidask.init(**dirs)
    again.protect(1, np.zeros(10))
    again.recover()
    assert again.recovered_from == (2, 1)
    again.finalize()
