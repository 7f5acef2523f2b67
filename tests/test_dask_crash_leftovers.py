"""Leftovers found by the Dask crash campaign (test_dask_crash_campaign.py): files of a finalized run that nothing
ever removes, on a real LocalCluster.

What a killed worker leaves (its trash, half deleted) is removed at the next start of its run; a run that goes on
and finalizes must remove it itself: marked finalized, nobody looks at its directories again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import crashpoints  # noqa: E402
from conftest import wait_for_replaced_workers  # noqa: E402

import ftidask  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(180)]
NWORKERS = 2


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster, its killed workers restarted after each test (conftest.py)


def files_left(dirs: dict) -> list[str]:
    return sorted(str(p) for d in ("ckpt_dir", "glbl_dir") for p in find_paths(Path(dirs[d]), "*") if p.is_file())


REMOVE_TREE = "ftidask.storage.removal:remove_tree"


def _trash_pids(dirs: dict) -> set[int]:
    """The pids of the processes that renamed the node directories' trash entries (``.trash-NAME-PID-HEX``)."""
    return {int(part.rsplit("-", 2)[1]) for p in find_paths(Path(dirs["ckpt_dir"]), "*") for part in p.parts
            if part.startswith(".trash-")}


def _start_removal_thread() -> None:
    """Start this worker's removal thread (made on a worker's first deletion), as an earlier test would have."""
    from ftidask.backends.dask import tasks

    tasks._remover().submit(int).result()


def _disarm(point: str) -> None:
    """Take the crash point ``point`` (``module:function``, :func:`crashpoints.install`) out of this worker again: the
    function as it was, the worker no longer listed as carrying a test seam (it may serve the next test)."""
    import importlib

    module, name = point.split(":")
    owner = importlib.import_module(module)
    setattr(owner, name, getattr(owner, name).__wrapped__)  # the crash point's wrapper (functools.wraps)
    crashpoints.INSTALLED.remove(point)


@pytest.mark.parametrize("level", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_worker_killed_while_it_deletes_leaves_nothing_once_the_run_is_finalized(client, dirs, level):
    """The workers' removal threads are killed as they delete the retired checkpoint 1 (those of the workers that
    renamed its directories: one or every one, a race): its files stay in the trash. The run goes on (the nannies
    restart the workers) and finalizes: nothing of it may stay. Before, finalize waited for the live workers'
    deletions only, and the dead ones' trash was left for good (collected at a start of the same run only, which a
    finalized run never has)."""
    ctx = ftidask.init(client=client, group_size=2, **dirs)
    ctx.protect(1, da.random.default_rng(0).random((64, 48), chunks=(16, 48)), name="field")
    ctx.checkpoint(1, level)
    client.run(_start_removal_thread)  # the same race whether an earlier test deleted something on the cluster or not
    client.run(crashpoints.install, REMOVE_TREE)  # a worker dies as it deletes
    pids = client.run(os.getpid)
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(2, level)  # retires checkpoint 1 (the workers rename its directories, then delete them)
    # Every worker renames every node's directory it finds (one disk here): the first to come renames it, the others
    # find it gone. Which worker renamed what is a race: a worker warm from an earlier test on the shared cluster (its
    # removal thread started) often renamed all of them before the other came, which then had nothing to delete and
    # never died (the test failed after any test that had deleted something, passed when run first). The doomed
    # workers are those whose pid names a trash entry; the others are disarmed now (their next deletion, of
    # checkpoint 2, would kill them in the middle of checkpoint 3 or finalize) and live on.
    renamed = _trash_pids(dirs)
    doomed = {address for address, pid in pids.items() if pid in renamed}
    assert doomed, f"no trash of checkpoint 1 renamed by a worker: {files_left(dirs)}"
    if set(pids) - doomed:
        client.run(_disarm, REMOVE_TREE, workers=sorted(set(pids) - doomed))
    # The deletions run on the workers' removal threads after checkpoint 2 returned: each doomed worker dies a moment
    # later. Checkpoint 3 must not start before they are gone (it would lose a worker mid-way), nor before their
    # successors.
    deadline = time.monotonic() + 60
    while doomed & set(client.sync(client.scheduler.identity)["workers"]):
        assert time.monotonic() < deadline, "a worker did not die as it deleted checkpoint 1"
        time.sleep(0.05)
    wait_for_replaced_workers(client, NWORKERS)
    trash = [f for f in files_left(dirs) if "/.trash-" in f]
    assert trash, f"no trash left by the killed workers: {files_left(dirs)}"
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(3, level)
    ctx.finalize()
    assert files_left(dirs) == []


def test_a_task_the_cluster_cancelled_fails_the_wait_as_a_cluster_error(client):
    """The scheduler cancels a checkpoint's task when its worker is killed in it (the campaign saw "Futures cancelled
    for reason: already forgotten"): distributed.wait raised FuturesCancelledError out of the checkpoint, a Dask error
    instead of CheckpointError, and the checkpoint's directories were not discarded. The wait now says which task
    was cancelled, as a ClusterError (a checkpoint turns it into CheckpointError and discards its files)."""
    import time

    from ftidask.backends.dask.cluster import Cluster, ClusterError

    cluster = Cluster(client, "off")
    future = client.submit(time.sleep, 30, pure=False, key="ftidask-write-9-9-0")
    client.cancel([future], force=True)
    with pytest.raises(ClusterError, match="ftidask-write-9-9-0 were cancelled or lost"):
        cluster.wait_all([future], [], "checkpoint 9")


WRITE_RANK = "ftidask.backends.dask.tasks:write_rank"


def _write_fails_or_lags(failing: str, marks: str) -> None:
    """On a worker: its checkpoint writes fail at once (``failing`` is this worker) or end 1.5 s late, each leaving a
    file in ``marks`` once its write returned (the test waits for them)."""
    import functools
    import importlib
    import time as clock

    from distributed import get_worker

    module, name = WRITE_RANK.split(":")
    owner = importlib.import_module(module)
    original = getattr(owner, name)

    @functools.wraps(original)
    def write(*args, **kwargs):
        if get_worker().address == failing:
            raise OSError(28, "No space left on device (injected)")
        clock.sleep(1.5)  # still running when the checkpoint has failed and its directories are gone
        try:
            return original(*args, **kwargs)
        finally:
            Path(marks, f"{os.getpid()}-{clock.monotonic_ns()}").touch()

    setattr(owner, name, write)
    crashpoints.INSTALLED.append(WRITE_RANK)


@pytest.mark.parametrize("then", ["goes on", "finalizes"])
def test_a_failed_checkpoints_writes_still_running_leave_nothing(client, dirs, tmp_path, then):
    """Rank 1's write of checkpoint 2 fails at once; rank 0's is still running and renames its file into the
    checkpoint's directory after the client discarded it (cancelling a task does not stop its thread). That file
    stayed until the next commit's collection, and for ever when the run was finalized right after (finalize: "a
    finished run leaves no file"). The workers now know the checkpoint failed: a task still running removes what it
    wrote."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.random.default_rng(0).random((64, 48), chunks=(32, 48)), name="field")
    ctx.checkpoint(1, 4)
    kept = files_left(dirs)
    workers = sorted(client.scheduler_info()["workers"])
    marks = tmp_path / "marks"
    marks.mkdir()
    client.run(_write_fails_or_lags, workers[1], str(marks))
    try:
        ctx.protect(1, ctx.protected[1] + 1)
        with pytest.raises(ftidask.CheckpointError, match="checkpoint 2 at level 4 failed.*No space left"):
            ctx.checkpoint(2, 4)
        if then == "finalizes":
            ctx.finalize()  # at once: rank 0's write still runs
        deadline = time.monotonic() + 60
        while not any(marks.iterdir()) and time.monotonic() < deadline:  # rank 0's write has returned
            time.sleep(0.1)
        time.sleep(0.5)  # (its task's last step, after the write)
        assert files_left(dirs) == ([] if then == "finalizes" else kept), files_left(dirs)
        if then == "goes on":
            ctx.finalize()
    finally:
        client.run(_disarm, WRITE_RANK)
