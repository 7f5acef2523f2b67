"""``stored_size`` over real MPI ranks (tests/mpi_scripts/stored_size_job.py): FTI_GetStoredSize is the rank's own
size; ``total=True`` gives the job's, the same on every rank, and a ``total=`` refused on one rank is refused on every
rank (no rank left waiting in the sum)."""

from __future__ import annotations

import json
from pathlib import Path

from mpi_util import need_mpi, run

pytestmark = need_mpi()


def _results(base: Path, phase: str) -> list[dict]:
    return [json.loads((base / f"{phase}-{r}.json").read_text()) for r in range(3)]


def test_stored_size_is_the_ranks_own_and_total_the_jobs(tmp_path: Path) -> None:
    run(3, "stored_size_job.py", str(tmp_path), timeout=120)
    own = [80, 160, 240]
    for rank, r in enumerate(_results(tmp_path, "write")):
        assert r["status"] == 0 and r["before"] == [0, 0], r  # nothing stored yet: FTI's 0
        assert r["after"] == [own[rank], 480] and r["absent"] == [0, 0], r
        assert r["refused"][0] == "RecoveryError" and "rank 1: stored_size(total=...) takes a bool" in r["refused"][1]
    for rank, r in enumerate(_results(tmp_path, "restart")):
        assert r["status"] == 1 and r["restart"] == [own[rank], 480], r  # the checkpoint to recover
        assert r["recovered"] == [own[rank], 480, True], r
