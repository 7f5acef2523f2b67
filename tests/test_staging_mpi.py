"""Staging from MPI ranks under a real mpiexec: without heads (a thread per rank) and with a head rank."""

from __future__ import annotations

import os
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
