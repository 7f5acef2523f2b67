"""Checkpoints recovered by MPI ranks on another layout (real mpiexec): a Dask checkpoint, an MPI checkpoint on another
node layout; the ranks agree on every step, and the Python states are recovered as the arrays are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()


def test_a_state_only_some_ranks_cannot_take_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Two Dask checkpoints holding an ftidask.Value (a list) under id 2; on 2 MPI ranks, rank 0 protects a State (a
    dict: it cannot take a list), rank 1 a Value. Every rank refuses both checkpoints, nothing touched anywhere.
    Before, rank 1 recovered checkpoint 2 and returned while rank 0 went on to checkpoint 1 alone: a hang."""
    distributed = pytest.importorskip("distributed")
    da = pytest.importorskip("dask.array")
    import ftidask

    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 3}
    a = np.arange(60.0).reshape(6, 10)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.from_array(a, chunks=(4, 3)))
        ctx.protect(2, ftidask.Value([1, 2]))
        ctx.checkpoint(1, 4)
        ctx.protect(1, da.from_array(a + 1, chunks=(4, 3)))
        ctx.checkpoint(2, 1)
        ctx._close()
    out = tmp_path / "out"
    out.mkdir()
    run(2, "dask_state_job.py", str(out), dirs["ckpt_dir"], dirs["glbl_dir"], dirs["meta_dir"], timeout=90)
    results = [json.loads((out / f"r{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert "NoCheckpointError" in result.get("error", ""), result
        assert "holds a list" in result["error"] and result["untouched"], result


def test_python_states_recovered_on_another_node_layout(tmp_path: Path) -> None:
    """2 ranks, each with an array and an ftidask.State, checkpointed one rank per node; restarted two ranks per node
    (the files are read from the old nodes' directories): each rank's array and State exactly as its old rank's.
    Before, the arrays were recovered and the States silently kept their new values (the stored bytes went into a
    buffer that was never decoded)."""
    dirs = [str(tmp_path / d) for d in ("Local", "Global", "Meta")]
    out = tmp_path / "out"
    out.mkdir()
    run(2, "state_layout_job.py", "write", str(out), *dirs, "1", timeout=90)
    run(2, "state_layout_job.py", "recover", str(out), *dirs, "2", timeout=90)
    for r in range(2):
        result = json.loads((out / f"r{r}.json").read_text())
        assert result.get("from") == [1, 1], result
        assert result["a"] == (np.arange(4.0) + r).tolist() and result["state"] == {"step": 5 + r}, result
