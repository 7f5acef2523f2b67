"""Rank script: a restart on another number of ranks into arrays of restart size (tests/test_mpi_reshard_pages.py).

usage: reshard_pages_job.py write BASE     (3 ranks) an L1 checkpoint of three global arrays, then dies
       reshard_pages_job.py recover BASE   (2 ranks) recovers into fresh and in-use arrays of 24 MiB and more
Each rank writes ``BASE/result-<rank>.json``. The global arrays are functions of the index, so every rank knows
what each block must hold.
"""

import json
import sys

import numpy as np

import ftidask
from ftidask.engine import pagemove

N1 = 6 << 20        # float64, 1-D: 48 MiB, fresh on restart (pages moved under it)
N2 = (1536, 2048)   # float64, 2-D in Fortran order: 24 MiB (copied: not C-ordered)
N3 = 5 << 20        # int64, 1-D: 40 MiB, an array in use on restart (copied)


def glob(vid: int) -> np.ndarray:
    if vid == 1:
        return np.arange(N1, dtype=np.float64) * 0.5 - 3
    if vid == 2:
        return np.asfortranarray(np.arange(N2[0] * N2[1], dtype=np.float64).reshape(N2) / 3)
    return np.arange(N3, dtype=np.int64) * 7 - 11


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    edges = [n * k // parts for k in range(parts + 1)]
    return edges[i], edges[i + 1] - edges[i]


def block(vid: int, rank: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if vid == 2:  # rows split: each block's columns are runs of the old blocks' streams only when whole
        o, n = split(N2[0], size, rank)
        return (o, 0), (n, N2[1])
    o, n = split(N1 if vid == 1 else N3, size, rank)
    return (o,), (n,)


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "verbosity": 4, "node_size": 1}


def write(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    for vid in (1, 2, 3):
        off, shape = block(vid, comm.rank, comm.size)
        g = glob(vid)
        part = g[tuple(slice(o, o + n) for o, n in zip(off, shape))]
        arr = np.asfortranarray(part) if vid == 2 else np.array(part)
        ctx.protect(vid, arr, global_shape=g.shape, offset=off)
    ctx.checkpoint(1, 1)
    ctx._close()  # as if the job died: the checkpoint stays


def recover(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    arrays = {}
    for vid in (1, 2, 3):
        off, shape = block(vid, comm.rank, comm.size)
        if vid == 1:
            arr = np.empty(shape)  # fresh: never touched
        elif vid == 2:
            arr = np.empty(shape, order="F")
        else:
            arr = np.full(shape, -1, np.int64)  # in use
        arrays[vid] = arr
        ctx.protect(vid, arr, global_shape=glob(vid).shape, offset=off)
    fresh_before = pagemove.movable(arrays[1])
    moved = pagemove.stats["moved_bytes"]
    result = {"fresh_before": fresh_before}
    try:
        ctx.recover()
    except ftidask.RecoveryError as exc:
        lo, hi = pagemove._whole_pages(arrays[1])
        result.update(error=str(exc), fresh_untouched=pagemove._never_touched(lo, hi),
                      in_use_untouched=bool((arrays[3] == -1).all()))
    else:
        equal = {}
        for vid, arr in arrays.items():
            off, shape = block(vid, comm.rank, comm.size)
            want = glob(vid)[tuple(slice(o, o + n) for o, n in zip(off, shape))]
            equal[str(vid)] = arr.dtype == want.dtype and bool(np.array_equal(arr, want))
        result.update(equal=equal, moved=pagemove.stats["moved_bytes"] - moved)
    ctx._close()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    {"write": write, "recover": recover}[sys.argv[1]](sys.argv[2])
