"""A Ctrl-C at the worst moment of ``init`` (a notebook keeps the traceback, and with it every frame): the locks
taken so far are let go, so that the cell run again neither waits for ever nor starts a side run. Each window was
found by the notebook review's sweep of interrupts over ``init``."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.storage import runlock


def _config(base: Path) -> dict:
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 4}


def _open_on(name: str) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").endswith(name)
        except OSError:
            pass
    return count


def _left_unfinished(base: Path) -> str:
    """A run that committed checkpoint 1 and died (another process): its exec_id."""
    code = (f"import os, numpy as np, ftidask\nctx = ftidask.init(**{_config(base)!r})\n"
            "ctx.protect(1, np.full(10, 7.0))\nctx.checkpoint(1, 1)\nprint(ctx.exec_id, flush=True)\nos._exit(0)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()[-1]


def test_an_interrupt_once_the_run_is_being_chosen_lets_its_lock_go(tmp_path, monkeypatch):
    """The lock that makes inits choose their runs one at a time was held by a suspended generator when the
    Ctrl-C came right after it was taken: the traceback kept it, and the init run again waited for ever."""
    exec_id = _left_unfinished(tmp_path)
    real_enter = contextlib._GeneratorContextManager.__enter__

    def enter_then_interrupt(self):  # a generator's lock: the signal handled once next(gen) has returned
        value = real_enter(self)
        if self.gen.gi_code.co_name == "choosing":
            raise KeyboardInterrupt("Ctrl-C")
        return value

    kept = []  # what IPython keeps (sys.last_traceback): every frame of the interrupted init
    if not isinstance(runlock.choosing, type):  # (the generator it was: the window right after its yield)
        monkeypatch.setattr(contextlib._GeneratorContextManager, "__enter__", enter_then_interrupt)
        with pytest.raises(KeyboardInterrupt) as info:
            ftidask.init(**_config(tmp_path))
        kept.append(info)
        monkeypatch.undo()
        assert _open_on(runlock.CHOOSING_NAME) == 0

    def flock_then_interrupt(fd, op):  # the lock taken, the signal handled before __enter__ returns
        fcntl.flock(fd, op)
        if op == fcntl.LOCK_EX:  # the blocking wait of choosing(), not a run lock's LOCK_NB
            raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(runlock, "fcntl", types.SimpleNamespace(flock=flock_then_interrupt, LOCK_EX=fcntl.LOCK_EX,
                                                                LOCK_NB=fcntl.LOCK_NB))
    with pytest.raises(KeyboardInterrupt) as info:
        ftidask.init(**_config(tmp_path))
    kept.append(info)
    monkeypatch.undo()
    assert _open_on(runlock.CHOOSING_NAME) == 0
    ctx = ftidask.init(**_config(tmp_path))  # waited for ever before
    ctx.protect(1, a := np.zeros(10))
    assert (ctx.status(), ctx.exec_id) == (1, exec_id)
    ctx.recover()
    assert (a == 7.0).all()
    ctx.finalize()


def test_an_interrupt_once_the_run_lock_is_taken_lets_it_go(tmp_path, monkeypatch):
    """Between flock and the lock's registration (its holder record written), a Ctrl-C leaked the locked
    descriptor: the init run again started a side run (status 0) and another process could not restart the run."""
    exec_id = _left_unfinished(tmp_path)

    def interrupted():
        raise KeyboardInterrupt("Ctrl-C")

    monkeypatch.setattr(runlock, "socket", types.SimpleNamespace(gethostname=interrupted))
    with pytest.raises(KeyboardInterrupt) as info:
        ftidask.init(**_config(tmp_path))
    monkeypatch.setattr(runlock, "socket", socket)
    assert info.traceback  # kept, as a notebook keeps it
    assert _open_on(runlock.LOCK_NAME) == 0
    ctx = ftidask.init(**_config(tmp_path))
    ctx.protect(1, np.zeros(10))
    assert (ctx.status(), ctx.exec_id) == (1, exec_id)
    ctx.finalize()
