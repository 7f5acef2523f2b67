"""``heads_reinit_job.py DIR`` on 4 processes (2 nodes of a head and an application rank): init, checkpoint, finalize,
then init again on the same communicator (as a finalized context's error suggests). The heads' processes ended at the
finalize: the second init waited for them for ever. Each application rank prints ``REINIT <rank> <error>``."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import ftidask

base = sys.argv[1]
cfg = {"local_test": 1, "node_size": 2, "group_size": 2, "head": 1, "inline_l4": 0, "ckpt_dir": f"{base}/Local",
       "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta", "keep_last_ckpt": 1}
ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg)
rank = ctx.comm.rank
a = np.arange(100.0) + rank
ctx.protect(1, a)
ctx.checkpoint(1, 4)
ctx.finalize()
try:
    ftidask.init(comm=MPI.COMM_WORLD, **cfg)
except ftidask.FTIError as exc:
    sys.stdout.write(f"REINIT {rank} {type(exc).__name__}: {exc}\n")  # one write: print's two interleaved with
    sys.stdout.flush()  # another rank's line (a line of two ranks, one rank unseen: the test failed at random)
else:
    sys.stdout.write(f"REINIT {rank} none\n")
    sys.stdout.flush()
