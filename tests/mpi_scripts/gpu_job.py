"""CuPy arrays over MPI (tests/test_gpu.py): ``write`` a checkpoint of every rank's device array at a level (the
ranks share the GPU), or ``recover`` it into fresh device arrays and say whether each rank got its bytes back."""

import sys

import cupy
import numpy as np
from mpi4py import MPI

import ftidask

root, phase, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm = MPI.COMM_WORLD
r = comm.rank
cfg = dict(ckpt_dir=f"{root}/l", glbl_dir=f"{root}/g", meta_dir=f"{root}/m", local_test=1, node_size=1,
           group_size=comm.size, verbosity=3, exec_id="gpu")
ctx = ftidask.init(comm=comm, **cfg)
shape = (3000 + 100 * r, 5)
if phase == "write":
    a = cupy.random.default_rng(r).random(shape, dtype=cupy.float32)
    ctx.protect(1, a)
    ctx.checkpoint(1, level)
    np.save(f"{root}/expected-{r}.npy", a.get())
    ctx._closed = True  # killed: no finalize
else:
    a = cupy.zeros(shape, dtype=cupy.float32)
    ctx.protect(1, a)
    ctx.recover()
    ok = a.get().tobytes() == np.load(f"{root}/expected-{r}.npy").tobytes()
    exact = comm.gather(ok)
    if r == 0:
        print(f"exact {exact}", flush=True)
    ctx.finalize()
