"""The package's layering, as import contracts (pyproject.toml, [tool.importlinter]), checked by import-linter."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    """Only the MPI transport imports mpi4py, only the Dask backend distributed, levels know no backend..."""
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
