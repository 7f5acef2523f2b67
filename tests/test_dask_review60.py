"""Dask backend: a restart that protects as a Dask array what was checkpointed as a NumPy array, and a Client made
with ``asynchronous=True``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = pytest.mark.dask


def test_a_numpy_variable_protected_as_a_dask_array_at_the_restart_is_rebound(dask_client, dirs):
    """Before: recover() returned the values but the context kept the stale Dask array (zeros), which the next
    checkpoint committed without a word."""
    a = np.arange(60.0).reshape(6, 10)
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, a, name="a")
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    held = da.zeros((6, 10), chunks=(3, 4))
    ctx.protect(1, held)
    out = ctx.recover()[1]
    assert ctx.protected[1] is out and out.chunks == held.chunks
    assert out.compute().tobytes() == a.tobytes()
    ctx.checkpoint(2, 1)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    assert np.asarray(ctx.recover()[1]).tobytes() == a.tobytes()
    ctx.finalize()


def test_an_asynchronous_client_is_refused_at_init(dask_client, dirs):
    """Before: a raw TypeError ('coroutine' object is not subscriptable) from deep inside init, after the fence
    take-over and the garbage collection were skipped (their coroutines never awaited)."""
    async def main() -> str:
        client = await distributed.Client(dask_client.scheduler.address, asynchronous=True)
        try:
            with pytest.raises(ftidask.FTIError, match="must be a synchronous distributed.Client") as refused:
                ftidask.init(client=client, **dirs)
            return str(refused.value)
        finally:
            await client.close()

    assert "run_in_executor" in asyncio.run(main())


def _set_status(name, dask_worker=None):
    """Memory pressure as the worker's own memory monitor sees it: it pauses the worker, then resumes it."""
    dask_worker.memory_manager.memory_pause_fraction = 1e-4 if name == "paused" else 0.8
    return True


def test_a_checkpoint_waits_for_a_paused_worker(dask_client, dirs, caplog, monkeypatch):
    """A worker paused (memory pressure) holds its chunks and resumes: before, the checkpoint failed at once saying
    a chunk was "held by no live worker" (or that the worker had left the cluster). A wait that goes on is said,
    naming the worker (it waited in silence, for ever if the worker never resumed)."""
    from ftidask.backends.dask import cluster

    monkeypatch.setattr(cluster, "PAUSED_SAID", 0.2)  # 30 s in use
    ctx = ftidask.init(client=dask_client, **dirs)
    x = dask_client.persist(da.random.default_rng(0).random((40, 40), chunks=(10, 10)))
    distributed.wait(x)
    ctx.protect(1, x)
    ctx.checkpoint(1, 2)
    x = dask_client.persist(ctx.protected[1] + 1)
    distributed.wait(x)
    ctx.protect(1, x)
    holders = sorted({w for ws in dask_client.who_has(x).values() for w in ws})
    dask_client.run(_set_status, "paused", workers=holders[:1])
    deadline = time.monotonic() + 30
    while dask_client.sync(dask_client.scheduler.identity)["workers"][holders[0]].get("status") != "paused":
        assert time.monotonic() < deadline, "the scheduler never heard of the pause"
        time.sleep(0.05)
    try:
        resume = threading.Timer(2.0, lambda: dask_client.run(_set_status, "running", workers=holders[:1]))
        resume.start()
        with caplog.at_level(logging.WARNING, logger="ftidask"):
            ctx.checkpoint(2, 2)
        resume.join()
    finally:
        dask_client.run(_set_status, "running", workers=holders[:1])
    said = [r.getMessage() for r in caplog.records if "paused by distributed" in r.getMessage()]
    assert len(said) == 1 and holders[0] in said[0] and said[0].startswith("checkpoint 2"), said
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    assert ctx.recover()[1].compute().tobytes() == x.compute().tobytes() and ctx.recovered_from == (2, 2)
    ctx.finalize()


def test_a_node_directory_another_user_could_write_to_is_refused_for_every_worker(dask_client, dirs):
    """Before: init checked node 0's directories only (the client's rank): a world-writable node1 took rank 1's
    files (and could hold links planted there)."""
    node1 = Path(dirs["ckpt_dir"]) / "node1"
    node1.mkdir(parents=True)
    node1.chmod(0o777)
    with pytest.raises(ftidask.ConfigError, match="another user could write to") as refused:
        ftidask.init(client=dask_client, **dirs)
    assert "node1" in str(refused.value)
    node1.chmod(0o700)
    ftidask.init(client=dask_client, **dirs).finalize()  # the run lock was released by the refusal
