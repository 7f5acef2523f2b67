"""A run restarted again and again on other numbers of ranks (real mpiexec; one stage as one process without MPI),
checkpointing at every level: each restart recovers, bit for bit, what the stage before it checkpointed last
(tests/mpi_scripts/restart_chain_job.py: blocks of a 1-D and a 2-D Fortran-ordered global array declared with
``global_shape``/``offset``, and a replicated array).

A restart on fewer ranks leaves the spares of the ranks that are gone (``dcp/Spare-Rank{r}.fti`` and its hint, on
their nodes and in the global directory: finalize removes them) beside the newer checkpoints; a later restart on more
ranks finds them again. They must never be taken for the newer data: every spare is used only as its FB hash says
(as the base of a differential patch, or as the previous checkpoint a record names).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mpi_util import SCRIPTS, env, need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()


def _stage(base: Path, ranks: int, group: int, prev: int, steps: str) -> list[dict]:
    """One job: ``ranks`` ranks (0: one process, no MPI) recover checkpoint ``prev`` (0: none), then write ``steps``
    (``"ckpt:level,..."``); each rank's result."""
    args = (str(base), str(group), str(prev), steps)
    if ranks:
        run(ranks, "restart_chain_job.py", *args, timeout=180)
    else:
        import subprocess

        subprocess.run([sys.executable, str(SCRIPTS / "restart_chain_job.py"), *args, "serial"], env=env(),
                       check=True, timeout=180, capture_output=True)
    size = max(ranks, 1)
    return [json.loads((base / f"result-{size}-{r}.json").read_text()) for r in range(size)]


def _level(level: int) -> int:
    return level - 4 if level > 4 else level


@pytest.mark.slow
def test_restarts_on_4_2_3_1_4_ranks_at_every_level(tmp_path):
    """4 ranks -> 2 -> 3 -> one process -> 4 -> 4, each stage checkpointing at two levels (every level 1-8 in the
    chain: L1 and L3_DCP, L2 and L2_DCP, L3 and L1_DCP, L4 and L4_DCP, L1_DCP and L2_DCP): each stage recovers the
    last checkpoint of the stage before, exactly."""
    chain = [(4, 2, "1:1,2:7"), (2, 2, "3:2,4:6"), (3, 3, "5:3,6:5"), (0, 1, "7:4,8:8"), (4, 2, "9:5,10:6"),
             (4, 2, "")]
    levels: dict[int, int] = {}  # checkpoint id -> level
    prev = 0
    for ranks, group, steps in chain:
        got = _stage(tmp_path, ranks, group, prev, steps)
        if prev:
            assert got == [{"from": [prev, _level(levels[prev])], "exact": True}] * max(ranks, 1), (ranks, got)
        for step in filter(None, steps.split(",")):
            prev, levels[prev] = map(int, step.split(":"))


@pytest.mark.slow
@pytest.mark.parametrize("level", [5, 6, 7, 8])
def test_4_2_4_ranks_recover_the_newest_beside_the_spares_of_the_ranks_gone(tmp_path, level):
    """Differential checkpoints at ``level`` on 4 ranks (1, 2), 2 ranks (3, 4), 4 ranks again (5, 6): each restart
    recovers the last checkpoint before it exactly, while the spares of old ranks 2 and 3 (written on 4 ranks, left
    by the 2-rank stage) lie beside them; with rank 3's file of checkpoint 6 cut (at L1/L4: no redundancy), checkpoint
    5 comes back exactly; and the newest of the 2-rank stage cut, the restart on 4 ranks recovers checkpoint 3 (the
    previous differential checkpoint, kept as the spares of ranks 0 and 1), never the old spares of ranks 2 and 3."""
    lv = _level(level)
    _stage(tmp_path, 4, 2, 0, f"1:{level},2:{level}")
    assert _stage(tmp_path, 2, 2, 2, f"3:{level},4:{level}") == [{"from": [2, lv], "exact": True}] * 2
    gone = sorted(p.name for p in find_paths(tmp_path, "Spare-Rank[23].*"))
    assert gone, "the spares of old ranks 2 and 3 are still there (finalize removes them)"
    assert _stage(tmp_path, 4, 2, 4, f"5:{level},6:{level}") == [{"from": [4, lv], "exact": True}] * 4
    assert _stage(tmp_path, 4, 2, 6, "") == [{"from": [6, lv], "exact": True}] * 4
    if lv in (1, 4):
        (newest,) = find_paths(tmp_path, "Ckpt6-Rank3.fti")
        os.truncate(newest, newest.stat().st_size - 100)
        assert _stage(tmp_path, 4, 2, 5, "") == [{"from": [5, lv], "exact": True}] * 4
        # Again from the 2-rank stage: its newest checkpoint cut, its previous one comes back from the spares.
        other = tmp_path / "again"
        other.mkdir()
        _stage(other, 4, 2, 0, f"1:{level},2:{level}")
        _stage(other, 2, 2, 2, f"3:{level},4:{level}")
        (newest,) = find_paths(other, "Ckpt4-Rank0.fti")
        os.truncate(newest, newest.stat().st_size - 100)
        assert _stage(other, 4, 2, 3, "") == [{"from": [3, lv], "exact": True}] * 4
