"""Staging from MPI ranks under a real mpiexec: without heads (a thread per rank) and with a head rank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
SCRIPT = Path(__file__).with_name("mpi_staging_script.py")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("mode", ["nohead", "head", "headpoll"])
def test_mpi_ranks_stage_files(tmp_path, mode):
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, os.fspath(SCRIPT), mode, os.fspath(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STAGING-OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    ranks = [0, 1, 2] if mode == "nohead" else [1, 2]
    for r in ranks:
        assert len(list((tmp_path / "global" / f"r{r}").iterdir())) == 20


# --- through ftidask.init(comm=...): the MPI transport picks the mover ------------------------------

@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize(("nprocs", "cfg", "mover"), [
    (2, {"local_test": 1, "node_size": 1}, "ThreadMover"),  # without heads: a thread of each rank
    (4, {"local_test": 1, "node_size": 2, "head": 1, "inline_l4": 0}, "HeadStageMover"),  # the heads copy
])
def test_context_staging_over_mpi(tmp_path, nprocs, cfg, mover):
    _run_stage_job(tmp_path, nprocs, cfg, mover)


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_heads_stage_256_mib_files(tmp_path):
    _run_stage_job(tmp_path, 4, {"local_test": 1, "node_size": 2, "head": 1, "inline_l4": 0}, "HeadStageMover",
                   "256")


def _run_stage_job(tmp_path, nprocs, cfg, mover, *extra):
    import json

    script = Path(__file__).with_name("mpi_scripts") / "stage_job.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.fspath(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([MPIEXEC, "-n", str(nprocs), sys.executable, os.fspath(script), json.dumps(cfg),
                           os.fspath(tmp_path), *extra], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # Ranks share one stdout pipe: their lines may run together, so match records, not lines.
    lines = re.findall(r"(STAGED) (\d+) (\w+) (True|False) (\[(?:\[[\d, ]*\](?:, )?)*\])", proc.stdout)
    assert len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    for _tag, _rank, used, ok, sequences in lines:
        assert used == mover and ok == "True", sequences
        for seq in json.loads(sequences):  # FTI's order: pending, active, success (polling may skip states)
            assert seq[-1] == 0 and seq == sorted(seq, reverse=True)
