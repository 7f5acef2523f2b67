"""Every notebook under notebooks/ runs top to bottom on a fresh kernel."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The Dask notebooks start clusters, kill workers and restart them (one to two minutes each on 2 cores):
# they run with the slow tests, so that the default run stays within its ten minutes.
HEAVY = {"dask_quickstart", "dask_lineage"}
PARAMS = [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in HEAVY else []) for p in NOTEBOOKS]


@pytest.mark.parametrize("path", PARAMS)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # The kernel is a child of this interpreter: it imports this checkout and draws no windows.
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and the traceback, if a cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # A new user reads every line: no warning on stderr (e.g. tqdm's TqdmWarning about ipywidgets)
    stderr = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "stream" and o.get("name") == "stderr"]
    assert not any("Warning" in text for text in stderr), stderr
    if path.stem == "xarray_view":  # the plot is shown inline, not only saved
        images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {})]
        assert images
