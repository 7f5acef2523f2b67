"""A restart on another number of ranks rebuilds the lost old files on the groups they were written with.

4 ranks (4 simulated nodes) write L2 and L3 checkpoints in groups of 2; old rank 2's file is lost; the restart runs
on 3 ranks, where groups of 2 do not fit, with ``group_size = 3``. The old groups ({0, 1} and {2, 3}) were once
derived from the restart's ``group_size`` ({0, 1, 2} and {3}): the partner copy and the parity were looked for in
the wrong group, and a checkpoint that its level can rebuild was refused with NoCheckpointError. The commit record
now says which ``group_size`` wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()


@pytest.mark.parametrize("level", [2, 3])
def test_old_groups_from_the_record(tmp_path: Path, level: int) -> None:
    run(4, "reshard_groups_job.py", "write", str(tmp_path), str(level), timeout=180)
    lost = list(find_paths(tmp_path / f"l{level}", "Ckpt1-Rank2.fti"))
    assert len(lost) == 1
    lost[0].unlink()
    run(3, "reshard_groups_job.py", "recover", str(tmp_path), str(level), timeout=180)
    for rank in range(3):
        res = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert res[str(level)].get("ok") and res[str(level)]["equal"], (rank, res)
    assert len(list(find_paths(tmp_path / f"l{level}", "Ckpt1-Rank2.fti"))) == 1  # rebuilt in its old node's directory
