"""Rank script: a restart into fresh arrays (verified pages moved under them, ftidask.engine.pagemove).

usage: fresh_restart_job.py write DIR LEVEL     (every rank checkpoints 35 MiB, id 1)
       fresh_restart_job.py recover DIR         (a fresh array per rank, recover; result-<rank>.json)
The result: {"status": ok|fail, "error", "exact", "staged": whether the array was fresh, "moved": bytes moved,
"still_fresh": whether its pages are still never touched (after a failure)}.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.engine import pagemove

N = 4_400_000  # float64s: above glibc's largest mmap threshold, so np.empty gives fresh pages


def config(base: str) -> dict:
    return {"comm": MPI.COMM_WORLD, "local_test": 1, "node_size": 1, "group_size": 4, "verbosity": 3,
            "ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}


def data(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).random(N)


def main() -> None:
    mode, base = sys.argv[1], sys.argv[2]
    ctx = ftidask.init(**config(base))
    rank = ctx.comm.rank
    if mode == "write":
        ctx.protect(1, data(rank))
        ctx.checkpoint(1, int(sys.argv[3]))
        return  # no finalize: the checkpoint stays, as after a crash
    a = np.empty(N)
    out = {"staged": pagemove.movable(a)}
    ctx.protect(1, a)
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        out.update(status="fail", error=type(exc).__name__, still_fresh=pagemove.movable(a))
    else:
        out.update(status="ok", exact=bool(np.array_equal(a, data(rank))), moved=pagemove.stats["moved_bytes"])
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
