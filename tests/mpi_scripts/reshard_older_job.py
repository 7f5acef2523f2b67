"""mpiexec -n P python reshard_older_job.py l4|dcp|recover BASE LEVEL: a global array of 4096 float64 in blocks, one
block per rank. l4: checkpoint 1 at L4; dcp: recover, then checkpoints 2 and 3 at LEVEL; recover: writes
result-{rank}.json (the checkpoint recovered, and whether the block is exactly its values, or the error)."""

from __future__ import annotations

import json
import sys

import numpy as np
from blockjob import init_block, recover_report
from mpi4py import MPI

G = 4096


def want(c: int) -> np.ndarray:
    return np.arange(G, dtype=np.float64) + 1000 * c


def main() -> None:
    mode, base, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx, a, mine = init_block(base, G)
    if mode == "l4":
        a[:] = want(1)[mine]
        ctx.checkpoint(1, 4)
    elif mode == "dcp":
        ctx.recover()
        for c in (2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, level)
    else:
        out = recover_report(ctx, a, mine, want)
        with open(f"{base}/result-{MPI.COMM_WORLD.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
