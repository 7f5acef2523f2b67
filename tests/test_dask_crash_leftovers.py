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


@pytest.mark.parametrize("level", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_worker_killed_while_it_deletes_leaves_nothing_once_the_run_is_finalized(client, dirs, level):
    """The workers' removal threads are killed as they delete the retired checkpoint 1: its files stay in the trash.
    The run goes on (the nannies restart the workers) and finalizes: nothing of it may stay. Before, finalize waited
    for the live workers' deletions only, and the dead ones' trash was left for good (collected at a start of the
    same run only, which a finalized run never has)."""
    ctx = ftidask.init(client=client, group_size=2, **dirs)
    ctx.protect(1, da.random.default_rng(0).random((64, 48), chunks=(16, 48)), name="field")
    ctx.checkpoint(1, level)
    client.run(crashpoints.install, "ftidask.storage.removal:remove_tree")  # every worker dies as it deletes
    doomed = set(client.run(os.getpid))
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(2, level)  # retires checkpoint 1 (the workers rename its directories, then delete them)
    # The deletions run on the workers' removal threads after checkpoint 2 returned: each worker dies a moment later.
    # Checkpoint 3 must not start before they are gone (it would lose a worker mid-way), nor before their successors.
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
