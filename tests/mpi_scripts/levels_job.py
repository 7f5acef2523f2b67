"""Rank script for the MPI level tests: write one checkpoint, or recover a list of damaged copies.

usage: levels_job.py write CONFIG_JSON DIR LEVEL
       levels_job.py keep CONFIG_JSON DIR LEVEL      (checkpoint, then finalize: keep_last_ckpt)
       levels_job.py probe CONFIG_JSON DIR LEVEL     (report the error class of init/checkpoint per rank)
       levels_job.py shrink CONFIG_JSON DIR LEVEL    (checkpoint 1 at L1 with a larger "field", checkpoint 2 at
                                                     LEVEL with the usual arrays: its containers keep slack)
       levels_job.py recover CONFIG_JSON DIR [DIR ...]
Each rank holds (rank % 7 + 1) * 100000 doubles plus a small int array, from a seed of its rank.
Each rank writes ``<dir>/result-<rank>.json`` per case: {"status": ok|fail|wrong, "error", "message", "untouched"}.
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


def report(base: str, rank: int, **fields: object) -> None:
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(fields, fh)


def main() -> None:
    mode, overrides = sys.argv[1], json.loads(sys.argv[2])
    if mode == "probe":
        world = MPI.COMM_WORLD.rank
        own = overrides.pop("rank1", {})  # world rank 1's own values
        if world == 1:
            overrides.update(own)
        try:
            ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(sys.argv[3]))
            ctx.protect(1, arrays(ctx.comm.rank)[0])
            ctx.checkpoint(1, int(sys.argv[4]))
            ctx.finalize()
        except ftidask.FTIError as exc:
            report(sys.argv[3], world, status="fail", error=type(exc).__name__, message=str(exc))
        else:
            report(sys.argv[3], world, status="ok")
        return
    if mode == "keep":
        with ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(sys.argv[3])) as ctx:
            ctx.protect(1, arrays(ctx.comm.rank)[0])
            ctx.protect(2, arrays(ctx.comm.rank)[1])
            ctx.checkpoint(1, int(sys.argv[4]))
        return
    if mode == "shrink":
        ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(sys.argv[3]))
        a, b = arrays(ctx.comm.rank)
        ctx.protect(1, np.ones(a.size + 5000), name="field")
        ctx.protect(2, b)
        ctx.checkpoint(1, 1)
        ctx.protect(1, a, name="field")  # smaller: FTI-FF keeps its containers, partly filled
        ctx.checkpoint(2, int(sys.argv[4]))
        ctx.wait_post_processing()
        ctx.transport.close()  # die without finalize: the checkpoint stays
        return
    if mode == "write":
        ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(sys.argv[3]))
        a, b = arrays(ctx.comm.rank)
        ctx.protect(1, a, name="field")
        ctx.protect(2, b)
        info = ctx.checkpoint(1, int(sys.argv[4]))
        if isinstance(info, ftidask.CheckpointHandle):  # async_ckpt = 1: the arrays may change at once
            forced = overrides.get("async_snapshot", "auto")
            assert forced == "auto" or info.mechanism == forced, (forced, info.mechanism)
            a[:] = -1.0
            b[:] = -7
            info = info.result()
            a[:], b[:] = arrays(ctx.comm.rank)
        reply = ctx.wait_post_processing()
        print(f"WROTE {ctx.comm.rank} {info.level} {json.dumps(reply)}", flush=True)
        ctx.transport.close()  # die without finalize: the checkpoint stays
        return
    for base in sys.argv[3:]:
        try:
            ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
        except ftidask.FTIError as exc:
            report(base, MPI.COMM_WORLD.rank, status="fail", error=type(exc).__name__, message=str(exc))
            continue
        rank = ctx.comm.rank
        want_a, want_b = arrays(rank)
        a, b = np.zeros_like(want_a), np.zeros_like(want_b)
        ctx.protect(1, a)
        ctx.protect(2, b)
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            report(base, rank, status="fail", error=type(exc).__name__, message=str(exc),
                   untouched=not a.any() and not b.any())
        else:
            same = a.tobytes() == want_a.tobytes() and b.tobytes() == want_b.tobytes()
            report(base, rank, status="ok" if same else "wrong", source=list(ctx.recovered_from))
        ctx.transport.close()  # no finalize: the rebuilt files stay for the test to inspect


if __name__ == "__main__":
    main()
