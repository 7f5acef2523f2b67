"""mpiexec -n P python dcp_fallback_job.py write|recover|continue BASE: a global array of 4096 float64 in blocks, one
block per rank, checkpointed at L4_DCP three times (write, on 4 ranks); recover writes result-{rank}.json; continue
recovers, then writes checkpoint 4 at L4_DCP."""

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
    mode, base = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    n = G // comm.size
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                       enable_dcp=1, dcp_block_size=4096, local_test=1, node_size=1, group_size=comm.size,
                       verbosity=3)
    mine = slice(comm.rank * n, (comm.rank + 1) * n)
    a = np.zeros(n)
    ctx.protect(1, a, global_shape=(G,), offset=(comm.rank * n,))
    if mode == "write":
        for c in (1, 2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, 8)
        out = {}
    else:
        try:
            ctx.recover()
            out = {"from": list(ctx.recovered_from), "exact": bool(np.array_equal(a, want(ctx.recovered_from[0])[mine]))}
            if mode == "continue":
                a[:] = want(4)[mine]
                ctx.checkpoint(4, 8)
        except ftidask.FTIError as exc:
            out = {"error": type(exc).__name__, "message": str(exc)[:500]}
        with open(f"{base}/result-{comm.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx.transport.close()  # the run stays as it is (no finalize): the test restarts it


if __name__ == "__main__":
    main()
