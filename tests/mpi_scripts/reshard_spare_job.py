"""mpiexec -n P python reshard_spare_job.py write|continue|recover BASE NODE_SIZE LEVEL: a global array of 8192 float64, zeros but for
a marker per checkpoint, one block per rank, at LEVEL (5 or 8). write: checkpoints 1-3; continue: recover (the test expects
NoCheckpointError), then checkpoint 4; recover: writes result-{rank}.json (what was recovered, or the error)."""

from __future__ import annotations

import json
import sys

import numpy as np
from blockjob import init_block, recover_report
from mpi4py import MPI

G = 8192


def want(c: int) -> np.ndarray:
    a = np.zeros(G)
    a[c * 7] = c  # the rest stays zero: blocks of every rank's file are alike
    return a


def main() -> None:
    mode, base, node_size, level = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ctx, a, mine = init_block(base, G, node_size=node_size, group_size=1)
    out: dict = {}
    if mode == "write":
        for c in (1, 2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, level)
    else:
        out = recover_report(ctx, a, mine, want, message=False)
        if mode == "continue":
            a[:] = want(4)[mine]
            ctx.checkpoint(4, level)
        with open(f"{base}/{mode}-{MPI.COMM_WORLD.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
