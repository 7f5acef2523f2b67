"""A split that cuts old containers (2 ranks onto 3, real mpiexec): each container that two new ranks need is hashed
by one of them (its verifier), the other reads only its part; damage in the part only the other one reads is still
found, on every rank alike, before any array is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()

N1, N2 = 3 << 14, 3 << 18  # as the job's: float64 elements of variables 1 and 2


def results(tmp_path: Path, proc) -> list[dict]:
    out = [json.loads(p.read_text()) if (p := tmp_path / f"result-{r}.json").exists() else None for r in range(3)]
    assert None not in out, (proc.returncode, proc.stderr[-3000:])
    return out


@pytest.fixture
def written(tmp_path: Path) -> Path:
    run(2, "reshard_share_job.py", "write", str(tmp_path), timeout=120)
    return tmp_path


def test_each_container_is_hashed_once_over_the_ranks(written: Path) -> None:
    proc = run(3, "reshard_share_job.py", "recover", str(written), timeout=120, check=False)
    got = results(written, proc)
    assert all(r["exact"] for r in got), got
    # Each old file holds one container per variable; every byte of them was hashed once, by one rank. (Before, each
    # of the two ranks that needed part of a container hashed it whole: 2 N bytes more.)
    assert sum(r["hashed"] for r in got) == (N1 + N2) * 8, got
    # Rank 1 needs the end of old file 0 and the start of old file 1, less of each than ranks 0 and 2: it hashes none.
    assert got[1]["hashed"] == 0, got


def test_damage_only_the_trusting_rank_reads_fails_on_every_rank(written: Path) -> None:
    proc = run(3, "reshard_share_job.py", "damaged", str(written), timeout=120, check=False)
    got = results(written, proc)
    first = {r["first"] for r in got}
    assert len(first) == 1, got
    (first,) = first
    assert first.startswith("NoCheckpointError") and "Ckpt1-Rank0" in first and "hash" in first, first
    assert all(r["untouched"] and r["exact"] for r in got), got


def test_a_rank_that_sees_another_version_of_a_file_hashes_its_part_itself(written: Path) -> None:
    # Rank 1 sees the old files on another device number (a test seam: as a node that numbers a shared file system
    # otherwise): at the agreement its files' identities differ from its verifiers', so it hashes the containers it
    # read in part itself, in a second agreement, and the recovery goes on.
    proc = run(3, "reshard_share_job.py", "othernode", str(written), timeout=120, check=False)
    got = results(written, proc)
    assert all(r["exact"] for r in got), got
    assert got[1]["hashed"] == (N1 + N2) * 8 and got[0]["hashed"] + got[2]["hashed"] == (N1 + N2) * 8, got
