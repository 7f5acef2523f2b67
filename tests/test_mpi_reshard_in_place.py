"""A restart on another number of ranks (4 -> 2, real mpiexec) into an array in use and a fresh one, where old
rank 3's file is cut after every rank verified its pieces and agreed, before they are read into the arrays; rank 0
alone cuts it (the test seam ``reshard.BEFORE_LOAD``, set in its process only), rank 1 alone reads it: both ranks
raise the same error ('failed while loading'), nothing hangs, the fresh array is left untouched (its staged pages
given back), and once the file is back a recovery in the same processes fills both arrays exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = [*need_mpi(), pytest.mark.slow]


def test_a_file_cut_after_the_agreement_fails_alike_on_every_rank(tmp_path: Path) -> None:
    run(4, "reshard_load_job.py", "write", str(tmp_path), timeout=120)
    proc = run(2, "reshard_load_job.py", "recover", str(tmp_path), timeout=120, check=False)
    results = [json.loads(p.read_text()) if (p := tmp_path / f"result-{r}.json").exists() else None
               for r in range(2)]
    assert None not in results, (proc.returncode, proc.stderr[-3000:])
    first = results[0]["first"]
    assert results[1]["first"] == first and "failed while loading" in first and "Ckpt1-Rank3" in first, results
    assert all(r["fresh"] and r["untouched"] and r["exact"] for r in results), results
