"""Rank script: recover a checkpoint written by the Dask backend, each rank declaring its block.

usage: dask_ckpt_job.py DIR CKPT_DIR GLBL_DIR META_DIR
Var 1 (5, 6) by rows and var 2 (4, 5, 6) along axis 1, split over the ranks; var 3 replicated; var 4 (0, 3) whole
and replicated. Each rank saves what it recovered as ``DIR/got-<rank>-<vid>.npy`` and its slices as
``DIR/where-<rank>.json``, or its error as ``DIR/error-<rank>.txt``.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    lo = n * rank // size
    return lo, n * (rank + 1) // size


def main() -> None:
    out, ckpt_dir, glbl_dir, meta_dir = sys.argv[1:5]
    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    rows, cols = split(5, n, r), split(5, n, r)
    arrays = {1: np.zeros((rows[1] - rows[0], 6)), 2: np.zeros((4, cols[1] - cols[0], 6), np.int32),
              3: np.zeros((7, 3), np.dtype([("a", "<i4"), ("b", "<f8", (2,))])), 4: np.zeros((0, 3), np.float32)}
    ctx = ftidask.init(comm=comm, ckpt_dir=ckpt_dir, glbl_dir=glbl_dir, meta_dir=meta_dir, verbosity=3, local_test=1,
                       node_size=1)
    ctx.protect(1, arrays[1], global_shape=(5, 6), offset=(rows[0], 0))
    ctx.protect(2, arrays[2], global_shape=(4, 5, 6), offset=(0, cols[0], 0))
    ctx.protect(3, arrays[3], replicated=True)
    ctx.protect(4, arrays[4], replicated=True)
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        with open(f"{out}/error-{r}.txt", "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}")
    else:
        for vid, a in arrays.items():
            np.save(f"{out}/got-{r}-{vid}.npy", a)
        with open(f"{out}/where-{r}.json", "w") as fh:
            json.dump({"rows": rows, "cols": cols, "from": list(ctx.recovered_from)}, fh)
    ctx.finalize()


if __name__ == "__main__":
    main()
