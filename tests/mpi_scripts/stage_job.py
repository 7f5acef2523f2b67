"""Rank script for the MPI staging tests: every application rank stages files, checkpoints in between.

usage: stage_job.py CONFIG_JSON DIR [BIG_MIB]   (BIG_MIB: one more file of that size per rank)
Prints ``STAGED <rank> <mover> <ok> <sequences>`` per application rank (heads never return from init).
"""

import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI  # noqa: F401 - initializes MPI

import ftidask
from ftidask import SI_FAIL, SI_NINI, SI_SCES


def main() -> None:
    cfg, base = json.loads(sys.argv[1]), sys.argv[2]
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global",
                       meta_dir=f"{base}/Meta", enable_staging=1, **cfg)
    rank = ctx.transport.rank
    stage = ctx.stage_dir()
    mover = type(ctx._stager.mover).__name__
    data = np.arange(50_000, dtype=np.float64) + rank
    ctx.protect(1, data)
    expected, ids = {}, {}
    sizes = [0, 1, 5000, 1 << 20, 8 << 20]
    count = 10
    if len(sys.argv) > 3:
        sizes.append(int(sys.argv[3]) << 20)
        count = len(sizes) * 2
    for i in range(count):
        payload = os.urandom(sizes[i % len(sizes)])
        (stage / f"f{i}").write_bytes(payload)
        name = f"r{rank}/f{i}"
        expected[name] = payload
        ids[name] = ctx.send_file(stage / f"f{i}", name)
        if i == 4:
            ctx.checkpoint(1, 4)  # post-processing by the heads (inline_l4 = 0) between staging requests
    ok = True
    try:
        ctx.send_file(stage / "missing", "x")
        ok = False
    except ftidask.StagingError:
        pass
    sequences = {}
    deadline = time.monotonic() + 120
    for name, req in ids.items():
        seq = []
        while time.monotonic() < deadline:
            state = ctx.stage_status(req)
            if not seq or seq[-1] != state:
                seq.append(state)
            if state in (SI_SCES, SI_FAIL):
                break
            time.sleep(0.001)
        sequences[name] = seq
        ok &= seq[-1] == SI_SCES and ctx.stage_status(req) == SI_NINI
        ok &= open(f"{base}/Global/{name}", "rb").read() == expected[name]
    ok &= not any(stage.iterdir())
    ctx.finalize()
    print(f"STAGED {rank} {mover} {ok} {json.dumps(list(sequences.values()))}", flush=True)


if __name__ == "__main__":
    main()
