"""The Dask quickstart notebook runs end to end (LocalCluster, checkpoint, lose a worker, recover)."""

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("distributed")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "dask_quickstart.ipynb"

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


def test_quickstart_notebook_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The kernel must be this interpreter (the venv's), whatever kernel spec is installed.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=240,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "bit for bit" in outputs
    assert "status 1" in outputs
