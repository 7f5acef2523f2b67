"""Differential checkpoints over MPI (tests/test_dcp_mpi.py): write 5 at a level, or recover the last one."""

import logging
import sys

import numpy as np
from mpi4py import MPI

import ftidask

root, phase, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm = MPI.COMM_WORLD
r = comm.rank
# One output file per rank: the ranks' stdout would interleave.
out = open(f"{root}/{phase}-rank{r}.txt", "w", buffering=1)  # noqa: SIM115 - for the whole job
handler = logging.StreamHandler(out)
handler.addFilter(lambda rec: rec.getMessage().startswith(("L2:", "L3:")) or rec.levelno >= 30)
logging.getLogger("ftidask").addHandler(handler)
cfg = dict(ckpt_dir=f"{root}/l", glbl_dir=f"{root}/g", meta_dir=f"{root}/m", local_test=1, node_size=1, group_size=4,
           enable_dcp=1, dcp_block_size=4096, verbosity=1, exec_id="trial")


def state(k):
    a = np.arange(200_000, dtype=np.float64) * (r + 1)
    for j in range(1, k + 1):
        a[(j * 7919 * (r + 1)) % a.size] = -j
    return a


if phase in ("write", "write-async"):
    ctx = ftidask.init(comm=comm, **cfg)
    a = state(0)
    ctx.protect(1, a)
    for k in range(1, 6):
        a[(k * 7919 * (r + 1)) % a.size] = -k  # in place: now a == state(k)
        if phase == "write":
            info = ctx.checkpoint(k, level)
        else:  # the whole array is overwritten while the checkpoint is in flight, then put back
            handle = ctx.checkpoint(k, level, wait=False)
            kept = a.copy()
            a[:] = -99.0
            info = handle.result()
            a[:] = kept
        print("rank", r, "ckpt", k, "blocks", info.blocks_changed, info.blocks_total, "hashed", info.blocks_hashed,
              file=out)
    ctx._closed = True
else:
    ctx = ftidask.init(comm=comm, **cfg)
    a = np.zeros(200_000)
    ctx.protect(1, a)
    ctx.recover()
    ok = a.tobytes() == state(5).tobytes()
    print("rank", r, "recovered", ctx.recovered_from, "exact", ok, file=out)
