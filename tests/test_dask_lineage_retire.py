"""Retiring checkpoints that a lineage cut made readable, on a real LocalCluster: without a barrier task or a full
garbage collection where the scheduler's answer is already known, and never while a live array may read one.

A barrier is a task sent on the client's stream (the scheduler handles that stream in order) to make sure the
releases this client sent were handled before the scheduler is asked which keys it still knows; a full collection
frees futures caught in reference cycles. Both cost a checkpoint of a small array a large part of its time (a
collection grows with the client's heap), so they run only where the answer could depend on them.
"""

import gc
import time

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_lineage import initial  # noqa: E402

import ftidask  # noqa: E402
from ftidask.backends.dask import lineage  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


@pytest.fixture
def counted(monkeypatch):
    """(barrier tasks sent, full collections run), automatic collections off meanwhile (only explicit ones count)."""
    barriers, collections = [], []
    real = lineage._barrier
    monkeypatch.setattr(lineage, "_barrier", lambda c, timeout=30: (barriers.append(1), real(c, timeout)))

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    gc.collect()
    gc.disable()
    gc.callbacks.append(count)
    try:
        yield barriers, collections
    finally:
        gc.callbacks.remove(count)
        gc.enable()


def stepped(x, steps):
    """``x`` with 1 added ``steps`` times, one addition at a time as the loops do (its bits, not those of x + steps)."""
    for _ in range(steps):
        x = x + 1
    return x


def test_loop_on_one_array_retires_the_previous_checkpoint_at_once(dask_client, dirs, counted):
    """Checkpointing the protected array again and again: each checkpoint retires the one before as it returns,
    without a barrier or a collection (the arrays it replaces were released before its lineage graph left)."""
    barriers, collections = counted
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    for i in range(1, 5):
        ctx.checkpoint(i, 1)
        assert [r.ckpt_id for r in ctx.state.records()] == [i]
        ctx.protect(1, ctx.protected[1] + 1)
    assert barriers == [] and collections == []
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 3).compute().tobytes()
    ctx.finalize()


def test_loop_of_steps_keeps_the_checkpoint_its_step_was_computed_from(dask_client, dirs, counted):
    """A loop whose step is computed from the array the last checkpoint handed back: while that step's array lives
    (the application holds it during the checkpoint), the checkpoint it was computed from is kept, since a lost
    chunk of it would be recomputed from there; the next checkpoint retires it, without a barrier or a collection."""
    barriers, collections = counted
    ctx = ftidask.init(client=dask_client, **dirs)
    x = initial().persist()
    for i in range(1, 6):
        ctx.protect(1, x)
        ctx.checkpoint(i, 1)
        assert [r.ckpt_id for r in ctx.state.records()] == ([i - 1, i] if i > 1 else [1])
        x = (ctx.protected[1] + 1).persist()
        distributed.wait(x)
    assert barriers == [] and collections == []
    del x
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 4).compute().tobytes()
    ctx.finalize()


def test_an_array_held_long_costs_one_collection(dask_client, dirs, counted):
    """An old array the application keeps holds its checkpoint through every later one; the scheduler is asked at
    each commit, but its heap is collected for that checkpoint once only, the second time it is found read."""
    barriers, collections = counted
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 1)
    old = ctx.protected[1]  # reads checkpoint 1 back if a chunk is lost
    for i in range(2, 6):
        ctx.protect(1, ctx.protected[1] + 1)
        ctx.checkpoint(i, 1)
        assert [r.ckpt_id for r in ctx.state.records()] == [1, i]
    assert len(collections) == 1
    assert old.compute().tobytes() == initial().compute().tobytes()
    del old
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(6, 1)  # asked again: checkpoint 1 is read by no live array any more
    assert [r.ckpt_id for r in ctx.state.records()] == [6]
    ctx.finalize()


def test_an_asynchronous_checkpoint_hands_out_no_array_that_reads_a_checkpoint_it_may_retire(dask_client, dirs):
    """While an asynchronous checkpoint cuts the lineage on its thread, what ``protected`` hands out is the array the
    application protected or the one the cut persisted, never a graph that reads the checkpoint without the
    scheduler knowing: retention asks the scheduler which checkpoints live arrays read, and would retire the one that
    such an array reads the moment nothing else holds it."""
    ctx = ftidask.init(client=dask_client, **dirs)
    grabbed = {}
    for i in range(1, 9):
        ctx.protect(1, stepped(initial(), i - 1).persist(), name="field")
        handle = ctx.checkpoint(i, 1, wait=False)
        while not handle.done():  # the application goes on, and looks at what it protected
            arr = ctx.protected[1]
            grabbed.setdefault(arr.name, (i, arr))
            time.sleep(0.0005)  # not a spin: on 2 cores it starved the checkpoint's thread (the test took 10-18 s)
        handle.result()
    # What was grabbed stays computable (and right) through later checkpoints of unrelated arrays.
    for i in range(9, 11):
        ctx.protect(1, initial(seed=i).persist())
        ctx.checkpoint(i, 1)
    for name, (i, arr) in grabbed.items():
        assert arr.compute().tobytes() == stepped(initial(), i - 1).compute().tobytes(), name
    ctx.finalize()


def test_a_retirement_that_fails_midway_discards_what_it_retired(dask_client, dirs, monkeypatch):
    """A commit retires two checkpoints and fails on the second: the first one's directories are discarded at once
    (not left for a collection that does not come), and removals made afterwards run at once again."""
    from pathlib import Path

    from ftidask.backends.dask.retention import DaskRetention
    from ftidask.model.errors import CheckpointError

    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    ctx.checkpoint(2, 1)  # an L1 checkpoint retires no L2 one
    real = DaskRetention.remove_checkpoint

    def second_fails(self, record, fallback=True):
        if record.ckpt_id == 2:
            raise OSError(5, "Input/output error (injected)")
        return real(self, record, fallback)

    monkeypatch.setattr(DaskRetention, "remove_checkpoint", second_fails)
    with pytest.raises(CheckpointError, match="committed and recoverable, but cleaning up after it failed"):
        ctx.checkpoint(3, 2)  # retires 1 (level 2), then 2 (level 1)
    monkeypatch.setattr(DaskRetention, "remove_checkpoint", real)
    local = Path(dirs["ckpt_dir"])
    assert not [p for p in local.glob("node*/*/l*/ckpt1.s*")]  # discarded (renamed away) at once
    assert ctx._dask_retention._discards is None
    ctx.checkpoint(4, 2)
    assert [r.ckpt_id for r in ctx.state.records()] == [4]
    assert ctx.recover()[1].compute().tobytes() == initial().compute().tobytes()
    ctx.finalize()


def test_a_worker_lost_before_the_scheduler_learns_of_the_aliases_leaves_no_key_on_no_worker(dask_client, dirs,
                                                                                             monkeypatch):
    """A worker that left between the making of a checkpoint's lineage aliases and the scheduler being told of them
    (``cluster.adapt`` hit it by itself): distributed's update_data marked its first key in memory before it found
    the worker gone, on no worker; every compute of the protected array, and the next checkpoint, waited for ever.
    The worker is killed at that moment (its process, SIGKILL), once the scheduler has seen it go."""
    import os

    import numpy as np
    from conftest import lose_node, wait_for_replaced_workers

    real = lineage._place_aliases

    def a_worker_leaves_first(client, aliasing):
        victim = sorted(aliasing.made())[0]  # a worker that holds aliases
        lose_node(client.run(os.getpid, workers=[victim])[victim])
        end = time.monotonic() + 60
        while victim in client.sync(client.scheduler.identity)["workers"]:
            assert time.monotonic() < end, "the killed worker is still listed"
            time.sleep(0.05)
        return real(client, aliasing)

    ctx = ftidask.init(client=dask_client, **dirs)
    x = dask_client.persist(initial())
    expected = x.compute()
    ctx.protect(1, x, name="field")
    monkeypatch.setattr(lineage, "_place_aliases", a_worker_leaves_first)
    ctx.checkpoint(1, 1)
    monkeypatch.setattr(lineage, "_place_aliases", real)
    got = dask_client.compute(ctx.protected[1]).result(timeout=120)  # it waited for ever
    assert np.array_equal(got, expected)
    wait_for_replaced_workers(dask_client, 2)
    ctx.protect(1, ctx.protected[1] + 1, name="field")
    ctx.checkpoint(2, 1)
    assert np.array_equal(ctx.protected[1].compute(), expected + 1)
    ctx.finalize()


def test_a_checkpoint_kept_for_a_live_array_is_retired_after_a_lower_level_commit(dask_client, dirs):
    """An L2 checkpoint kept for an array that reads it (an L2 commit made it obsolete) dropped out of the deferred
    list at the next L1 commit (whose rule does not name L2 checkpoints): once the array was gone it stayed on
    disk until the next L2 commit or finalize."""
    from pathlib import Path

    def on_disk():
        return sorted({p.parent.name for p in Path(dirs["ckpt_dir"]).glob("node*/*/l*/ckpt*.s*/Ckpt*.fti")})

    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    old = ctx.protected[1]  # reads checkpoint 1
    ctx.protect(1, old + 1)
    ctx.checkpoint(2, 2)
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(3, 1)
    assert on_disk() == ["ckpt1.s1", "ckpt2.s2", "ckpt3.s3"]  # checkpoint 1 kept: old reads it
    del old
    gc.collect()
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(4, 1)
    assert on_disk() == ["ckpt2.s2", "ckpt4.s4"]
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 3).compute().tobytes()
    ctx.finalize()
