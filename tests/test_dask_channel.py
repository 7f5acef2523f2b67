"""L2/L3 over the workers' channels (ftidask.backends.dask.channel) on a real LocalCluster with worker processes.

A member that fails, or whose worker is killed (SIGKILL) in the middle of the level's stream, must
leave no member of its group waiting: the checkpoint fails in one sentence, promptly, the previous one
stays, and no worker is left running a level task. The blocks go worker to worker: a worker's memory
grows by the level's stripes, not by the group's files.
"""

import os
import threading
import time
from pathlib import Path

import psutil
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import crashpoints  # noqa: E402

import ftidask  # noqa: E402
from ftidask.backends.dask import channel  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 3
BOUND = 45  # seconds a failed checkpoint may take before the test calls it a hang


@pytest.fixture
def client():
    with distributed.LocalCluster(n_workers=NWORKERS, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", silence_logs=50) as cluster, \
            distributed.Client(cluster) as cl:
        cl.wait_for_workers(NWORKERS, timeout=60)
        yield cl


def crash_worker(client, rank, point, nth=1):
    """Install a crash point (:func:`crashpoints.install`) at the ``nth`` call in rank ``rank``'s worker."""
    address = sorted(client.run(os.getpid))[rank]
    client.run(crashpoints.install, point, nth, workers=[address])


def field(seed, rows=600):
    return da.random.default_rng(seed).random((rows, 512), chunks=(rows // 6, 512))


def idle(client, timeout=20.0):
    """Every worker ends its level tasks and forgets their sessions (no thread left blocked)."""
    end = time.monotonic() + timeout
    while True:
        executing = client.run(lambda dask_worker: len(dask_worker.state.executing))
        members = client.run(channel.busy_members)
        if not any(executing.values()) and not any(members.values()):
            return
        assert time.monotonic() < end, f"still executing {executing}, sessions {members}"
        time.sleep(0.2)


@pytest.mark.parametrize(("level", "point"), [
    (3, "ftidask.levels.rs:_read:raise"),  # a member's task fails in the middle of the parity stream
    (3, "ftidask.levels.rs:_read"),  # a member's worker is killed there
    (2, "ftidask.levels.partner:exchange_file:raise"),  # a member fails before its first block
])
def test_a_failing_member_leaves_no_member_waiting(client, dirs, level, point):
    # many stripes per file: 1 MiB each (a Dask L3 stripes by transfer_size), 8 MiB per worker
    ctx = ftidask.init(client=client, block_size=16, transfer_size=1, **dirs)
    ctx.protect(1, field(1, rows=6144))
    ctx.checkpoint(1, level)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] + 1)
    # at the 3rd block of rank 1's parity stream (after two rounds with its peers), or its first exchange
    crash_worker(client, 1, point, nth=3 if ":_read" in point else 1)
    start = time.monotonic()
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept") as err:
        ctx.checkpoint(2, level)
    assert time.monotonic() - start < BOUND
    message = str(err.value)
    assert message.count("\n") == 0
    if point.endswith(":raise"):
        assert "InjectedFailure" in message, message
    else:
        assert "(rank 1) left the cluster" in message, message
    idle(client)
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    assert not list(Path(dirs["ckpt_dir"]).glob("node*/*/l*/ckpt2.*"))
    ctx2 = ftidask.init(client=client, **dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from == (1, level)
    assert out[1].compute().tobytes() == saved.tobytes()


def test_the_next_checkpoint_works_after_an_aborted_one(client, dirs):
    """Sessions are per step: an aborted one leaves nothing that blocks the next checkpoint."""
    ctx = ftidask.init(client=client, block_size=16, **dirs)
    ctx.protect(1, field(2))
    crash_worker(client, 2, "ftidask.levels.rs:_read:raise")
    with pytest.raises(ftidask.CheckpointError):
        ctx.checkpoint(1, 3)
    idle(client)
    ctx.checkpoint(2, 3)  # the crash point fired once: this one runs through
    saved = ctx.protected[1].compute()
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.recover()[1].compute().tobytes() == saved.tobytes()
    assert ctx2.recovered_from == (2, 3)


def test_l3_parity_without_its_record_still_rebuilds(client, dirs):
    """A full L3 checkpoint written before the Dask backend kept parity records (``.hash``) rebuilds
    a lost file all the same: its parity is recorded as it is, and the rebuilt file is verified."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, field(3))
    ctx.checkpoint(1, 3)
    saved = ctx.protected[1].compute()
    records = list(Path(dirs["ckpt_dir"]).glob("node*/*/l3/ckpt1.*/*.hash"))
    assert len(records) == NWORKERS
    for rec in records:
        rec.unlink()
    own = next(Path(dirs["ckpt_dir"]).glob("node0/*/l3/ckpt1.*/Ckpt1-Rank0.fti"))
    own.unlink()  # rank 0's file is lost (its worker lives: it stands in for itself)
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.recover()[1].compute().tobytes() == saved.tobytes()
    assert own.exists()


def _rss(pids):
    return {w: psutil.Process(p).memory_info().rss for w, p in pids.items()}


def test_l3_worker_memory_is_bounded_by_the_stripes(client, dirs):
    """Each worker writes a 96 MiB file; the L3 step adds a few ``group x stripe`` to a worker's memory (peak
    resident set, sampled), not the group's files (3 x 96 MiB). A Dask L3 stripes by ``transfer_size``."""
    x = da.random.default_rng(4).random((3 * 12 * 1024, 1024), chunks=(4 * 1024, 1024)).persist()  # 9 x 32 MiB
    distributed.wait(x)
    ctx = ftidask.init(client=client, block_size=1024, transfer_size=1, **dirs)  # 1 MiB stripes
    ctx.protect(1, x)
    ctx.checkpoint(1, 1)  # the page cache and the write path warmed up
    pids = client.run(os.getpid)
    time.sleep(0.5)
    before = _rss(pids)
    peak = dict(before)
    done = []

    def sample():
        while not done:
            for w, rss in _rss(pids).items():
                peak[w] = max(peak[w], rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        info = ctx.checkpoint(2, 3)
    finally:
        done.append(True)
        sampler.join()
    size = max(info.file_sizes)
    extra = max(peak[w] - before[w] for w in pids)
    assert size > 80 << 20
    assert extra < 48 << 20, f"L3 added {extra / 2**20:.0f} MiB to a worker ({size / 2**20:.0f} MiB files)"


@pytest.mark.parametrize("level", [2, 3])
def test_a_rank_file_that_cannot_be_made_durable_fails_the_checkpoint(client, dirs, level):
    """At L2/L3 a worker's rank file is renamed unsynced and made durable by its level task, after the partner
    copy or parity: when that fsync fails on one worker, the checkpoint fails with its error, nothing of it stays,
    and the previous checkpoint is recovered."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, field(5))
    ctx.checkpoint(1, level)
    saved = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] + 1)
    crash_worker(client, 1, "ftidask.storage.files:make_durable:raise")
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept") as err:
        ctx.checkpoint(2, level)
    assert "InjectedFailure" in str(err.value) and "durable" in str(err.value), err.value
    idle(client)
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    assert not list(Path(dirs["ckpt_dir"]).glob("node*/*/l*/ckpt2.*"))
    ctx2 = ftidask.init(client=client, **dirs)
    assert ctx2.recover()[1].compute().tobytes() == saved.tobytes()
    assert ctx2.recovered_from == (1, level)
