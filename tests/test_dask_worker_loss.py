"""A Dask worker lost after a recovery, or in the middle of a checkpoint, on a real LocalCluster.

Each test kills a real worker process (SIGKILL) of the shared cluster, whose nanny restarts it
fresh before the next test (conftest.py's ``dask_client``). A lost node
is its worker killed plus its node directory erased (every worker of a LocalCluster sees every
node directory, so a file "only on the dead node" is one that was erased).
"""

import logging
import os
import time
from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from conftest import lose_node  # noqa: E402
from test_dask_backend import crash_worker  # noqa: E402

import ftidask  # noqa: E402

# 240 s, as test_dask_backend.py: the timeout counts the shared cluster fixture's setup (closing a cluster of another
# size, up to 60 s; waiting for the new workers, up to 60 s), which a loaded machine can take most of 120 s for.
pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 2
BOUND = 60  # seconds a compute() may take before the test calls it a hang


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster, its killed workers restarted after each test (conftest.py)


def live_workers(client):
    return set(client.sync(client.scheduler.identity)["workers"])


def kill_worker(client, address, node_dir=None):
    """SIGKILL the worker process at ``address`` (and erase ``node_dir``: its node's disk is lost too; an L4
    checkpoint wrote nothing there)."""
    lose_node(client.run(os.getpid)[address], node_dir)  # erased before the cluster sees the loss (conftest.py)
    end = time.monotonic() + 60
    while address in live_workers(client):
        assert time.monotonic() < end, "the killed worker is still listed"
        time.sleep(0.05)


def computed(client, array):
    """``array`` computed, or TimeoutError after BOUND seconds (a hang made visible)."""
    return client.compute(array).result(timeout=BOUND)


def recover_then_lose(client, dirs, level, erase):
    """Checkpoint at ``level``, recover in a new context, then lose the worker serving the file of
    the rank that holds the most chunks (it read them: their results live in its memory)."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.random.default_rng(3).random((60, 48), chunks=(20, 16)), name="field")
    ctx.checkpoint(1, level)
    saved = ctx.protected[1].compute()
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()[1]
    record = ctx2.state.records()[-1]
    ranks = [rank for _i, rank, _d, _n in record.extra["chunks"]["1"]]
    rank = max(set(ranks), key=ranks.count)
    server = record.extra["workers"][rank]
    held = client.who_has(distributed.futures_of(out))
    mine = {tuple(i) for i, r, _d, _n in record.extra["chunks"]["1"] if r == rank}
    assert all(server in held[key] for key in held if tuple(key[1:]) in mine)
    kill_worker(client, server, Path(dirs["ckpt_dir"]) / f"node{rank}" if erase else None)
    return out, saved


@pytest.mark.parametrize(("level", "erase"), [(4, True), (1, False), (2, True), (3, True)])
def test_recovered_array_computes_after_its_reader_dies(client, dirs, level, erase):
    """The chunks the dead worker had read are read again elsewhere: from the global directory (L4),
    the file left on disk (L1, process killed only), the partner copy (L2), or rebuilt from the
    group's parity (L3)."""
    out, saved = recover_then_lose(client, dirs, level, erase)
    assert computed(client, out).tobytes() == saved.tobytes()


def test_recovered_level1_array_fails_clearly_when_its_node_is_lost(client, dirs):
    """L1 keeps no copy: computing the array raises a RecoveryError saying what happened (no hang)."""
    out, _saved = recover_then_lose(client, dirs, 1, erase=True)
    with pytest.raises(ftidask.RecoveryError, match=r"level 1 keeps no copy.*recover\(\) again"):
        computed(client, out)


@pytest.mark.parametrize("point", ["ftidask.backends.dask.tasks:write_rank", "ftidask.levels.partner:exchange_file"])
def test_a_checkpoint_a_worker_died_in_fails_without_dialling_the_dead_worker(client, dirs, point, caplog):
    """A checkpoint whose worker is killed fails at once: its clean-up (the chunks aliased on the workers for the
    lineage cut, given back) goes to the workers the scheduler still has, never to the dead one's address, which
    the scheduler dials again and again until its connect timeout (30 s by default: each failed checkpoint took
    that long to raise). The timeout is cut to 2 s here, and the scheduler (in this process) logs each such dial."""
    dask = pytest.importorskip("dask")
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.random.default_rng(7).random((60, 48), chunks=(20, 16)))
    ctx.checkpoint(1, 2)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] * 2)
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), caplog.at_level(logging.ERROR, "distributed"):
        crash_worker(client, 1, point)
        with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
            ctx.checkpoint(2, 2)  # its clean-up's calls to the workers have returned when it raises
    dialled = [r.getMessage() for r in caplog.records if "broadcast to" in r.getMessage()]
    assert not dialled, dialled
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 2)
    assert computed(client, out[1]).tobytes() == saved.tobytes()


def test_worker_lost_mid_checkpoint_named_in_one_sentence(client, dirs, caplog):
    """A worker killed while it sends its L2 copy: the error names the worker and its tasks, not a
    list of Dask timeouts; ftidask logs no error of its own; the previous checkpoint recovers."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.random.default_rng(5).random((60, 48), chunks=(20, 16)))
    ctx.checkpoint(1, 2)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] * 2)
    victim = sorted(live_workers(client))[1]
    crash_worker(client, 1, "ftidask.levels.partner:exchange_file")  # rank 1's worker is killed as its send starts
    with caplog.at_level(logging.INFO, logger="ftidask"), pytest.raises(ftidask.CheckpointError) as err:
        ctx.checkpoint(2, 2)
    message = str(err.value)
    assert f"worker {victim} (rank 1) left the cluster" in message, message
    assert "ftidask-partner-2-" in message and "previous checkpoint is kept" in message
    assert "TimeoutError" not in message and "NoneType" not in message
    assert message.count("\n") == 0 and message.count("checkpoint 2") == 1
    assert not [r for r in caplog.records if r.name.startswith("ftidask") and r.levelno >= logging.WARNING]
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 2)
    assert computed(client, out[1]).tobytes() == saved.tobytes()


def test_a_worker_lost_after_its_tasks_finished_before_their_results_came_fails_the_checkpoint(client, dirs,
                                                                                                monkeypatch):
    """A worker killed once its write task finished, before the client fetched the result (the seam: the client's
    fetch of the results, which kills the worker holding the first one first): distributed rescheduled the task,
    pinned to the dead worker, and waited for it for ever (the checkpoint hung). Now the checkpoint fails naming the
    worker, and the previous checkpoint recovers."""
    from ftidask.backends.dask.cluster import Cluster

    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.random.default_rng(7).random((60, 48), chunks=(20, 16)))
    ctx.checkpoint(1, 2)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] * 2)
    results, killed = Cluster._results, []

    def lose_a_worker_first(self, futures, needed):
        writes = [f for f in futures if str(f.key).startswith("ftidask-write-2-")]
        if writes and not killed:
            (victim,) = client.who_has(writes[:1])[writes[0].key]
            killed.append(victim)
            kill_worker(client, victim)
        return results(self, futures, needed)

    monkeypatch.setattr(Cluster, "_results", lose_a_worker_first)
    with pytest.raises(ftidask.CheckpointError, match="left the cluster") as err:
        ctx.checkpoint(2, 2)
    assert killed and f"worker {killed[0]}" in str(err.value), str(err.value)
    monkeypatch.undo()
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, 2)
    assert computed(client, out[1]).tobytes() == saved.tobytes()


def test_a_worker_that_replaces_a_lost_one_writes_with_the_runs_modes(client, dirs):
    """``permissions = group`` was set on the workers alive at init only: the worker that replaced a lost one wrote
    its node's next checkpoint files 0600 (directories 0700) where the others' were 0640. It is a worker plugin now,
    set up on every worker that joins."""
    import stat

    from conftest import wait_for_replaced_workers

    ctx = ftidask.init(client=client, **dirs, permissions="group")
    ctx.protect(1, da.arange(40_000, chunks=10_000).astype("f8"))
    ctx.checkpoint(1, 1)
    kill_worker(client, sorted(live_workers(client))[0])
    wait_for_replaced_workers(client, NWORKERS)
    ctx.checkpoint(2, 1)
    files = list(Path(dirs["ckpt_dir"]).glob("**/ckpt2.s*/Ckpt2-Rank*.fti"))
    assert len(files) == NWORKERS
    modes = {stat.S_IMODE(p.stat().st_mode) for p in files} | {stat.S_IMODE(p.parent.stat().st_mode) for p in files}
    assert modes == {0o640, 0o750}, sorted(map(oct, modes))
    ctx.finalize()
