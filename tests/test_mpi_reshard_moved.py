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
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

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


def test_realloc_after_a_redistribution_that_read_around_damage(written: Path, tmp_path: Path) -> None:
    """One process recovers the 2-rank checkpoint; old rank 1's copy of the replicated variable is damaged, and
    never read (a replicated variable is read from one old file). realloc and stored_size then said "none of those
    checkpoints can be redistributed" (NoCheckpointError: they checked every old file whole) right after recover()
    had redistributed it; they refuse as documented, naming the redistribution."""
    import numpy as np
    from mpi_scripts.reshard_moved_job import N, globals_

    import ftidask
    from ftidask.ftiff.reader import parse_ftiff

    base = tmp_path / "run"
    shutil.copytree(written, base)
    path = next(iter(find_paths(base, "Ckpt1-Rank1.fti")))
    with open(path, "rb") as fh:
        meta = next(m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == 3)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr)
        fh.write(bytes(b ^ 0xFF for b in fh.read(8)))
    ctx = ftidask.init(ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", local_test=1, verbosity=4)
    arrays = {vid: np.zeros_like(g) for vid, g in globals_().items()}
    for vid, a in arrays.items():
        ctx.protect(vid, a, **({"replicated": True} if vid == 3 else {"global_shape": (N,), "offset": (0,)}))
    ctx.recover()
    assert all(a.tobytes() == globals_()[vid].tobytes() for vid, a in arrays.items())
    for call in (lambda: ctx.realloc(2), lambda: ctx.stored_size(2)):
        with pytest.raises(ftidask.RecoveryError, match="written by 2 ranks, this run recovers on 1: its stored sizes"):
            call()
    assert arrays[2].tobytes() == globals_()[2].tobytes()
    ctx._close()
