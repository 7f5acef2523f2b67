"""Rank script: an L2 and an L3 checkpoint written on 4 ranks in groups of 2, one old file lost, recovered on 3
ranks configured with groups of 3 (tests/test_mpi_reshard_groups.py).

usage: reshard_groups_job.py write BASE LEVEL    (4 ranks, group_size = 2) BASE/l<LEVEL>
       reshard_groups_job.py recover BASE LEVEL  (3 ranks, group_size = 3) each rank writes BASE/result-<rank>.json
"""

import json
import sys

import numpy as np

import ftidask

N = 37


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode, base, level = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lo, hi = N * comm.rank // comm.size, N * (comm.rank + 1) // comm.size
    glob = np.arange(N, dtype=np.int64) * 7 - 3
    out = {}
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/l{level}/L", glbl_dir=f"{base}/l{level}/G",
                       meta_dir=f"{base}/l{level}/M", local_test=1, verbosity=4,
                       group_size=2 if mode == "write" else 3)
    a = glob[lo:hi].copy() if mode == "write" else np.zeros(hi - lo, np.int64)
    ctx.protect(1, a, global_shape=(N,), offset=(lo,))
    if mode == "write":
        ctx.checkpoint(1, level)
    else:
        try:
            ctx.recover()
            out[level] = {"ok": True, "equal": a.tobytes() == glob[lo:hi].tobytes()}
        except ftidask.FTIError as exc:
            out[level] = {"error": type(exc).__name__, "message": str(exc)}
    ctx._close()  # as if the job died: the checkpoint stays
    if mode == "recover":
        with open(f"{base}/result-{comm.rank}.json", "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()
