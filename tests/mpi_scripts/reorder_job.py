"""Rank script: nodes on hosts (local_test = 0), each host a disk of its own, restarted on the hosts in another order.

usage: reorder_job.py write DIR HOSTS LEVEL [heads|pairs]   (HOSTS: one name per MPI.COMM_WORLD rank, comma-separated)
       reorder_job.py recover DIR HOSTS [heads|pairs]
Each process plays the host HOSTS[its world rank] (``ftidask.backends.mpi.reorder.processor_name``, the test seam)
and keeps its node-local files on that host's own disk, ``DIR/disk-HOST`` (``ckpt_dir``: the same path on every node
of a cluster, another disk on each), so a process finds only the files its host holds. write: app rank r checkpoints
its values at LEVEL and stops without finalize, as after a crash. recover: into a fresh array; result-<world rank>.json
holds {"host", "app_rank", "status", "error", "exact"}. ``heads``: two processes a host, the first its head (head = 1,
L2-L4 post-processed by the heads); no result file for a head. ``pairs``: two application processes a host.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.backends.mpi import reorder

N = 50_000


def main() -> None:
    mode, base, hosts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    host = hosts[MPI.COMM_WORLD.rank]
    reorder.processor_name = lambda: host
    heads, per_host = sys.argv[-1] == "heads", 2 if sys.argv[-1] in ("heads", "pairs") else 1
    nodes = MPI.COMM_WORLD.size // per_host
    ctx = ftidask.init(comm=MPI.COMM_WORLD, local_test=0, node_size=per_host, head=int(heads),
                       group_size=nodes, verbosity=3, ckpt_dir=f"{base}/disk-{host}", glbl_dir=f"{base}/Global",
                       meta_dir=f"{base}/Meta")
    rank = ctx.comm.rank
    out = {"host": host, "app_rank": rank}
    if mode == "write":
        ctx.protect(1, np.random.default_rng(rank).random(N))
        ctx.checkpoint(1, int(sys.argv[4]))
        if heads:
            ctx.wait()  # the heads' post-processing of the checkpoint done; then stop without finalize
            ctx._close()
        return  # no finalize: the checkpoint stays, as after a crash
    a = np.empty(N)
    ctx.protect(1, a)
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        out.update(status="fail", error=f"{type(exc).__name__}: {exc}")
    else:
        out.update(status="ok", exact=bool(np.array_equal(a, np.random.default_rng(rank).random(N))))
    with open(f"{base}/result-{MPI.COMM_WORLD.rank}.json", "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
