"""Helpers of the MPI tests: run real ``mpiexec`` jobs with timeouts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "mpi_scripts"


def mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def need_mpi() -> list:
    try:
        import mpi4py  # noqa: F401
        have = mpiexec() is not None
    except ImportError:
        have = False
    return [pytest.mark.mpi, pytest.mark.skipif(not have, reason="needs mpi4py and mpiexec")]


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def run(n: int, script: str, *args: str, timeout: float = 120, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` on ``n`` ranks; a hang fails the test at ``timeout`` seconds."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    proc = subprocess.run(cmd, env=env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc
