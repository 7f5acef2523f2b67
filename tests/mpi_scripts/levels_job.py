"""Rank script for the MPI level tests: write one checkpoint, or recover a list of damaged copies.

usage: levels_job.py write CONFIG_JSON DIR LEVEL
       levels_job.py recover CONFIG_JSON DIR [DIR ...]
Each rank holds (rank % 7 + 1) * 100000 doubles plus a small int array, from a seed of its rank.
Prints one line per rank and case: ``RESULT <dir> <rank> ok|fail <error class> <message>``.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask


def arrays(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    return rng.random((rank % 7 + 1) * 100000), np.arange(rank, rank + 33, dtype=np.int32)


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}


def main() -> None:
    mode, overrides = sys.argv[1], json.loads(sys.argv[2])
    if mode == "write":
        ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(sys.argv[3]))
        a, b = arrays(ctx.comm.rank)
        ctx.protect(1, a, name="field")
        ctx.protect(2, b)
        info = ctx.checkpoint(1, int(sys.argv[4]))
        reply = ctx.wait_post_processing()
        print(f"WROTE {ctx.comm.rank} {info.level} {json.dumps(reply)}", flush=True)
        ctx.transport.close()  # die without finalize: the checkpoint stays
        return
    for base in sys.argv[3:]:
        try:
            ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
        except ftidask.FTIError as exc:
            print(f"RESULT {base} {MPI.COMM_WORLD.rank} fail {type(exc).__name__} {str(exc)!r}", flush=True)
            continue
        rank = ctx.comm.rank
        want_a, want_b = arrays(rank)
        a, b = np.zeros_like(want_a), np.zeros_like(want_b)
        ctx.protect(1, a)
        ctx.protect(2, b)
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            untouched = not a.any() and not b.any()
            print(f"RESULT {base} {rank} fail {type(exc).__name__} untouched={untouched} "
                  f"{str(exc).splitlines()[0]!r}", flush=True)
        else:
            same = a.tobytes() == want_a.tobytes() and b.tobytes() == want_b.tobytes()
            print(f"RESULT {base} {rank} {'ok' if same else 'WRONG-DATA'} from={ctx.recovered_from}", flush=True)
        ctx.finalize()


if __name__ == "__main__":
    main()
