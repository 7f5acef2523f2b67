"""mpiexec -n P python dcp_fallback_job.py write|recover|continue BASE: a global array of 4096 float64 in blocks, one
block per rank, checkpointed at L4_DCP three times (write, on 4 ranks); recover writes result-{rank}.json; continue
recovers, then writes checkpoint 4 at L4_DCP."""

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
    mode, base = sys.argv[1], sys.argv[2]
    ctx, a, mine = init_block(base, G)
    if mode == "write":
        for c in (1, 2, 3):
            a[:] = want(c)[mine]
            ctx.checkpoint(c, 8)
        out = {}
    else:
        out = recover_report(ctx, a, mine, want)
        if mode == "continue" and "error" not in out:
            a[:] = want(4)[mine]
            ctx.checkpoint(4, 8)
        with open(f"{base}/result-{MPI.COMM_WORLD.rank}.json", "w") as fh:
            json.dump(out, fh)
    ctx.transport.close()  # the run stays as it is (no finalize): the test restarts it


if __name__ == "__main__":
    main()
