"""Python state over real mpiexec jobs: written at L2/L3 (and differential L6), a lost node's file rebuilt,
then the states recovered alone (partial recovery, the arrays untouched) and with the arrays."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()


@pytest.mark.parametrize("level", [2, 3, 6])
def test_states_survive_a_lost_node(tmp_path: Path, level: int) -> None:
    run(4, "pystate_job.py", str(tmp_path), "write", str(level), timeout=180)
    shutil.rmtree(tmp_path / "l" / "node1")  # a node lost with its disk: rebuilt from L2/L3 first
    done = run(4, "pystate_job.py", str(tmp_path), "recover", str(level), timeout=180)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS"))
    results = json.loads(line.split(" ", 1)[1])
    base = level - 4 if level > 4 else level
    assert results == [[True, True, [2, base]]] * 4
