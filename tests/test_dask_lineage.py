"""A checkpoint cuts the Dask lineage (issue 17), on a real LocalCluster of worker processes.

After ``ctx.checkpoint``, the protected arrays' chunks are tasks that read the checkpoint and
depend on nothing else; while the chunks stay in memory nothing is read or copied. A worker killed
(SIGKILL, its node directory erased where the level allows) during a later computation costs reads
of its chunks from the newest checkpoint, never a recomputation of the steps before it.
"""

import ctypes
import gc
import os
import time
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from campaign import kept  # noqa: E402
from conftest import lose_node, wait_for_replaced_workers  # noqa: E402
from test_dask_backend import crash_worker  # noqa: E402

import ftidask  # noqa: E402
from ftidask.backends.dask import lineage  # noqa: E402
from ftidask.ftiff.reader import parse_ftiff  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(420)]
NWORKERS = 4
SHAPE, CHUNKS = (64, 48), (16, 16)  # 12 chunks: 3 on each worker


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster; the nannies restart killed workers after each test (conftest.py)


# --- the iterative computation --------------------------------------------------------------------------


def _smooth(block):
    """One step on a block with a halo of 1 (periodic): neighbours' mean, mixed with a nonlinear term."""
    c = block[1:-1, 1:-1]
    mean = 0.25 * (block[:-2, 1:-1] + block[2:, 1:-1] + block[1:-1, :-2] + block[1:-1, 2:])
    return 0.5 * c + 0.5 * mean + 0.01 * np.sin(c)


CALLS: list[tuple[int, float]] = []  # in each worker process: (step, when) of each block computed


def _step_block(block, step=0):
    CALLS.append((step, time.time()))
    out = np.empty_like(block)
    out[1:-1, 1:-1] = _smooth(block)
    return out


def step(x, i):
    """Step ``i`` as a Dask array (its blocks say their step in the workers' ``CALLS``)."""
    return x.map_overlap(_step_block, depth=1, boundary="periodic", dtype=x.dtype, step=i)


def reference(steps, seed=0):
    """The undisturbed result, computed with NumPy alone (the same operations, element by element)."""
    x = initial(seed).compute(scheduler="sync")
    for _ in range(steps):
        x = _smooth(np.pad(x, 1, mode="wrap"))
    return x


def initial(seed=0):
    return da.random.default_rng(seed).random(SHAPE, chunks=CHUNKS)


def live_workers(client):
    return sorted(client.sync(client.scheduler.identity)["workers"])


def kill_rank(client, ctx, rank, erase=True, replaced=True):
    """SIGKILL the worker of rank ``rank`` of the last checkpoint (and erase its node directory); with
    ``replaced``, wait for its nanny's fresh worker (needed where the test checkpoints again)."""
    address = ctx.last_checkpoint.workers[rank]
    # (the directory erased before the cluster sees the loss: never while Dask reads the lost chunks again)
    lose_node(client.run(os.getpid, workers=[address])[address],
              Path(ctx.config.ckpt_dir) / f"node{rank}" if erase else None)
    end = time.monotonic() + 60
    while address in live_workers(client):
        assert time.monotonic() < end, "the killed worker is still listed"
        time.sleep(0.05)
    # Its nanny starts a fresh one (a replacement node): waited for, so that the next checkpoint does not
    # meet a worker still starting (on a loaded machine a slow start may be cut short by the nanny).
    if replaced:
        wait_for_replaced_workers(client, NWORKERS)
    return address


def _who_has(keys, dask_scheduler=None):
    """On the scheduler: the workers that hold each of ``keys`` in memory."""
    return {k: sorted(ws.address for ws in dask_scheduler.tasks[k].who_has or ()) for k in keys
            if k in dask_scheduler.tasks}


class Loss(NamedTuple):
    """What a kill took: the chunks (grid indices) of the newest checkpoint's array that the killed worker
    held, and those it held alone (no replica elsewhere: they must be read back)."""

    ckpt_id: int
    held: set
    alone: set


def kill_busiest(client, ctx, erase=True):
    """Kill the worker that holds the most chunks of the protected array alone (the chunks are not spread
    evenly: a worker may hold none, and killing it would test nothing). Returns the :class:`Loss`."""
    keys = [f.key for f in distributed.futures_of(ctx.protected[1])]
    who_has = client.run_on_scheduler(_who_has, keys)
    workers = ctx.last_checkpoint.workers
    alone = {w: {k[1:] for k in keys if who_has.get(k) == [w]} for w in workers}
    victim = max(workers, key=lambda w: len(alone[w]))  # the lowest rank of the busiest ones
    loss = Loss(ctx.last_checkpoint.id, {k[1:] for k in keys if victim in who_has.get(k, ())}, alone[victim])
    kill_rank(client, ctx, workers.index(victim), erase)
    return loss


def assert_restores(events, losses, level):
    """Each chunk a kill took with no replica elsewhere was read back once, from the then newest checkpoint at its
    level; none other was, but one also held elsewhere (Dask may drop that replica between the look and the kill)."""
    assert {(e["ckpt_id"], e["level"]) for e in events} == {(loss.ckpt_id, level) for loss in losses}
    for loss in losses:
        assert loss.alone, f"the killed worker held no chunk alone: nothing to read back ({loss})"
        read = [tuple(e["index"]) for e in events if e["ckpt_id"] == loss.ckpt_id]
        assert len(read) == len(set(read)), (loss, read)
        assert loss.alone <= set(read) <= loss.held, (loss, read)


def ran_keys(client, since):
    """Keys of the tasks that ran on the cluster since ``since`` (distributed's task stream)."""
    return [e["key"] for e in client.get_task_stream(start=since)]


def _calls():
    return list(CALLS)


def steps_run(client, since):
    """(step, seconds after ``since``, worker) of the blocks that the live workers computed since ``since``."""
    return sorted((step, round(when - since, 3), worker) for worker, calls in client.run(_calls).items()
                  for step, when in calls if when >= since)


def run(client, dirs, steps, every, level, kills=(), erase=True, crash=None, dcp=False, wait=True):
    """``steps`` steps, a checkpoint every ``every`` steps, a worker killed before each step of ``kills`` (by
    :func:`kill_busiest`). Returns the result, the steps of the original computation run again after a loss
    (must be none up to the last checkpoint), the restores' events and the :class:`Loss` of each kill."""
    ctx = ftidask.init(client=client, **dirs, **({"enable_dcp": 1} if dcp else {}))
    x = client.persist(initial())
    last_ckpt_step, losses, lost, rerun = 0, [], [], set()  # losses: (when, the last step checkpointed then)

    def look():  # before a kill too: what a worker about to die ran again would be gone with it
        rerun.update(s for since, upto in losses for s in steps_run(client, since) if s[0] <= upto)

    for s in range(1, steps + 1):
        if s in kills:
            look()
            losses.append((time.time(), last_ckpt_step))
            lost.append(kill_busiest(client, ctx, erase))
        x = client.persist(step(x, s))
        distributed.wait(x)
        if s % every == 0:
            ctx.protect(1, x, name="field")
            if crash is not None and s == crash[0]:
                losses.append((time.time(), last_ckpt_step))
                crash_worker(client, crash[1], crash[2])
                with pytest.raises(ftidask.CheckpointError):
                    ctx.checkpoint(s // every, level)
                continue
            out = ctx.checkpoint(s // every, level, wait=wait)
            info = out if wait else out.result()
            assert info.arrays[1] is ctx.protected[1]
            x = ctx.protected[1]
            last_ckpt_step = s
    result = x.compute()
    look()
    events = lineage.restores(client, ctx.exec_id)
    ctx.finalize()
    return result, sorted(rerun), events, lost


# --- what a checkpoint hands back ------------------------------------------------------------------------


def _held(keys, dask_worker=None):
    """On a worker: the data address of each of ``keys`` it holds, and its resident set size."""
    out = {}
    for k in keys:
        if k in dask_worker.data:
            out[k] = dask_worker.data[k].__array_interface__["data"][0]
    # Memory malloc keeps after a free (a buffer of the size of a chunk, freed, stays resident as free heap: seen as
    # a 2 MiB "growth" of one worker under load) goes back first: what is left resident is what is held.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"ptr": out, "rss": rss}


def _scheduler_view(keys, dask_scheduler=None):
    return {k: (dask_scheduler.tasks[k].state, [d.key for d in dask_scheduler.tasks[k].dependencies],
                getattr(dask_scheduler.tasks[k].run_spec, "func", None).__name__)
            for k in keys if k in dask_scheduler.tasks}


@pytest.mark.parametrize("wait", [True, False])
def test_checkpoint_cuts_lineage_without_reading_or_copying(client, dirs, wait):
    """The arrays handed back read the checkpoint if ever recomputed; meanwhile they are the very chunks
    that were in memory: same addresses, no growth of the workers' memory, no read task run."""
    ctx = ftidask.init(client=client, **dirs)
    def big():  # 16 MiB in 2 MiB chunks, the same values at each call
        return da.random.default_rng(1).random((2048, 1024), chunks=(512, 512))

    ctx.protect(1, big() + 2, name="field")
    ctx.checkpoint(1, 1)  # a first one warms up what a checkpoint uses on the workers; its array stays alive:
    warm = ctx.protected[1]  # noqa: F841 - its release would hide a copy in the figures
    x = client.persist(big() + 1)
    distributed.wait(x)
    old = [f.key for f in distributed.futures_of(x)]
    before = client.run(_held, old)
    ctx.protect(1, x, name="field")
    since = time.time()
    out = ctx.checkpoint(2, 1, wait=wait)
    info = out if wait else out.result()
    assert not wait or isinstance(info, ftidask.CheckpointInfo)
    y = ctx.protected[1]
    assert info.arrays[1] is y
    keys = [f.key for f in distributed.futures_of(y)]
    assert len(keys) == 8 and all(k[0].startswith("ftidask-lineage-ckpt2-") for k in keys)
    # Nothing of the old computation in the new graph, nor in the scheduler's tasks
    assert all(isinstance(v, distributed.Future) for v in dict(y.__dask_graph__()).values())
    view = client.run_on_scheduler(_scheduler_view, keys)
    assert all(v == ("memory", [], "read_lineage_chunk") for v in view.values()), view
    del x
    deadline = time.monotonic() + 60  # the old keys released on the workers (they held the chunks under both)
    while any(w["ptr"] for w in client.run(_held, old).values()):
        assert time.monotonic() < deadline, "the workers still hold the old keys"
        time.sleep(0.05)
    after = client.run(_held, keys)
    ptr_before = {k[1:]: p for w in before.values() for k, p in w["ptr"].items()}
    ptr_after = {k[1:]: p for w in after.values() for k, p in w["ptr"].items()}
    assert ptr_after == ptr_before  # the same buffers: aliased, not copied
    growth = max(after[w]["rss"] - before[w]["rss"] for w in after)
    print(f"worker RSS growth across the checkpoint and its cut: {[after[w]['rss'] - before[w]['rss'] for w in after]}")
    assert growth < 1 << 20, f"a worker grew by {growth} bytes (a copy of its chunks would be 4 MiB)"
    assert not [k for k in ran_keys(client, since) if str(k[0] if isinstance(k, tuple) else k).startswith(
        "ftidask-lineage")]
    assert y.compute().tobytes() == (big() + 1).compute().tobytes()
    assert lineage.restores(client, ctx.exec_id) == []
    ctx.finalize()


@pytest.mark.parametrize(("level", "erase"), [pytest.param(1, False, marks=pytest.mark.slow), (2, True), (3, True),
                                               pytest.param(4, True, marks=pytest.mark.slow)])
def test_lost_worker_is_read_back_not_recomputed(client, dirs, level, erase):
    """12 steps, a checkpoint every 3; a worker dies before step 8: its chunks come back from checkpoint 2
    (step 6), steps 7.. run again where needed, nothing before; bit for bit."""
    result, rerun, events, lost = run(client, dirs, 12, 3, level, kills=(8,), erase=erase)
    assert result.tobytes() == reference(12).tobytes()
    assert rerun == []
    assert_restores(events, lost, level)
    how = {e["how"] for e in events}
    assert how <= {1: {"its file"}, 2: {"partner copy"}, 3: {"rebuilt from the group's parity", "its file"},
                   4: {"global file"}}[level]


def test_level1_lost_node_fails_naming_chunk_and_checkpoint(client, dirs):
    """L1 keeps no copy: a chunk lost with its node is an ftidask error naming it, never wrong data."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 1)
    y = ctx.protected[1]
    kill_rank(client, ctx, 1, erase=True)
    with pytest.raises(ftidask.RecoveryError,
                       match=r"chunk \(\d+, \d+\) of variable 1 \(field\) was lost with its worker and cannot be "
                             r"restored from checkpoint 1 \(level 1\).*level 1 keeps no copy"):
        client.compute(y + 1).result(timeout=60)
    ctx.finalize()


@pytest.mark.parametrize(("level", "ranks"), [pytest.param(2, (0, 2), marks=pytest.mark.slow), (3, (1, 3))])
def test_two_workers_lost_where_the_level_survives(client, dirs, level, ranks):
    """Two nodes lost (processes killed, directories erased): L2 (not neighbours) and L3 (half a group)
    bring their chunks back; the restores say which chunk came from which checkpoint and level, and how."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, client.persist(initial()), name="field")
    ctx.checkpoint(1, level)
    y = ctx.protected[1]
    for rank in ranks:  # no checkpoint follows: the replacements are not waited for
        kill_rank(client, ctx, rank, erase=True, replaced=False)
    assert client.compute(step(y, 1)).result(timeout=60).tobytes() == reference(1).tobytes()
    lost = {tuple(i) for i, r, _d, _n in ctx.state.records()[-1].extra["chunks"]["1"] if r in ranks}
    events = lineage.restores(client, ctx.exec_id)
    # (a chunk read back after the first loss onto the second worker lost is read back once more)
    assert {tuple(e["index"]) for e in events} == lost
    assert {(e["ckpt_id"], e["level"], e["name"]) for e in events} == {(1, level, "field")}
    assert {e["how"] for e in events} <= ({"partner copy"} if level == 2 else
                                          {"rebuilt from the group's parity", "its file"})
    ctx.finalize()


def flip_each_chunk(path: Path) -> None:
    """Flip one bit in the middle of each chunk's data in the file (its size and metadata unchanged)."""
    with open(path, "rb") as fh:
        metas = [m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.hascontent]
    with open(path, "r+b") as fh:
        for meta in metas:
            fh.seek(meta.fptr + meta.chunksize // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x10]))


def test_damaged_file_fails_naming_chunk_and_checkpoint(client, dirs):
    """A chunk whose file is damaged is never handed back: the error names it and the checkpoint."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 1)
    y = ctx.protected[1]
    rank = 1
    path = next(Path(ctx.config.ckpt_dir).glob(f"node{rank}/*/l1/ckpt1.*/Ckpt1-Rank{rank}.fti"))
    with open(path, "rb") as fh:
        meta = next(m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.hascontent)
    with open(path, "r+b") as fh:  # one flipped bit in the middle of a chunk's data
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))
    kill_rank(client, ctx, rank, erase=False)
    with pytest.raises(ftidask.RecoveryError, match=r"chunk \(\d+, \d+\) of variable 1 \(field\) .* from checkpoint 1 "
                                                    r"\(level 1\): .*hash does not match"):
        client.compute(y).result(timeout=60)
    ctx.finalize()


@pytest.mark.slow
def test_damaged_own_file_is_read_from_its_partner_copy(client, dirs):
    """Found by the Dask sequences (g3 seed 903): at L2, a chunk lost with its worker whose own file is damaged
    (flipped bytes, the file still there) is read from the partner copy, as recovery does; before, the read stopped
    at the own file's hash mismatch (a RecoveryError, although the level had a sound copy)."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    y = ctx.protected[1]
    rank = 1
    path = next(Path(ctx.config.ckpt_dir).glob(f"node{rank}/*/l2/ckpt1.*/Ckpt1-Rank{rank}.fti"))
    flip_each_chunk(path)
    kill_rank(client, ctx, rank, erase=False)
    assert client.compute(y).result(timeout=60).tobytes() == initial().compute().tobytes()
    events = [e for e in lineage.restores(client, ctx.exec_id) if e["ckpt_id"] == 1]
    assert events and {e["how"] for e in events} == {"partner copy"}
    ctx.finalize()


def test_worker_killed_during_a_checkpoint(client, dirs):
    """Checkpoint 3 (step 9) fails as rank 1's worker dies sending its L2 copy: the run goes on, the
    lost chunks are recomputed from checkpoint 2 (step 6), never from before it; bit for bit."""
    result, rerun, _events, _lost = run(client, dirs, 12, 3, 2, crash=(9, 1, "ftidask.levels.partner:exchange_file"))
    assert result.tobytes() == reference(12).tobytes()
    assert rerun == []


@pytest.mark.parametrize(("level", "wait"), [(6, False), pytest.param(5, True, marks=pytest.mark.slow),
                                             pytest.param(7, False, marks=pytest.mark.slow),
                                             pytest.param(8, True, marks=pytest.mark.slow),
                                             pytest.param(3, False, marks=pytest.mark.slow)])
def test_differential_and_asynchronous_checkpoints(client, dirs, level, wait):
    """Differential checkpoints (levels 5-8: L1-L4) and asynchronous ones cut the lineage too; the lost
    worker's node directory is erased where the level keeps a copy."""
    result, rerun, events, lost = run(client, dirs, 12, 3, level, kills=(8,), erase=level != 5, dcp=level > 4,
                                      wait=wait)
    assert result.tobytes() == reference(12).tobytes()
    assert rerun == []
    assert_restores(events, lost, level - 4 if level > 4 else level)


@pytest.mark.slow
def test_recovered_arrays_keep_their_checkpoint(client, dirs):
    """The arrays recover() returns read their checkpoint back too: it is kept while they live."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    ctx._close()  # the program dies: its arrays (which read checkpoint 1 too, and would keep it) go with it
    del ctx
    gc.collect()
    ctx2 = ftidask.init(client=client, **dirs)
    back = ctx2.recover()[1]
    ctx2.protect(1, back + 1)
    ctx2.checkpoint(2, 2)
    assert [r.ckpt_id for r in ctx2.state.records()] == [1, 2]
    kill_rank(client, ctx2, 1, erase=True)
    assert client.compute(back).result(timeout=60).tobytes() == initial().compute().tobytes()
    del back
    ctx2.protect(1, ctx2.protected[1] + 1)
    ctx2.checkpoint(3, 2)
    assert [r.ckpt_id for r in ctx2.state.records()] == [3]
    ctx2.finalize()


@pytest.mark.slow
def test_recovered_array_reads_a_damaged_file_from_its_partner_copy(client, dirs):
    """The chunks of a recovered array lost with their worker are read again: at L2, a file damaged since the
    recovery is read from its partner copy, as the lineage reads do (before, the read failed at the hash)."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    ctx2 = ftidask.init(client=client, **dirs)
    back = ctx2.recover()[1]
    rank = 1
    path = next(Path(ctx.config.ckpt_dir).glob(f"node{rank}/*/l2/ckpt1.*/Ckpt1-Rank{rank}.fti"))
    flip_each_chunk(path)
    kill_rank(client, ctx, rank, erase=False)
    assert client.compute(back).result(timeout=60).tobytes() == initial().compute().tobytes()
    del back
    ctx2.finalize()
    ctx.finalize()


def test_retention_keeps_a_checkpoint_a_live_array_reads(client, dirs):
    """An L2 checkpoint retires the older L2 ones, except those a live array may still read back from."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 2)
    old = ctx.protected[1]  # reads checkpoint 1 back if a chunk is lost
    ctx.protect(1, old + 1)
    ctx.checkpoint(2, 2)
    assert [r.ckpt_id for r in ctx.state.records()] == [1, 2]
    x = ctx.protected[1] + 1  # held while checkpoint 3 is written: computed from checkpoint 2
    ctx.protect(1, x)
    ctx.checkpoint(3, 2)
    assert [r.ckpt_id for r in ctx.state.records()] == [1, 2, 3]
    del x
    kill_rank(client, ctx, 0, erase=True)
    assert client.compute(old).result(timeout=60).tobytes() == initial().compute().tobytes()
    del old
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(4, 2)  # 1 and 2 are read by no live array any more
    assert [r.ckpt_id for r in ctx.state.records()] == [4]
    ctx.finalize()


def test_two_checkpoints_in_flight_of_an_unchanged_array_leave_the_newest_cut(client, dirs):
    """With two asynchronous checkpoints in flight of one array, the second cut replaces the first one's (the
    first checkpoint's cut was handed back meanwhile): the first checkpoint is retired at the second's commit."""
    ctx = ftidask.init(client=client, **dirs, max_inflight=2)
    x = client.persist(initial())
    ctx.protect(1, x, name="field")
    first, second = ctx.checkpoint(1, 1, wait=False), ctx.checkpoint(2, 1, wait=False)
    first.result()
    second.result()
    del x
    assert [r.ckpt_id for r in ctx.state.records()] == [2]
    keys = [f.key for f in distributed.futures_of(ctx.protected[1])]
    assert keys and all(k[0].startswith("ftidask-lineage-ckpt2-") for k in keys)
    assert client.compute(ctx.protected[1]).result(timeout=60).tobytes() == initial().compute().tobytes()
    ctx.finalize()


def _slow_chunk(i):
    time.sleep(0.6)  # longer than the cluster's poll (0.25 s): the checkpoint's wait times out before it is done
    return np.full(1000, i, np.float64)


def test_a_checkpoint_that_waited_keeps_nothing_alive(client, dirs):
    """Waiting for arrays slower than the cluster's poll raises (and drops) timeouts; none may keep the checkpoint's
    frame, with its futures and the arrays whose lineage it cut: garbage collection disabled, no such frame is
    left, and the next commit retires the checkpoint before it without a collection."""
    import dask

    ctx = ftidask.init(client=client, **dirs)
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.disable()
    gc.callbacks.append(count)
    try:
        for i in (1, 2):
            ctx.protect(1, da.concatenate([da.from_delayed(dask.delayed(_slow_chunk)(10 * i + j), (1000,), np.float64)
                                           for j in range(2)]))
            collections.clear()
            ctx.checkpoint(i, 1)
            left = [f for f in gc.get_objects() if isinstance(f, types.FrameType)
                    and f.f_code.co_name == "_write_checkpoint"]
            assert left == [] and collections == []
        assert [r.ckpt_id for r in ctx.state.records()] == [2]
        assert np.array_equal(ctx.protected[1].compute(), np.repeat([20.0, 21.0], 1000))
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    ctx.finalize()


@pytest.mark.slow
@pytest.mark.parametrize("level", kept([2, 3], [2]))  # 3: -m campaign (80 s, CI's budget)
def test_long_run_with_a_lost_worker(client, dirs, level):
    """60 steps, a checkpoint every 5, a worker killed before step 33 and another before step 51: the chunks
    each held alone are read back from checkpoint 6, then 10, and nothing before them runs again."""
    result, rerun, events, lost = run(client, dirs, 60, 5, level, kills=(33, 51))
    assert result.tobytes() == reference(60).tobytes()
    assert rerun == []
    assert [loss.ckpt_id for loss in lost] == [6, 10]
    assert_restores(events, lost, level)

