"""Cells run again in a notebook: ``ftidask.init`` again in the same process on the same run (the first context
never finalized), ``protect`` of an id with another array, checkpoint ids reused or going back, ``recover()``
after checkpoints; and how a context shows itself (repr, _repr_html_) whatever state it is in."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine.runstate import RunState


def _config(base: Path, **kw) -> dict:
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 4,
            **kw}


def _record_held_back(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The background thread's commit record held back (``renamed`` set: its file renamed into place, the record not
    written) until ``go_on`` is set."""
    renamed, go_on = threading.Event(), threading.Event()
    write_record = RunState.write_record

    def record_later(self, record):
        if threading.current_thread() is not threading.main_thread():
            renamed.set()
            go_on.wait(5)
        return write_record(self, record)

    monkeypatch.setattr(RunState, "write_record", record_later)
    return renamed, go_on


def test_init_again_while_a_checkpoint_is_in_flight_keeps_that_checkpoint(tmp_path, monkeypatch):
    """The new init collected the files of the old context's checkpoint in flight (renamed, not yet committed) as
    garbage: that checkpoint was then committed naming files gone, reported written, and it retired the previous
    one: nothing was left to recover."""
    a_ctx = ftidask.init(**_config(tmp_path, async_snapshot="copy"))
    a = np.full(100_000, 1.0)
    a_ctx.protect(1, a)
    a_ctx.checkpoint(1, 1)
    renamed, go_on = _record_held_back(monkeypatch)
    a[:] = 2.0
    handle = a_ctx.checkpoint(2, 1, wait=False)
    assert renamed.wait(30)
    threading.Timer(0.5, go_on.set).start()  # the old code's init does not wait for it
    b_ctx = ftidask.init(**_config(tmp_path, async_snapshot="copy"))  # the init cell run again
    go_on.set()
    assert handle.result().id == 2
    b = np.zeros(100_000)
    b_ctx.protect(1, b)
    assert b_ctx.status() == 1
    b_ctx.recover()
    assert b_ctx.recovered_from == (2, 1) and (b == 2.0).all()
    b_ctx.finalize()


def test_a_context_dropped_with_a_checkpoint_in_flight_lives_until_it_is_committed(tmp_path, monkeypatch):
    """A context dropped without finalize (``del ctx``, a function that raised) while its checkpoint was in flight
    was collected: its run lock released under the job, the new init took the job's renamed file for an interrupted
    checkpoint's and removed it; the job's commit then named a file gone and retired checkpoint 1 (nothing left)."""
    import gc
    import weakref
    old = ftidask.init(**_config(tmp_path, async_snapshot="copy"))
    a = np.full(100_000, 1.0)
    old.protect(1, a)
    old.checkpoint(1, 1)
    renamed, go_on = _record_held_back(monkeypatch)
    a[:] = 2.0
    old.checkpoint(2, 1, wait=False)  # the handle not kept
    assert renamed.wait(30)
    dropped = weakref.ref(old)
    del old
    gc.collect()
    assert dropped() is not None  # alive while its checkpoint is written
    threading.Timer(0.5, go_on.set).start()
    again = ftidask.init(**_config(tmp_path, async_snapshot="copy"))  # waits for the dropped context's checkpoint
    b = np.zeros(100_000)
    again.protect(1, b)
    assert again.status() == 1
    again.recover()
    assert again.recovered_from == (2, 1) and (b == 2.0).all()
    again.finalize()
    gc.collect()
    assert dropped() is None  # and collected once it is done


def test_protect_again_with_another_shape_and_ids_reused_or_going_back(tmp_path):
    """What the guide says of cells run again: protect(id, another array) replaces the array; a recovery into an
    array of another dtype or shape is refused, nothing touched; ids reused or smaller are new checkpoints (each has
    its own sequence number): recover() takes the newest written, whatever its id."""
    ctx = ftidask.init(**_config(tmp_path))
    ctx.protect(1, np.full(10, 5.0))
    ctx.checkpoint(5, 1)
    small = np.full((2, 3), 7, np.int8)
    ctx.protect(1, small)  # the cell run again with another array
    with pytest.raises(ftidask.RecoveryError, match="checkpoint holds float64"):
        ctx.recover()
    assert (small == 7).all()
    ctx.checkpoint(5, 1)  # the same id again
    small[:] = 8
    ctx.checkpoint(3, 1)  # an id going back
    small[:] = 0
    ctx.recover()
    assert ctx.recovered_from == (3, 1) and (small == 8).all()
    with pytest.raises(ftidask.NoCheckpointError):  # checkpoint 3, level 1, retired both checkpoints 5
        ctx.recover(ckpt_id=5)
    assert (small == 8).all()
    ctx.finalize()


def test_the_reprs_never_raise(tmp_path):
    """In a notebook the context and what its calls return are shown after every cell, in every state."""
    ctx = ftidask.init(**_config(tmp_path, enable_dcp=1))
    shown = [repr(ctx), ctx._repr_html_()]  # nothing protected
    ctx.protect(1, np.zeros(0))  # 0-size
    ctx.protect(2, np.zeros((0, 3), np.float32))
    ctx.protect(3, ftidask.State({"step": 1}))
    ctx.protect(4, np.arange(6).reshape(2, 3)[:, ::2])  # not contiguous
    shown += [repr(ctx), ctx._repr_html_(), repr(ctx.checkpoint(1, 5))]
    with pytest.raises(ftidask.FTIError):
        ctx.checkpoint(2, 9)  # refused
    handle = ctx.checkpoint(3, 1, wait=False)
    shown += [repr(handle), repr(handle.result()), repr(ctx), ctx._repr_html_()]
    ctx.finalize()
    shown += [repr(ctx), ctx._repr_html_()]
    assert all(isinstance(s, str) and s for s in shown)
    assert "finalized" in shown[-2] and "<table>" in shown[-1]
