"""FTI's recoverName test over MPI: each rank gives ids to ten names in a random order of its own.

    mpiexec -n N python names_job.py write|recover BASE LEVEL

``write``: var_id for each name (the rank's own order), protect, checkpoint at LEVEL, exit without
finalize (the ids each rank gave go to BASE/ids-{rank}.json). ``recover``: var_id(create=False) in another
order, protect, recover_var each; BASE/result-{rank}.json holds the ids found and whether each array is exact.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
from mpi4py import MPI

import ftidask

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZES = [42, 85, 8, 19, 95, 26, 66, 33, 65, 83]

mode, base, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = MPI.COMM_WORLD.rank
ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                   local_test=1, node_size=1, group_size=4, verbosity=3)
if mode == "write":
    ids = {}
    for i in random.Random(100 + rank).sample(range(10), 10):
        ids[NAMES[i]] = ctx.var_id(NAMES[i])
        ctx.protect(ids[NAMES[i]], np.full(SIZES[i], i, np.int32))
    ctx.checkpoint(1, level)
    ctx.wait_post_processing()
    with open(f"{base}/ids-{rank}.json", "w") as fh:
        json.dump(ids, fh)
    MPI.COMM_WORLD.Barrier()
    os._exit(0)  # the application dies: no finalize
ids, arrays = {}, [np.zeros(s, np.int32) for s in SIZES]
for i in random.Random(200 + rank).sample(range(10), 10):
    ids[NAMES[i]] = ctx.var_id(NAMES[i], create=False)
    ctx.protect(ids[NAMES[i]], arrays[i])
    ctx.recover_var(ids[NAMES[i]])
with open(f"{base}/result-{rank}.json", "w") as fh:
    json.dump({"status": ctx.status(), "ids": ids, "exact": [bool((a == i).all()) for i, a in enumerate(arrays)]}, fh)
ctx.finalize()
