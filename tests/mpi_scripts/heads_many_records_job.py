"""Rank script: a run with a head (1 head + 1 application rank) that keeps every L4 checkpoint, raised by the head.

usage: heads_many_records_job.py DIR N
The head writes ``DIR/head-stats.json`` at its exit: how many commit record files it parsed and how many times it
listed them (:data:`ftidask.engine.records.stats`). The application rank prints each raise's reply.
"""

import atexit
import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.engine import records


def main() -> None:
    base, n, comm = sys.argv[1], int(sys.argv[2]), MPI.COMM_WORLD
    if comm.rank == 0:  # the first process of the node: the head (init never returns there)
        atexit.register(lambda: open(f"{base}/head-stats.json", "w").write(json.dumps(records.stats)))
    ctx = ftidask.init(comm=comm, local_test=1, node_size=2, group_size=1, head=1, inline_l4=0, keep_l4_ckpt=1,
                       ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta", verbosity=3)
    a = np.zeros(64)
    ctx.protect(1, a)
    for i in range(1, n + 1):
        a[:] = i
        ctx.checkpoint(i, 4)
        print("REPLY", json.dumps(ctx.wait_post_processing()), flush=True)
    ctx.finalize()


if __name__ == "__main__":
    main()
