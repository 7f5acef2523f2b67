"""Rank script: a restart on another number of ranks where one rank cannot allocate its staging buffer
(tests/test_mpi_reshard_oom.py).

usage: reshard_oom_job.py write BASE     (3 ranks) an L1 checkpoint of a global array, then dies
       reshard_oom_job.py recover BASE   (2 ranks) rank 1 lowers its address-space limit (RLIMIT_AS) to a few MiB
                                         above what it maps, recovers, lifts the limit and recovers again
Each rank writes ``BASE/result-<rank>.json``: the first recovery's error (or none), whether its array was left
alone, whether the second recovery filled it exactly.
"""

import json
import resource
import sys

import numpy as np

import ftidask

N = 3 << 20  # float64: 24 MiB in all, 12 MiB a new rank (more than the limit leaves)


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "verbosity": 4, "node_size": 1}


def block(rank: int, size: int) -> tuple[int, int]:
    return N * rank // size, N * (rank + 1) // size


def write(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    lo, hi = block(comm.rank, comm.size)
    ctx.protect(1, np.arange(lo, hi, dtype=np.float64), global_shape=(N,), offset=(lo,))
    ctx.checkpoint(1, 1)
    ctx._close()


def _mapped() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


def recover(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    lo, hi = block(comm.rank, comm.size)
    arr = np.full(hi - lo, -1.0)  # in use: staged in a buffer of its size, then copied
    ctx.protect(1, arr, global_shape=(N,), offset=(lo,))
    result = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if comm.rank == 1:
        resource.setrlimit(resource.RLIMIT_AS, (_mapped() + (4 << 20), hard))
    try:
        ctx.recover()
        result["first"] = "recovered"
    except ftidask.FTIError as exc:
        result["first"] = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result["untouched"] = bool((arr == -1).all())
    if result["first"] != "recovered":
        ctx.recover()
    result["exact"] = arr.tobytes() == np.arange(lo, hi, dtype=np.float64).tobytes()
    ctx._close()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    {"write": write, "recover": recover}[sys.argv[1]](sys.argv[2])
