"""A differential checkpoint whose retirement a kill cut short on one rank, then the newer checkpoint damaged: every
byte of the retired one is on disk (rank 0's file as its level's spare, rank 1's still in the checkpoint's directory),
but neither its commit record nor its level's fallback record found every rank's file, and the restart recovered
nothing (or an older checkpoint). Found by an MPI crash campaign (random kills at 4 levels, 410 kills)."""

from __future__ import annotations

import json

import pytest
from mpi_util import need_mpi
from mpi_util import run as mpi_run

pytestmark = need_mpi()


def test_a_retirement_cut_short_on_one_rank_leaves_the_retired_checkpoint_recoverable(tmp_path):
    base = tmp_path / "run"
    written = mpi_run(2, "dcp_retire_cut_job.py", str(base), "write", check=False, timeout=120)
    assert written.returncode != 0  # rank 1 was killed in the retirement
    run = json.loads((base / "M" / "current_exec_id").read_text())["exec_id"]
    assert (base / f"L/node0/{run}/l2/dcp/Spare-Rank0.fti").is_file()  # rank 0 had moved its file
    assert (base / f"L/node1/{run}/l2/ckpt2.s2/Ckpt2-Rank1.fti").is_file()  # rank 1 had not
    newest = base / f"G/{run}/l4/ckpt3.s3/Ckpt3-Rank0.fti"
    if not newest.is_file():  # (the L4 write left no file: nothing newer to damage)
        pytest.skip("checkpoint 3 left no file of rank 0")
    with open(newest, "r+b") as fh:  # the newest checkpoint damaged: the retired one must come back
        fh.truncate(1000)
    mpi_run(2, "dcp_retire_cut_job.py", str(base), "restart", timeout=120)
    said = [(base / f"result-{rank}").read_text() for rank in (0, 1)]
    assert said == ["RECOVERED 2 2 20.0 True", "RECOVERED 2 2 21.0 True"], said
