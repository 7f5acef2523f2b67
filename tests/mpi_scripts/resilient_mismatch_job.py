"""mpiexec -n 2 python resilient_mismatch_job.py MODE BASE: the resilient decorator with one argument of rank 1's own
(MODE: every, check_every, iterations, every0 (refused on rank 1 only), level9 (refused on rank 1 only)); each rank
writes ``BASE/result-{rank}.json``: the error class and message it got, or "done"."""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask

rank = MPI.COMM_WORLD.rank
mode, base = sys.argv[1], sys.argv[2]
own = {"every": {"every": 3}, "check_every": {"check_every": 2}, "iterations": {"iterations": 5},
       "every0": {"every": 0}, "level9": {"level": 9}}[mode]
kw = {"every": 2, "iterations": 7, **(own if rank == 1 else {})}
out: dict = {}
try:
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global",
                       meta_dir=f"{base}/Meta", local_test=1, node_size=1, group_size=2, verbosity=4)
    u = np.full(4, float(rank))

    @ftidask.resilient(ctx, arrays={1: u}, exit_on_signal=False, **kw)
    def step(i):
        u[:] += 1

    step()
    out = {"result": "done"}
    ctx.finalize()
except ftidask.FTIError as exc:
    out = {"result": type(exc).__name__, "message": str(exc)}
Path(base, f"result-{rank}.json").write_text(json.dumps(out))
