"""A differential L2 checkpoint retired by a newer commit, the retirement cut short on one rank (SIGKILL after its
partner copy moved to the spares, before its own file did; rank 0 had moved both). argv: BASE PHASE ('write' or
'restart'). 'write': dCP L2 checkpoints 1, 2, then dCP L4 checkpoint 3 (whose commit retires 2; rank 1 dies in it).
'restart': recover and write ``RECOVERED ckpt_id level first_value all_same`` or ``FAILED error`` to
BASE/result-{rank} (the ranks' prints would interleave)."""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.engine import dcpstore

base, phase = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
rank = comm.rank
if phase == "write" and rank == 1:  # the test seam: this rank dies inside the retirement of checkpoint 2
    real_clear, real_retire, retiring = dcpstore.clear_spare_place, dcpstore.DcpStore.retire, [None]

    def retire(self, level, seq, path, ckpt_id=None):
        retiring[0] = ckpt_id
        return real_retire(self, level, seq, path, ckpt_id)

    def clear_spare_place(spare):  # called by retire() between the partner copy's move and the own file's
        if retiring[0] == 2:
            time.sleep(1.5)  # rank 0 has moved both of its files by now
            os.kill(os.getpid(), signal.SIGKILL)
        return real_clear(spare)

    dcpstore.DcpStore.retire = retire
    dcpstore.clear_spare_place = clear_spare_place
ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", local_test=1,
                   node_size=1, group_size=2, enable_dcp=1, dcp_block_size=4096, verbosity=4)
a = np.zeros(20_000)
ctx.protect(1, a)
if phase == "write":
    for ckpt, level in ((1, 6), (2, 6), (3, 8)):
        a[:] = ckpt * 10 + rank
        ctx.checkpoint(ckpt, level)
else:
    try:
        ctx.recover()
        said = " ".join(map(str, ("RECOVERED", *ctx.recovered_from, a[0], bool((a == a[0]).all()))))
    except ftidask.FTIError as exc:
        said = f"FAILED {type(exc).__name__}: {exc}"
    with open(f"{base}/result-{rank}", "w") as out:
        out.write(said)
    ctx.finalize()
