"""mpiexec -n 8 python heads_dcp_job.py BASE UPTO [LEVEL [VERBOSITY [KILL]]]: 4 nodes of one head and one
application rank, L2_DCP, L3_DCP or L4_DCP (LEVEL 6, 7 or 8, the default) raised by the heads (inline_l2 =
inline_l3 = inline_l4 = 0). A restart recovers first; checkpoints up to UPTO, each changing one element; writes
result-{rank}.json (the recovered checkpoint and whether it is exact, blocks changed and total per checkpoint).
KILL: ``W:module:function@N``, a crash point (tests/crashpoints.py) in world rank W: SIGKILLed at its N-th call."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: crashpoints
import crashpoints  # noqa: E402

import ftidask  # noqa: E402


def data(rank: int, c: int) -> np.ndarray:
    out = np.arange(4096 * (rank + 1), dtype=np.int64) + rank
    out[0] = c
    return out


def main() -> None:
    base, upto = sys.argv[1], int(sys.argv[2])
    level = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    verbosity = int(sys.argv[4]) if len(sys.argv) > 4 else 3  # 2: the heads' info lines too
    if len(sys.argv) > 5:
        who, point = sys.argv[5].split(":", 1)
        point, _, nth = point.partition("@")
        if int(who) == MPI.COMM_WORLD.rank:
            crashpoints.install(point, int(nth or 1))
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global",
                       meta_dir=f"{base}/Meta", local_test=1, node_size=2, head=1, group_size=4,
                       inline_l2=0, inline_l3=0, inline_l4=0, enable_dcp=1, dcp_block_size=4096, verbosity=verbosity)
    if ctx.comm is None:  # a head: it served the ranks until they finalized or closed
        return
    rank = ctx.comm.rank
    a = np.zeros_like(data(rank, 0))
    ctx.protect(1, a)
    out: dict = {}
    start = 0
    if ctx.status():
        ctx.recover()
        start = ctx.recovered_from[0]
        out["recovered"] = [*ctx.recovered_from, bool(np.array_equal(a, data(rank, start)))]
    out["infos"] = []
    for c in range(start + 1, upto + 1):
        a[:] = data(rank, c)
        info = ctx.checkpoint(c, level)
        ctx.wait_post_processing()
        out["infos"].append([info.blocks_changed, info.blocks_total])
    out["states"] = len(ctx._dcp._files)  # block states kept in memory: the newest two, not one per checkpoint
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(out, fh)
    ctx.comm.Barrier()
    ctx.transport.close()  # FTI_ENDW to the heads; no finalize: the next job restarts the run
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
