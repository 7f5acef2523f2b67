"""Rank script of the conformance suite over MPI: run scenarios' write or recover phase, in one job.

usage: conformance_job.py write|recover DIR=SCENARIO [DIR=SCENARIO ...]
Each case has a directory of its own; recover writes ``DIR/result-RANK.json`` (see scenarios.recover_rank).
"""

import json
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
import scenarios as sc  # noqa: E402

import ftidask  # noqa: E402


def main() -> None:
    phase = sys.argv[1]
    for case in sys.argv[2:]:
        base, _, name = case.partition("=")
        scenario = sc.BY_NAME[name]
        ctx = ftidask.init(comm=MPI.COMM_WORLD, **sc.config(Path(base), scenario))
        rank = ctx.transport.rank
        if phase == "write":
            sc.write_rank(ctx, rank, scenario)
        else:
            Path(base, f"result-{rank}.json").write_text(json.dumps(sc.recover_rank(ctx, rank)))
        ctx.transport.close()  # no finalize: the files stay for the test to damage or inspect


if __name__ == "__main__":
    main()
