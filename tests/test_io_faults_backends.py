"""I/O faults on the MPI and Dask backends (see test_io_faults.py): a small full tmpfs as one node's disk
(root only, see ``diskfull``), a rank file replaced by a directory, a read error on one file's inode.

Every rank (the Dask client) gets one clear error naming the failing rank and its file, or the level's
redundancy repairs the loss; no rank hangs (the job's timeout).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
from diskfull import fill, tmpfs
from mpi_util import need_mpi, run

import ftidask
from ftidask.storage.files import find_paths

# --- MPI: the same over mpiexec, the fault on one rank's node ---------------------------------------------

WRITES = ["l1-full", "l2-full", "l2-room1", "l3-room1", "l7-room1", "l3-async"]
READS = ["l2-dir", "l3-dir", "l2-eio", "l3-eio", "l2-rebuildfull", "l3-rebuildfull"]


@pytest.mark.slow  # two mpiexec jobs of 3 ranks, 12 scenarios: about 7 s
def test_mpi_disk_faults_on_one_node(tmp_path):
    """Rank 1's node full (its own file, or the partner copy or parity it keeps), a rank file replaced by a
    directory, a read error, a rebuild on a full node: every rank gets the same error, naming rank 1 and
    its file, or the level repairs the loss; no rank hangs (the job's timeout)."""
    with contextlib.ExitStack() as mounts:
        for scenario in WRITES + READS:
            node1 = mounts.enter_context(tmpfs(tmp_path / scenario / "Local" / "node1", "4m"))
            node1.chmod(0o700)
        run(3, "disk_fault_job.py", str(tmp_path), *WRITES, timeout=240)
        run(3, "disk_fault_job.py", str(tmp_path), *READS, timeout=240)
    for scenario in WRITES:
        level = int(scenario.split("-")[0][1:])
        results = [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(3)]
        assert {r["error"] for r in results} == {"CheckpointError"}, (scenario, results)
        message = results[0]["message"]
        assert len({r["message"] for r in results}) == 1, (scenario, results)  # the same error on every rank
        assert "rank 1: " in message and "No space left on device" in message, (scenario, message)
        assert str(tmp_path / scenario / "Local" / "node1") in message, (scenario, message)  # where
        assert results[0]["previous_intact"] and results[0]["temps"] == [], (scenario, results[0])
        assert all(r["after"] == {"error": None} for r in results), (scenario, results)
        assert all(r["restart"]["recovered"] == [3, (level - 1) % 4 + 1] and r["restart"]["same"]
                   for r in results), (scenario, results)
    for scenario in READS:
        level = int(scenario.split("-")[0][1:])
        results = [json.loads((tmp_path / f"{scenario}-{r}.json").read_text()) for r in range(3)]
        if scenario.endswith("rebuildfull"):  # the level cannot write the file back: said, arrays untouched
            assert {r["error"] for r in results} == {"NoCheckpointError"}, (scenario, results)
            assert "rebuilding it failed" in results[0]["message"], results[0]
            assert "No space left on device" in results[0]["message"], results[0]
            assert all(r["untouched"] for r in results), (scenario, results)
        else:  # the partner copy or the parity brings the file back
            assert all(r["error"] is None and r["recovered"] == [2, level] and r["same"] for r in results), \
                (scenario, results)


for _mark in need_mpi():
    test_mpi_disk_faults_on_one_node = _mark(test_mpi_disk_faults_on_one_node)


# --- Dask: the same on a real LocalCluster --------------------------------------------------------------

NWORKERS = 3  # the shared cluster of the Dask tests (conftest.py): one L2 ring / L3 group of three workers


@pytest.mark.dask
@pytest.mark.slow  # a cluster of its own size: 6 s to 17 s
@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [2, 3])
def test_dask_rebuild_on_a_full_disk_says_why_and_rebuilds_over_a_directory(tmp_path, dirs, dask_client, level):
    da = pytest.importorskip("dask.array")
    node1 = Path(dirs["ckpt_dir"]) / "node1"
    with tmpfs(node1, "2m"):
        node1.chmod(0o700)
        ctx = ftidask.init(client=dask_client, group_size=NWORKERS, **dirs)
        ctx.protect(1, da.arange(60_000.0, chunks=20_000).persist())
        ctx.checkpoint(1, level)
        lost = next(iter(find_paths(node1, "Ckpt1-Rank1.fti")))
        lost.unlink()
        filler = fill(node1)
        ctx = ftidask.init(client=dask_client, group_size=NWORKERS, **dirs)
        zeros = da.zeros(60_000, chunks=20_000).persist()
        ctx.protect(1, zeros)
        with pytest.raises(ftidask.RecoveryError, match="No space left on device") as refused:
            ctx.recover()
        assert str(lost) in str(refused.value)
        assert ctx.protected[1] is zeros
        filler.unlink()
        ctx.recover()
        assert ctx.recovered_from == (1, level)
        np.testing.assert_array_equal(ctx.protected[1].compute(), np.arange(60_000.0))
        lost.unlink()  # rebuilt: now replaced by a directory, which the rebuild's rename could not replace
        lost.mkdir()
        (lost / "inside").write_bytes(b"x")
        ctx = ftidask.init(client=dask_client, group_size=NWORKERS, **dirs)
        ctx.protect(1, da.zeros(60_000, chunks=20_000).persist())
        ctx.recover()
        assert ctx.recovered_from == (1, level) and lost.is_file()
        np.testing.assert_array_equal(ctx.protected[1].compute(), np.arange(60_000.0))
        ctx.finalize()
