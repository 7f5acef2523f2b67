"""What a Dask checkpoint of a small array spends between the client, the scheduler and the workers, on a real
LocalCluster: the graphs it waits for leave at once (not at the end of the client's batching interval), the
directories of a checkpoint retired right before the write are discarded by the write tasks (or at once when they
do not run), and the workers' collection after a commit runs while the lineage is cut, ended before it returns.
"""

import threading
from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_lineage import initial  # noqa: E402

import ftidask  # noqa: E402
from ftidask.model.errors import CheckpointError  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


def stepped(x, steps):
    for _ in range(steps):
        x = x + 1
    return x


def ckpt_dirs(dirs, ckpt_id):
    """The node-local directories of checkpoint ``ckpt_id`` still under their names (a discarded one is renamed)."""
    return sorted(Path(dirs["ckpt_dir"]).glob(f"node*/*/l*/ckpt{ckpt_id}.s*"))


def _wake(client):
    bcomm = client.scheduler_comm
    bcomm.next_deadline = None
    bcomm.waker.set()


def test_checkpoints_wait_for_no_batching_interval(dask_client, dirs):
    """The client sends its messages to the scheduler in batches, the next one at the end of an interval after the
    last: made an hour here, a checkpoint that waited for its graphs to leave by themselves would not end. Each
    graph a checkpoint waits for (the chunks persisted, the writes, the lineage cut's reads) is sent at once."""
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    bcomm = dask_client.scheduler_comm
    interval = bcomm.interval
    rescued = []

    def rescue():  # a stuck checkpoint is failed, not left hanging: its messages sent after all
        rescued.append(1)
        bcomm.interval = interval
        dask_client.loop.add_callback(_wake, dask_client)

    bcomm.interval = 3600
    dask_client.submit(int, 0, pure=False).release()  # a message sent: the next one would wait for the interval
    timer = threading.Timer(60, rescue)
    timer.start()
    try:
        for i in range(1, 4):
            ctx.checkpoint(i, 1)
            ctx.protect(1, ctx.protected[1] + 1)
    finally:
        timer.cancel()
        bcomm.interval = interval
        dask_client.loop.add_callback(_wake, dask_client)
    assert not rescued, "a checkpoint waited for the client's batching interval"
    assert [r.ckpt_id for r in ctx.state.records()] == [3]
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 2).compute().tobytes()
    ctx.finalize()


def test_a_failed_checkpoint_still_discards_the_checkpoint_it_retired(dask_client, dirs):
    """A checkpoint kept for the step's array is retired by the next checkpoint, whose write tasks discard its
    directories; when that checkpoint fails before any write task runs (its array cannot be computed), they are
    discarded all the same, and the checkpoint before stays recoverable."""
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial().persist(), name="field")
    ctx.checkpoint(1, 1)
    x = (ctx.protected[1] + 1).persist()
    distributed.wait(x)
    ctx.protect(1, x)
    ctx.checkpoint(2, 1)
    assert [r.ckpt_id for r in ctx.state.records()] == [1, 2]  # x is computed from checkpoint 1: kept
    assert ckpt_dirs(dirs, 1)
    del x

    def boom(block):
        raise ValueError("a chunk that cannot be computed (injected)")

    ctx.protect(1, initial().map_blocks(boom, dtype=float))
    with pytest.raises(CheckpointError, match="could not be computed"):
        ctx.checkpoint(3, 1)
    assert [r.ckpt_id for r in ctx.state.records()] == [2]
    assert ckpt_dirs(dirs, 1) == [] and ckpt_dirs(dirs, 3) == []
    assert ckpt_dirs(dirs, 2)
    ctx.protect(1, initial())
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 1).compute().tobytes()
    ctx.finalize()


def test_a_checkpoint_returns_with_its_retirement_and_collection_done(dask_client, dirs):
    """Each checkpoint of a loop retires the one before at once (no live array reads it) and collects what an
    interrupted checkpoint left: done on every worker when it returns, the new checkpoint untouched."""
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, initial(), name="field")
    for i in range(1, 5):
        leftover = Path(dirs["ckpt_dir"]) / "node1" / ctx.exec_id / "l1" / f"ckpt{100 + i}.s{100 + i}"
        leftover.mkdir(parents=True)
        (leftover / "Ckpt-Rank1.fti").write_bytes(b"half written")
        ctx.checkpoint(i, 1)
        assert [r.ckpt_id for r in ctx.state.records()] == [i]
        assert not leftover.exists()
        assert ckpt_dirs(dirs, i - 1) == []
        assert len(ckpt_dirs(dirs, i)) == 2
        ctx.protect(1, ctx.protected[1] + 1)
    assert ctx.recover()[1].compute().tobytes() == stepped(initial(), 3).compute().tobytes()
    ctx.finalize()


def _lineage_keys(dask_worker=None):
    return sorted(str(k) for k in dask_worker.state.tasks if "ftidask-lineage" in str(k))


@pytest.mark.parametrize("early", [True, False])
def test_a_checkpoint_not_committed_leaves_no_alias_on_the_workers(dask_client, dirs, monkeypatch, early):
    """The chunks of a small checkpoint are aliased under their lineage keys on the workers while it is written (of
    a larger one, after the commit), the scheduler told only at the commit: a checkpoint whose commit record cannot
    be written (a full disk) drops them again, so that no worker keeps keys the scheduler never heard of (and the
    chunks they hold); the next one cuts as ever."""
    from diskfull import full_commit_records

    from ftidask.backends.dask import lineage
    from ftidask.storage import files as storage

    if not early:  # the array is larger than that: aliased after the commit
        monkeypatch.setattr(lineage, "EARLY_ALIAS_BYTES", 0)
    ctx = ftidask.init(client=dask_client, **dirs)
    x = initial().persist()
    distributed.wait(x)
    ctx.protect(1, x, name="field")
    real = storage.open_temp
    full_commit_records(monkeypatch.setattr)
    with pytest.raises(CheckpointError):
        ctx.checkpoint(1, 1)
    monkeypatch.setattr(storage, "open_temp", real)
    assert ctx.state.records() == []
    assert all(keys == [] for keys in dask_client.run(_lineage_keys).values())
    ctx.checkpoint(2, 1)
    cut = ctx.protected[1]
    held = {k for keys in dask_client.run(_lineage_keys).values() for k in keys}
    assert held and all("ckpt2" in k for k in held) and len(held) == len(distributed.futures_of(cut))
    assert cut.compute().tobytes() == x.compute().tobytes()
    ctx.finalize()


def test_a_chunk_that_fails_leaves_the_arrays_other_chunks_and_the_next_error_names_it(dask_client, dirs):
    """One chunk raising failed the checkpoint, and the wait then cancelled every chunk of the array ftidask had
    persisted for it (those computed too): the next checkpoint said "cancelled or lost by the cluster", not the
    chunk's error (found by a review). The chunks are the application's: never cancelled."""
    import numpy as np

    ctx = ftidask.init(client=dask_client, **dirs)
    x = da.from_array(np.arange(20.0), chunks=5)
    ctx.protect(1, x)
    ctx.checkpoint(1, 1)

    def boom(block, block_info=None):
        if block_info[0]["chunk-location"] == (2,):
            raise ValueError("boom in chunk 2 (injected)")
        return block + 1

    ctx.protect(1, x.map_blocks(boom, dtype=x.dtype))
    for ckpt_id in (2, 3):
        with pytest.raises(CheckpointError, match="could not be computed.*boom in chunk 2"):
            ctx.checkpoint(ckpt_id, 1)
    persisted = ctx.protected[1]
    statuses = [f.status for f in distributed.futures_of(persisted)]
    assert statuses.count("error") == 1 and statuses.count("finished") == 3, statuses
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    ctx.protect(1, da.zeros(20, chunks=5))
    assert ctx.recover()[1].compute().tobytes() == np.arange(20.0).tobytes()
    ctx.finalize()
