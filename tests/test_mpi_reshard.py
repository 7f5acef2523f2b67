"""Issue 18, items 1-2 over real mpiexec: checkpoints written by 4 ranks, recovered on 2, 3 and 8.

One write job (4 ranks: an L1 and an L4 checkpoint whose variables declare their blocks, 1-D and 2-D,
C and Fortran order, replicated, compressed; and an L1 checkpoint without declarations), then one
recovery job per rank count running every case in turn (tests/mpi_scripts/reshard_job.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mpi_util import need_mpi, run

pytestmark = need_mpi()

DECLARED = ("l1", "l4")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("reshard")
    run(4, "reshard_job.py", "write", str(base), timeout=180)
    return base


def _results(base: Path, size: int) -> list[dict]:
    return [json.loads((base / f"result-{size}-{r}.json").read_text()) for r in range(size)]


def _recover_on(written: Path, tmp_path: Path, size: int) -> tuple[Path, list[dict]]:
    base = tmp_path / "runs"
    shutil.copytree(written, base)
    # A node of the old layout lost: its L1 file cannot be read, so no rank may get partial data.
    shutil.copytree(base / "l1", base / "l1_lost")
    for path in (base / "l1_lost" / "Local" / "node1").rglob("Ckpt*-Rank*.fti"):
        path.unlink()
    run(size, "reshard_job.py", "recover", str(base), *DECLARED, "undeclared", "l1_lost", timeout=300)
    return base, _results(base, size)


def _check(results: list[dict], size: int) -> None:
    for name in DECLARED:
        for rank, res in enumerate(results):
            got = res[name]
            assert got.get("ok"), f"{name}, rank {rank} of {size}: {got}"
            assert all(got["equal"].values()), f"{name}, rank {rank} of {size}: blocks differ {got['equal']}"
            assert got["from"] == [1, 4 if name == "l4" else 1]
    # Undeclared variables on another number of ranks: the same clear error everywhere, arrays untouched.
    errors = [res["undeclared"] for res in results]
    assert {e.get("error") for e in errors} == {"RecoveryError"}, errors
    assert len({e["message"] for e in errors}) == 1
    message = errors[0]["message"]
    assert f"written by 4 ranks, this run recovers on {size}" in message
    assert "global_shape" in message and "replicated=True" in message and "export" in message
    assert all(e["untouched"] for e in errors)
    # An old file lost (L1): no checkpoint can be redistributed, every rank says so, nothing written.
    lost = [res["l1_lost"] for res in results]
    assert {e.get("error") for e in lost} == {"NoCheckpointError"}, lost
    assert len({e["message"] for e in lost}) == 1 and "missing" in lost[0]["message"]
    assert all(e["untouched"] for e in lost)


@pytest.mark.parametrize("size", [2, 3, 8])
def test_4_ranks_recovered_on(written: Path, tmp_path: Path, size: int) -> None:
    _base, results = _recover_on(written, tmp_path, size)
    _check(results, size)
