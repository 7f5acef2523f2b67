"""A subset of the loss scenarios over real mpiexec jobs (4 ranks = 4 simulated nodes, one group).

One job writes every case, the test damages them, one job recovers them all: two mpiexec starts in
all. The whole matrix runs in process (test_conformance_threads.py), over the same engine and level
code; here the bytes move as MPI messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import scenarios as sc
from mpi_util import need_mpi, run

pytestmark = need_mpi()

#: One scenario per level (L3 twice: a rebuild and a loss beyond it; L8 twice: without its fallback).
CASES = ["L1-corrupt-rank0-older", "L2-erase-rank0+erase-partner0-older", "L2-erase-node02-latest",
         "L3-erase-node01-latest", "L3-erase-node123-none", "L4-erase-rank0-none", "L5-corrupt-rank0-previous",
         "L6-erase-node1-latest", "L7-erase-node01-latest", "L8-erase-node0123-latest", "L8-erase-rank0+erase-spare0-none"]


def test_scenarios_over_mpi(tmp_path: Path) -> None:
    cases = [f"{tmp_path / name}={name}" for name in CASES]
    run(sc.NRANKS, "conformance_job.py", "write", *cases, timeout=240)
    for name in CASES:
        sc.damage(tmp_path / name, sc.BY_NAME[name])
    run(sc.NRANKS, "conformance_job.py", "recover", *cases, timeout=240)
    for name in CASES:
        results = [json.loads((tmp_path / name / f"result-{r}.json").read_text()) for r in range(sc.NRANKS)]
        sc.check(sc.BY_NAME[name], results)
