"""Restarts whose declared blocks differ from the checkpoint's, over real mpiexec.

* A structured dtype (with a sub-array field) is redistributed like any other: the old file's table records it as
  a JSON object, which the planner once refused as a dtype mismatch.
* The same number of ranks on the same nodes, each rank declaring another rank's block: the checkpoint has "this
  run's layout", and old rank r's file was loaded into rank r as it was, putting every block at the wrong place
  of the global array without a word. It is redistributed as declared, and so are blocks of other sizes (refused
  before, as arrays of the wrong size).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()


def _results(base: Path, mode: str, size: int) -> list[dict]:
    return [json.loads((base / f"{mode}-{size}-{r}.json").read_text()) for r in range(size)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("moved")
    run(2, "reshard_moved_job.py", "write", str(base), timeout=180)
    return base


def test_structured_dtype_redistributed(written: Path) -> None:
    run(3, "reshard_moved_job.py", "recover", str(written), timeout=180)
    for rank, res in enumerate(_results(written, "recover", 3)):
        assert res.get("ok") and res["equal"] and res["from"] == [1, 1], (rank, res)


@pytest.mark.parametrize("mode", ["swapped", "resized"])
def test_blocks_moved_between_ranks(written: Path, mode: str) -> None:
    run(2, "reshard_moved_job.py", mode, str(written), timeout=180)
    for rank, res in enumerate(_results(written, mode, 2)):
        assert res.get("ok") and res["equal"] and res["from"] == [1, 1], (rank, res)
