"""Rank script: asynchronous checkpoints in a loop; the last rank is killed (SIGKILL) while one is in flight.

usage: async_kill_job.py run DIR LEVEL K      (rank size-1 kills itself right after asking for checkpoint K)
       async_kill_job.py recover DIR LEVEL    (each rank writes DIR/result-<rank>.json: the value recovered)
Each checkpoint i holds arrays filled with i; right after each call they are overwritten.
"""

import json
import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import ftidask

mode, base, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
dirs = {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}
ctx = ftidask.init(comm=MPI.COMM_WORLD, exec_id="asynckill", local_test=1, node_size=1, group_size=4,
                   async_ckpt=1, **dirs)
rank = ctx.comm.rank
a = np.zeros(600_000 + rank * 1000)
b = np.zeros(5000, np.int32)
ctx.protect(1, a)
ctx.protect(2, b)
if mode == "run":
    kill_at = int(sys.argv[4])
    for i in range(1, kill_at + 1):
        a[:] = i
        b[:] = i
        ctx.checkpoint(i, level)
        a[:] = -1.0
        b[:] = -1
        if i == kill_at and rank == ctx.comm.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a node dies with a checkpoint in flight
    ctx.wait()
    ctx.comm.Barrier()  # never reached by every rank: the job is torn down
else:
    try:
        ctx.recover()
        values = {float(a.min()), float(a.max()), float(b.min()), float(b.max())}
        result = {"status": "ok", "values": sorted(values)}
    except ftidask.FTIError as exc:
        result = {"status": "fail", "error": str(exc)}
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(result, fh)
    ctx.finalize()
