"""One stage of a chain of restarts on changing numbers of ranks (tests/test_mpi_restart_chain.py).

usage: [mpiexec -n P] python restart_chain_job.py BASE GROUP_SIZE PREV CKPT:LEVEL,...|'' [serial]
Every rank (or the one process, ``serial``: no MPI at all) protects its block of three global arrays declared with
``global_shape``/``offset`` (1-D float64 by rows, 2-D int32 in Fortran order by columns) and a replicated float32
array. PREV > 0: recover() first; the result says which checkpoint came back and whether every array is, bit for
bit, what checkpoint PREV held. Then each CKPT is written at its LEVEL with CKPT's values. Writes
``BASE/result-{P}-{rank}.json``; the process then dies without finalize (the run stays as it is).
"""

from __future__ import annotations

import json
import sys

import numpy as np

import ftidask

N1, SHAPE2, N3 = 1003, (6, 37), 7


def want(c: int) -> dict[int, np.ndarray]:
    """The global arrays of checkpoint ``c``: alike from one checkpoint to the next but for a few elements (so
    that differential checkpoints write only some blocks)."""
    a = np.arange(N1, dtype=np.float64) * 0.5
    a[(c * 97) % N1] = -c
    b = np.asfortranarray(np.arange(np.prod(SHAPE2), dtype=np.int32).reshape(SHAPE2) * 3)
    b[c % SHAPE2[0], (c * 5) % SHAPE2[1]] = -c
    return {1: a, 2: b, 3: np.linspace(0, 1, N3, dtype=np.float32) + c}


def main() -> None:
    base, group, prev, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    serial = sys.argv[5:] == ["serial"]
    dirs = {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "node_size": 1, "enable_dcp": 1, "dcp_block_size": 512, "verbosity": 3}
    if serial:
        rank, size = 0, 1
        ctx = ftidask.init(**dirs)
    else:
        from mpi4py import MPI

        rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        ctx = ftidask.init(comm=MPI.COMM_WORLD, group_size=group, **dirs)
    lo1, hi1 = N1 * rank // size, N1 * (rank + 1) // size
    lo2, hi2 = SHAPE2[1] * rank // size, SHAPE2[1] * (rank + 1) // size
    mine = {1: (slice(lo1, hi1),), 2: (slice(None), slice(lo2, hi2)), 3: (slice(None),)}
    arrays = {1: np.zeros(hi1 - lo1), 2: np.zeros((SHAPE2[0], hi2 - lo2), np.int32, order="F"),
              3: np.zeros(N3, np.float32)}
    ctx.protect(1, arrays[1], global_shape=(N1,), offset=(lo1,))
    ctx.protect(2, arrays[2], global_shape=SHAPE2, offset=(0, lo2))
    ctx.protect(3, arrays[3], replicated=True)
    out: dict = {}
    if prev:
        try:
            ctx.recover()
            out["from"] = list(ctx.recovered_from)
            out["exact"] = all(arrays[v].tobytes() == np.ascontiguousarray(g[mine[v]]).tobytes()
                               for v, g in want(prev).items())
        except ftidask.FTIError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    if "error" not in out:
        for step in filter(None, steps.split(",")):
            ckpt, level = map(int, step.split(":"))
            for v, g in want(ckpt).items():
                arrays[v][...] = g[mine[v]]
            ctx.checkpoint(ckpt, level)
    with open(f"{base}/result-{size}-{rank}.json", "w") as fh:
        json.dump(out, fh)
    ctx._closed = True  # the process dies: no finalize


if __name__ == "__main__":
    main()
