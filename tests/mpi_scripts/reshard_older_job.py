"""mpiexec -n P python reshard_older_job.py l4|dcp|recover BASE LEVEL: a global array of 4096 float64 in blocks, one
block per rank. l4: checkpoint 1 at L4; dcp: recover, then checkpoints 2 and 3 at LEVEL; recover: writes
result-{rank}.json (the checkpoint recovered, and whether the block is exactly its values, or the error)."""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask

G = 4096


def want(c: int) -> np.ndarray:
    return np.arange(G, dtype=np.float64) + 1000 * c


def main() -> None:
    mode, base, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
    comm = MPI.COMM_WORLD
    n = G // comm.size
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                       enable_dcp=1, dcp_block_size=4096, local_test=1, node_size=1, group_size=comm.size,
                       verbosity=3)
    mine = slice(comm.rank * n, (comm.rank + 1) * n)
    a = np.zeros(n)
    ctx.protect(1, a, global_shape=(G,), offset=(comm.rank * n,))
    if mode == "l4":
        a[:] = want(1)[mine]
        ctx.checkpoint(1, 4)
    elif mode == "dcp":
        ctx.recover()
        for c in (2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, level)
    else:
        try:
            ctx.recover()
            out = {"from": list(ctx.recovered_from), "exact": bool(np.array_equal(a, want(ctx.recovered_from[0])[mine]))}
        except ftidask.FTIError as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        with open(f"{base}/result-{comm.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
