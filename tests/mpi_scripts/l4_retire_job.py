"""Rank script: two L4 checkpoints, the first retired by the second; which rank deleted what.

usage: l4_retire_job.py DIR [async]
Each rank writes ``DIR/deleted-<rank>.json``: the paths its remover deleted, each with what a directory held then.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.storage import files, removal

deleted: list[list] = []
real_remove_tree = files.remove_tree


def logged_remove_tree(path):  # the seam: every deletion of this rank's remover, with a directory's content
    deleted.append([str(path), sorted(os.listdir(path)) if os.path.isdir(path) else None])
    real_remove_tree(path)


files.remove_tree = removal.remove_tree = logged_remove_tree


def main() -> None:
    base, comm = sys.argv[1], MPI.COMM_WORLD
    wait = len(sys.argv) < 3
    with ftidask.init(comm=comm, local_test=1, node_size=1, group_size=4, ckpt_dir=f"{base}/Local",
                      glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta") as ctx:
        data = np.arange(50000, dtype=np.float64) + comm.rank
        ctx.protect(1, data)
        for ckpt in (1, 2):
            done = ctx.checkpoint(ckpt, 4, wait=wait)
            if not wait:
                done.result()
        ctx.wait()
    with open(f"{base}/deleted-{comm.rank}.json", "w") as fh:
        json.dump(deleted, fh)


if __name__ == "__main__":
    main()
