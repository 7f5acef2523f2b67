"""Rank script: declared blocks that the restart cannot take as they are (tests/test_mpi_reshard_moved.py).

usage: reshard_moved_job.py write BASE     (2 ranks) a structured-dtype variable and a float one, in halves
       reshard_moved_job.py swapped BASE   (2 ranks) the same count, each rank declaring the other's half
       reshard_moved_job.py resized BASE   (2 ranks) the same count, blocks of 3 and 7 elements
       reshard_moved_job.py recover BASE   (any count) blocks split evenly
Each rank writes ``BASE/<mode>-<size>-<rank>.json``: "ok" and whether every block is bit for bit, or the error.
"""

import json
import sys

import numpy as np

import ftidask

N = 10
STRUCT = np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "?")])  # packed: a sub-array field, a bool


def globals_() -> dict[int, np.ndarray]:
    s = np.zeros(N, STRUCT)
    s["a"], s["b"], s["c"] = np.arange(N) - 3, np.arange(2 * N).reshape(N, 2) / 3, np.arange(N) % 3 == 0
    return {1: s, 2: np.arange(N) * 1.25, 3: np.arange(4.0) * 3}  # 3: replicated


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode, base = sys.argv[1], sys.argv[2]
    edges = [N * k // comm.size for k in range(comm.size + 1)]
    block = comm.size - 1 - comm.rank if mode == "swapped" else comm.rank
    lo, hi = edges[block], edges[block + 1]
    if mode == "resized":
        lo, hi = (0, 3) if comm.rank == 0 else (3, N)
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M",
                       local_test=1, verbosity=4)
    expect = {vid: g[lo:hi].copy() if vid != 3 else g.copy() for vid, g in globals_().items()}
    arrays = {vid: (e.copy() if mode == "write" else np.zeros_like(e)) for vid, e in expect.items()}
    for vid, a in arrays.items():
        ctx.protect(vid, a, **({"replicated": True} if vid == 3 else {"global_shape": (N,), "offset": (lo,)}))
    if mode == "write":
        ctx.checkpoint(1, 1)
        ctx._close()  # as if the job died: the checkpoint stays
        return
    try:
        ctx.recover()
        out = {"ok": True, "equal": all(a.tobytes() == expect[vid].tobytes() for vid, a in arrays.items()),
               "from": list(ctx.recovered_from)}
    except ftidask.FTIError as exc:
        out = {"error": type(exc).__name__, "message": str(exc),
               "untouched": all(not a.view(np.uint8).any() for a in arrays.values())}
    ctx._close()
    with open(f"{base}/{mode}-{comm.size}-{comm.rank}.json", "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
