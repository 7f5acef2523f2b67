"""Rank script: a restart on another number of ranks where one rank cannot allocate its staging buffer
(tests/test_mpi_reshard_oom.py).

usage: reshard_oom_job.py write BASE     (3 ranks) an L1 checkpoint of a global array, then dies
       reshard_oom_job.py recover BASE   (2 ranks) rank 1 lowers its address-space limit (RLIMIT_AS) to a few MiB
                                         above what it maps, recovers, lifts the limit and recovers again
Each rank writes ``BASE/result-<rank>.json``: the first recovery's error (or none), whether its array in use was left
alone, whether the second recovery filled both arrays exactly. Variable 1 is an array in use, variable 2 a new one
whose pages rank 1 cannot map: both are then verified first and read into their arrays after the agreement; the
threads that verify them are what rank 1 cannot start (each reserves its stack).
"""

import json
import resource
import sys

import numpy as np

import ftidask

N = 6 << 20  # variable 2, float64: 48 MiB in all, 24 MiB a new rank (more than the limit leaves)
N1 = 3 << 16  # variable 1, float64: 1.5 MiB in all


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "verbosity": 4, "node_size": 1}


def block(rank: int, size: int, n: int = N) -> tuple[int, int]:
    return n * rank // size, n * (rank + 1) // size


def write(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    lo, hi = block(comm.rank, comm.size)
    ctx.protect(2, np.arange(lo, hi, dtype=np.float64), global_shape=(N,), offset=(lo,))
    lo, hi = block(comm.rank, comm.size, N1)
    ctx.protect(1, np.arange(lo, hi, dtype=np.float64) * -2, global_shape=(N1,), offset=(lo,))
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
    fresh = np.empty(hi - lo)  # 24 MiB: its moved pages, or a buffer of its size, are what rank 1 cannot map
    ctx.protect(2, fresh, global_shape=(N,), offset=(lo,))
    lo1, hi1 = block(comm.rank, comm.size, N1)
    arr = np.full(hi1 - lo1, -1.0)  # in use
    ctx.protect(1, arr, global_shape=(N1,), offset=(lo1,))
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
    result["exact"] = (fresh.tobytes() == np.arange(lo, hi, dtype=np.float64).tobytes()
                       and arr.tobytes() == (np.arange(lo1, hi1, dtype=np.float64) * -2).tobytes())
    ctx._close()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    {"write": write, "recover": recover}[sys.argv[1]](sys.argv[2])
