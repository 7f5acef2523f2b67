"""Rank script: recover a Dask checkpoint holding an ftidask.Value under id 2, rank 0 protecting a State (a dict)
there, the other ranks a Value; var 1 (6, 10) by rows.

usage: dask_state_job.py DIR CKPT_DIR GLBL_DIR META_DIR
Each rank saves ``DIR/r<rank>.json``: where it recovered from, or its error, whether its array and object were left
untouched.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask


def main() -> None:
    out, ckpt_dir, glbl_dir, meta_dir = sys.argv[1:5]
    comm = MPI.COMM_WORLD
    r, n = comm.rank, comm.size
    lo, hi = 6 * r // n, 6 * (r + 1) // n
    a = np.full((hi - lo, 10), -7.0)
    obj = ftidask.State(keep=1) if r == 0 else ftidask.Value("keep")
    ctx = ftidask.init(comm=comm, ckpt_dir=ckpt_dir, glbl_dir=glbl_dir, meta_dir=meta_dir, verbosity=3, local_test=1,
                       node_size=1)
    ctx.protect(1, a, global_shape=(6, 10), offset=(lo, 0))
    ctx.protect(2, obj)
    try:
        ctx.recover()
        result = {"from": list(ctx.recovered_from)}
    except ftidask.FTIError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["untouched"] = bool((a == -7).all()) and (dict(obj) == {"keep": 1} if r == 0 else obj.value == "keep")
    with open(f"{out}/r{r}.json", "w") as fh:
        json.dump(result, fh)
    ctx._close()  # as a job that ends: the checkpoints stay


if __name__ == "__main__":
    main()
