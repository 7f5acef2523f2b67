"""Python state and partial recovery over MPI (tests/test_pystate_mpi.py): ``write`` two checkpoints at a
level (the state grows in between), or ``recover`` them: first only the states (ids=[2, 3]), then all."""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask

root, phase, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm = MPI.COMM_WORLD
r = comm.rank
cfg = dict(ckpt_dir=f"{root}/l", glbl_dir=f"{root}/g", meta_dir=f"{root}/m", local_test=1, node_size=1, group_size=4,
           enable_dcp=int(level > 4), verbosity=4, exec_id="trial")
ctx = ftidask.init(comm=comm, **cfg)
if phase == "write":
    a = np.arange(5000.0) * (r + 1)
    st = ftidask.State({"rank": r, "history": []})
    rng = np.random.default_rng(100 + r)
    ctx.protect(1, a)
    ctx.protect(2, st)
    ctx.protect(3, rng)
    ctx.checkpoint(1, level)
    st["history"] = [float(x) for x in rng.random(50 * (r + 1))]  # grows, differently on each rank
    ctx.checkpoint(2, level)
    with open(f"{root}/expected-{r}.json", "w") as fh:
        json.dump({"state": dict(st), "next": rng.random(5).tolist()}, fh)
    ctx._closed = True  # killed: no finalize
else:
    with open(f"{root}/expected-{r}.json") as fh:
        expected = json.load(fh)
    a, st, rng = np.zeros(5000), ftidask.State(), np.random.default_rng(0)
    ctx.protect(1, a)
    ctx.protect(2, st)
    ctx.protect(3, rng)
    ctx.recover(ids=[2, 3])
    partial = not a.any() and st == expected["state"] and rng.random(5).tolist() == expected["next"]
    ctx.recover()
    full = np.array_equal(a, np.arange(5000.0) * (r + 1)) and rng.random(5).tolist() == expected["next"]
    results = comm.gather((partial, full, ctx.recovered_from), root=0)
    if r == 0:
        print("RESULTS", json.dumps(results))
    ctx.finalize()
