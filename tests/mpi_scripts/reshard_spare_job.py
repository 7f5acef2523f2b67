"""mpiexec -n P python reshard_spare_job.py write|continue|recover BASE NODE_SIZE LEVEL: a global array of 8192 float64, zeros but for
a marker per checkpoint, one block per rank, at LEVEL (5 or 8). write: checkpoints 1-3; continue: recover (the test expects
NoCheckpointError), then checkpoint 4; recover: writes result-{rank}.json (what was recovered, or the error)."""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask

G = 8192


def want(c: int) -> np.ndarray:
    a = np.zeros(G)
    a[c * 7] = c  # the rest stays zero: blocks of every rank's file are alike
    return a


def main() -> None:
    mode, base, node_size, level = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    comm = MPI.COMM_WORLD
    n = G // comm.size
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                       enable_dcp=1, dcp_block_size=4096, local_test=1, node_size=node_size, group_size=1,
                       verbosity=3)
    mine = slice(comm.rank * n, (comm.rank + 1) * n)
    a = np.zeros(n)
    ctx.protect(1, a, global_shape=(G,), offset=(comm.rank * n,))
    out: dict = {}
    if mode == "write":
        for c in (1, 2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, level)
    else:
        try:
            ctx.recover()
            out = {"from": list(ctx.recovered_from), "exact": bool(np.array_equal(a, want(ctx.recovered_from[0])[mine]))}
        except ftidask.FTIError as exc:
            out = {"error": type(exc).__name__}
        if mode == "continue":
            a[:] = want(4)[mine]
            ctx.checkpoint(4, level)
        with open(f"{base}/{mode}-{comm.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
