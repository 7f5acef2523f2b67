"""Rank script: an array and an ftidask.State per rank, checkpointed, or recovered on another node layout.

usage: state_layout_job.py write|recover DIR CKPT_DIR GLBL_DIR META_DIR NODE_SIZE
``write``: array arange(4) + rank, State(step=5 + rank), checkpoint 1 at L1. ``recover``: the array at -7 and
State(step=9) protected, recover(); each rank saves ``DIR/r<rank>.json``: where it recovered from (or its error),
the array and the state.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask


def main() -> None:
    mode, out, ckpt_dir, glbl_dir, meta_dir, node_size = sys.argv[1:7]
    r = MPI.COMM_WORLD.rank
    a = np.arange(4.0) + r if mode == "write" else np.full(4, -7.0)
    state = ftidask.State(step=5 + r if mode == "write" else 9)
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=ckpt_dir, glbl_dir=glbl_dir, meta_dir=meta_dir, verbosity=3,
                       local_test=1, node_size=int(node_size))
    ctx.protect(1, a)
    ctx.protect(2, state)
    result = {}
    if mode == "write":
        ctx.checkpoint(1, 1)
    else:
        try:
            ctx.recover()
            result["from"] = list(ctx.recovered_from)
        except ftidask.FTIError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(a=a.tolist(), state=dict(state))
    with open(f"{out}/r{r}.json", "w") as fh:
        json.dump(result, fh)
    ctx._close()  # as a job that ends: the checkpoint stays


if __name__ == "__main__":
    main()
