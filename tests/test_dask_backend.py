"""The Dask backend on a real LocalCluster with worker processes: levels, lost workers, atomicity.

A lost node is a worker process killed with SIGKILL plus its node directory erased.
"""

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import crashpoints  # noqa: E402
from conftest import lose_node  # noqa: E402

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 4


@pytest.fixture
def client(dask_client):
    # The shared cluster: after a test, the fixture waits until its nannies have restarted the killed
    # workers, or replaces the cluster (conftest.py).
    return dask_client


def make_array(seed=0, shape=(96, 80), chunks=(24, 20), dtype=np.float64):
    return da.random.default_rng(seed).random(shape, chunks=chunks).astype(dtype)


def lose_workers(client, dirs, ranks):
    """Kill the worker processes of checkpoint ranks ``ranks`` and erase their node directories."""
    pids = client.run(os.getpid)
    addresses = sorted(pids)
    for rank in ranks:  # each node's directory erased before the cluster sees it lost (conftest.py)
        lose_node(pids[addresses[rank]], Path(dirs["ckpt_dir"]) / f"node{rank}")
    gone = {addresses[r] for r in ranks}
    end = time.monotonic() + 60
    while gone & set(live_workers(client)):
        assert time.monotonic() < end, "killed workers still listed"
        time.sleep(0.1)


def crash_worker(client, rank, point):
    """Install a crash point (:func:`crashpoints.install`) in the worker process of checkpoint rank ``rank``."""
    address = sorted(client.run(os.getpid))[rank]  # ranks are the running workers, sorted by address
    client.run(crashpoints.install, point, workers=[address])


def live_workers(client):
    return sorted(client.sync(client.scheduler.identity)["workers"])


def checkpoint_then_lose(client, dirs, level, ranks):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(), name="field")
    ctx.protect(2, make_array(1, shape=(50,), chunks=(7,), dtype=np.int32), name="counts")
    info = ctx.checkpoint(1, level)
    saved = {vid: a.compute() for vid, a in ctx.protected.items()}
    lose_workers(client, dirs, ranks)
    return info, saved


def assert_same(arrays, saved, chunks=None):
    assert sorted(arrays) == sorted(saved)
    for vid, ref in saved.items():
        got = arrays[vid]
        assert isinstance(got, da.Array)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        if chunks is None:
            assert got.chunks == make_array(shape=ref.shape, chunks=((24, 20) if ref.ndim == 2 else (7,))).chunks
        assert got.compute().tobytes() == ref.tobytes()


@pytest.mark.parametrize("level", [2, 3, 4])
def test_lost_worker_recovered_bit_for_bit(client, dirs, level):
    info, saved = checkpoint_then_lose(client, dirs, level, [1])
    assert info.level == level and len(info.workers) == NWORKERS
    ctx = ftidask.init(client=client, **dirs)
    assert ctx.status() == 1
    arrays = ctx.recover()
    # locality: a chunk whose file survived was read by the worker that wrote that file
    # (asked before computing: Dask may later move or drop replicas)
    who_has = client.who_has(distributed.futures_of(arrays[1]))
    assert_same(arrays, saved)
    assert ctx.recovered_from == (1, level)
    record = ctx.state.records()[-1]
    where = {tuple(index): rank for index, rank, _dptr, _n in record.extra["chunks"]["1"]}
    for key, holders in who_has.items():
        rank = where[tuple(key[1:])]
        if rank != 1:
            assert record.extra["workers"][rank] in holders


def test_level1_is_lost_with_its_worker(client, dirs):
    checkpoint_then_lose(client, dirs, 1, [2])
    ctx = ftidask.init(client=client, **dirs)
    with pytest.raises(ftidask.NoCheckpointError, match="level 1"):
        ctx.recover()


def test_level1_survives_a_worker_restart_without_disk_loss(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array())
    ctx.checkpoint(1, 1)
    saved = {1: ctx.protected[1].compute()}
    pids = client.run(os.getpid)
    os.kill(pids[sorted(pids)[0]], signal.SIGKILL)  # the process dies, its disk stays
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert out[1].compute().tobytes() == saved[1].tobytes()


@pytest.mark.parametrize(("level", "ranks", "ok"), [(2, [0, 2], True), (2, [1, 2], False), (3, [0, 3], True)])
def test_two_lost_workers(client, dirs, level, ranks, ok):
    """L2 survives non-adjacent losses, L3 the loss of half of a group."""
    _info, saved = checkpoint_then_lose(client, dirs, level, ranks)
    ctx = ftidask.init(client=client, **dirs)
    if ok:
        assert_same(ctx.recover(), saved)
    else:
        with pytest.raises(ftidask.NoCheckpointError, match="partner copy"):
            ctx.recover()


def test_older_checkpoint_used_when_newest_is_lost(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(3))
    ctx.checkpoint(1, 4)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(2, 1)
    lose_workers(client, dirs, [3])
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 4)
    assert out[1].compute().tobytes() == saved.tobytes()


@pytest.mark.parametrize("stage", ["write", "send"])
def test_worker_dying_during_checkpoint_keeps_previous(client, dirs, stage):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(5))
    ctx.checkpoint(1, 2)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] * 2)
    # rank 1's worker process kills itself (SIGKILL) when its L1 write, or its L2 send, starts
    crash_worker(client, 1, {"write": "ftidask.backends.dask.tasks:write_rank",
                             "send": "ftidask.levels.partner:exchange_file"}[stage])
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
        ctx.checkpoint(2, 2)
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    assert not list(Path(dirs["ckpt_dir"]).glob("node*/*/l*/ckpt2.*"))
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 2)
    assert out[1].compute().tobytes() == saved.tobytes()


@pytest.mark.parametrize("level", [1, 3])
def test_async_checkpoint_while_the_client_goes_on(client, dirs, level):
    ctx = ftidask.init(client=client, **dirs)
    x = make_array(11)
    ctx.protect(1, x)
    saved = x.compute()
    handle = ctx.checkpoint(1, level, wait=False)
    assert isinstance(handle, ftidask.CheckpointHandle) and handle.mechanism == "immutable"
    ctx.protect(1, x + 1)  # the application goes on: the checkpoint keeps the chunks of the call
    info = handle.result(timeout=120)
    assert info.id == 1 and info.level == level
    ctx.wait()
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.recover()[1].compute().tobytes() == saved.tobytes()


def test_worker_dying_during_async_checkpoint(client, dirs):
    ctx = ftidask.init(client=client, async_ckpt=1, **dirs)
    ctx.protect(1, make_array(5))
    ctx.checkpoint(1, 2).wait()
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] * 2)
    crash_worker(client, 1, "ftidask.backends.dask.tasks:write_rank")
    handle = ctx.checkpoint(2, 2)  # returns at once; the handle raises
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
        handle.result(timeout=120)
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    ctx.wait()  # observed: not raised again
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.recover()[1].compute().tobytes() == saved.tobytes()


def test_no_chunk_reaches_the_client(client, dirs):
    x = make_array(7, shape=(512, 512), chunks=(128, 128)).persist()  # 16 chunks of 128 KiB
    distributed.wait(x)

    def counters(dask_worker):
        return dask_worker.transfer_outgoing_bytes_total, dask_worker.state.transfer_incoming_count_total

    before = client.run(counters)
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, x)
    info = ctx.checkpoint(1, 1)
    after = client.run(counters)
    sent = sum(after[w][0] - before[w][0] for w in after)  # to the client, the scheduler or a worker
    fetched = sum(after[w][1] - before[w][1] for w in after)  # chunks fetched from another worker
    assert info.bytes_written == x.nbytes
    assert sent < (128 << 10) // 4, f"{sent} bytes left the workers during an L1 checkpoint"
    assert fetched == 0
    # the persisted chunks were used, not recomputed; they are handed back under keys that read the
    # checkpoint if lost (the lineage is cut: tests/test_dask_lineage.py), with no byte moved for that
    assert ctx.protected[1].name.startswith("ftidask-lineage-ckpt1-")


def test_numpy_arrays_still_work(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    a = np.arange(1000, dtype=np.int64)
    ctx.protect(3, a)
    ctx.checkpoint(1, 2)
    ref = a.copy()
    a[:] = 0
    ctx2 = ftidask.init(client=client, **dirs)
    b = np.zeros_like(a)
    ctx2.protect(3, b)
    out = ctx2.recover()
    assert out[3] is b and b.tobytes() == ref.tobytes()


def test_recover_with_other_chunks(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(9))
    ctx.checkpoint(1, 3)
    saved = ctx.protected[1].compute()
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover(chunks={1: (48, 40)})
    assert out[1].chunks == ((48, 48), (40, 40))
    assert out[1].compute().tobytes() == saved.tobytes()
    ctx3 = ftidask.init(client=client, **dirs)
    ctx3.protect(1, da.zeros((96, 80), chunks=(96, 16)))
    out = ctx3.recover()
    assert out[1].chunks == ((96,), (16,) * 5)
    assert ctx3.protected[1] is out[1]
    assert out[1].compute().tobytes() == saved.tobytes()


def test_protected_mismatch_is_refused(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array())
    ctx.checkpoint(1, 1)
    ctx2 = ftidask.init(client=client, **dirs)
    ctx2.protect(1, da.zeros((10, 10)))
    with pytest.raises(ftidask.RecoveryError, match="checkpoint holds"):
        ctx2.recover()


def _prefix_counts(dask_scheduler):
    """Task prefix -> how many state transitions its tasks have made so far."""
    return {name: sum(p.state_counts.values()) for name, p in dask_scheduler.task_prefixes.items()}


def test_reprs(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(), name="field")
    before = client.run_on_scheduler(_prefix_counts)
    info = ctx.checkpoint(4, 4)
    text, page = repr(ctx), ctx._repr_html_()
    assert "backend=dask" in text and "field" in text and "workers=4" in text and "(4, 4)" in text
    assert "<table>" in page and "field" in page
    assert "L4 global committed" in repr(info) and "field" in repr(info) and "60.0 KiB" in repr(info)
    assert info._repr_html_().count("<tr>") == 1 + 1 + 1 + NWORKERS
    # each level's work ran as Dask tasks under readable names (what the dashboard groups by)
    # (the shared cluster's scheduler keeps the prefixes of earlier tests: those that ran tasks now)
    after = client.run_on_scheduler(_prefix_counts)
    prefixes = {name for name, count in after.items() if count > before.get(name, 0)}
    assert "ftidask-write" in prefixes  # L4: each worker writes into the global directory, no flush
    assert "ftidask-flush" not in prefixes
    ctx.finalize()


def test_keep_last_ckpt_flushes_to_l4(client, dirs):
    ctx = ftidask.init(client=client, keep_last_ckpt=1, **dirs)
    ctx.protect(1, make_array(11))
    ctx.checkpoint(1, 2)
    saved = ctx.protected[1].compute()
    ctx.finalize()
    lose_workers(client, dirs, [0, 1])
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.status() == 2
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 4)
    assert out[1].compute().tobytes() == saved.tobytes()


@pytest.mark.parametrize("nworkers", [2, 5])
def test_restore_on_a_cluster_of_another_size(client, dirs, nworkers):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, make_array(13))
    ctx.checkpoint(1, 3)
    saved = ctx.protected[1].compute()
    with distributed.LocalCluster(n_workers=nworkers, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", silence_logs=50) as other, distributed.Client(other) as cl2:
        ctx2 = ftidask.init(client=cl2, **dirs)
        assert ctx2.status() == 1
        out = ctx2.recover()
        assert out[1].compute().tobytes() == saved.tobytes()
        # the chunks are read where the files are: each worker serves the files assigned to it
        assert len(cl2.has_what()) == nworkers
        ctx2.checkpoint(2, 2)  # and checkpoints again with its own number of ranks
        assert ctx2.last_checkpoint.workers == tuple(live_workers(cl2))


def test_the_start_line_counts_the_workers(client, dirs, caplog):
    """Each worker is a rank (docs/dask.md): the run's first log line counts them, not the one client."""
    logger = logging.getLogger("ftidask")
    logger.addHandler(caplog.handler)  # verbosity 2 sets the logger's level (and its own stderr handler)
    try:
        ctx = ftidask.init(client=client, **{**dirs, "verbosity": 2})
    finally:
        logger.removeHandler(caplog.handler)
    starts = [r.getMessage() for r in caplog.records if "fresh start" in r.getMessage()]
    assert starts and all(m.endswith(f"(dask backend, {NWORKERS} worker(s))") for m in starts), starts
    ctx.finalize()
