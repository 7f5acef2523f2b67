"""mpiexec -n P python reshard_older_job.py l4|dcp|recover|sizes BASE LEVEL: a global array of 4096 float64 in blocks,
one block per rank. l4: checkpoint 1 at L4; dcp: recover, then checkpoints 2 and 3 at LEVEL; recover: writes
result-{rank}.json (the checkpoint recovered, and whether the block is exactly its values, or the error); sizes: the
same after asking stored_size(1) and realloc(1) first (FTI's order), their answers or errors in the result."""

from __future__ import annotations

import json
import sys

import numpy as np
from blockjob import init_block, recover_report
from mpi4py import MPI

import ftidask

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
        asked = {}
        if mode == "sizes":
            calls = (("stored_size", lambda: ctx.stored_size(1)), ("realloc", lambda: ctx.realloc(1, a).nbytes))
            for name, call in calls:
                try:
                    asked[name] = call()
                except ftidask.FTIError as exc:
                    asked[name] = {"error": type(exc).__name__, "message": str(exc)[:300]}
        out = {**recover_report(ctx, a, mine, want), **asked}
        with open(f"{base}/result-{MPI.COMM_WORLD.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
