"""Rank script: a restart on another number of ranks into arrays in use where one rank's old file is cut after every
rank verified its pieces and agreed, before they are read into the arrays (tests/test_mpi_reshard_in_place.py).

usage: reshard_load_job.py write BASE     (4 ranks) an L1 checkpoint of two global arrays, then ends
       reshard_load_job.py recover BASE   (2 ranks) rank 0 alone sets the test seam (reshard.BEFORE_LOAD): it cuts
                                          old rank 3's file, which only rank 1 reads; then it puts the file back
                                          and both ranks recover again
Each rank writes ``BASE/result-<rank>.json``: the first recovery's error, whether its fresh array (moved pages) was
left untouched, whether the second recovery filled both arrays exactly.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

import ftidask
from ftidask.engine import pagemove, reshard

N1, N2 = 1 << 16, 5 << 20  # float64: variable 1 in use (256 KiB a new rank), variable 2 fresh (20 MiB a new rank)


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "verbosity": 4, "node_size": 1}


def glob(vid: int) -> np.ndarray:
    return np.arange(N1, dtype=np.float64) * -2 if vid == 1 else np.arange(N2, dtype=np.float64) / 3


def block(rank: int, size: int, n: int) -> tuple[int, int]:
    return n * rank // size, n * (rank + 1) // size


def write(base: str, arrays=None) -> None:
    """An L1 checkpoint of ``arrays`` ({var id: global array}; by default this job's two) in 1-D blocks, then end."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    for vid, whole in (arrays or {1: glob(1), 2: glob(2)}).items():
        lo, hi = block(comm.rank, comm.size, len(whole))
        ctx.protect(vid, whole[lo:hi].copy(), global_shape=(len(whole),), offset=(lo,))
    ctx.checkpoint(1, 1)
    ctx._close()


def recover(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    lo2, hi2 = block(comm.rank, comm.size, N2)
    fresh = np.empty(hi2 - lo2)  # first: its own mapping, never touched (its verified pages moved under it)
    ctx.protect(2, fresh, global_shape=(N2,), offset=(lo2,))
    lo1, hi1 = block(comm.rank, comm.size, N1)
    arr = np.full(hi1 - lo1, -1.0)  # in use
    ctx.protect(1, arr, global_shape=(N1,), offset=(lo1,))
    (path,) = Path(base, "Local").rglob("Ckpt1-Rank3.fti")
    saved = path.read_bytes()
    if comm.rank == 0:
        reshard.BEFORE_LOAD = lambda: os.truncate(path, len(saved) - 10)  # rank 1 reads it, not rank 0
    result = {"fresh": pagemove.movable(fresh)}
    try:
        ctx.recover()
        result["first"] = "recovered"
    except ftidask.FTIError as exc:
        result["first"] = f"{type(exc).__name__}: {exc}"
    reshard.BEFORE_LOAD = None
    result["untouched"] = pagemove.movable(fresh)  # its staged pages neither moved under it nor copied
    comm.barrier()
    if comm.rank == 0:
        path.write_bytes(saved)
    comm.barrier()
    ctx.recover()
    result["exact"] = (arr.tobytes() == glob(1)[lo1:hi1].tobytes() and fresh.tobytes() == glob(2)[lo2:hi2].tobytes())
    ctx._close()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    {"write": write, "recover": recover}[sys.argv[1]](sys.argv[2])
