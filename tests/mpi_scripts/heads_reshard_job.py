"""Process script of tests/test_mpi_heads_reshard.py: checkpoints written with heads, restarted on another layout.

usage: heads_reshard_job.py write BASE JSON    JSON: ``cfg`` (init keywords; ``head``, ``node_size``...), ``level``,
                                               ``count`` (checkpoints 1..count, the last one's values kept)
       heads_reshard_job.py recover BASE JSON  JSON: ``cfg``, ``declared`` (blocks declared, or undeclared arrays of
                                               the old rank's size), ``tag`` (names the result files); ``then``
                                               (``level``, ``count``): checkpoints written after the recovery

Every application rank protects its block of two global arrays (1-D float64, 2-D int32 cut along its rows) and a
replicated step counter; the values are functions of the global index and the step, so that every rank of any layout
knows the bytes it must get back. A write job ends without finalize (its checkpoints stay). A recovery writes
``BASE/result-{tag}-{rank}.json``: ``{"status": "ok", "from": [id, level], "exact": bool}`` or
``{"status": "error", "type": ..., "message": ...}``. Heads serve in ``init`` and exit there.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import ftidask

G1, G2 = 5000, (37, 23)


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts - n * i // parts


def values(step: int) -> dict[int, np.ndarray]:
    one = np.arange(G1) * 1.5 - 7 + step
    one[step * 97 % G1:step * 97 % G1 + 300] = -step  # a few blocks change from one step to the next (dCP)
    return {1: one, 2: (np.arange(np.prod(G2), dtype=np.int32).reshape(G2) * 3 - 50 + step),
            3: np.array([step], np.int64)}


def blocks(rank: int, size: int) -> dict[int, tuple[int, int]]:
    """var id -> (offset, length along axis 0) of this rank's block."""
    return {1: split(G1, size, rank), 2: split(G2[0], size, rank)}


def protect(ctx, step: int, declared: bool, size: int, rank: int) -> dict[int, np.ndarray]:
    full, arrays = values(step), {}
    for vid, (lo, n) in blocks(rank, size).items():
        arrays[vid] = np.array(full[vid][lo:lo + n])
        kw = {"global_shape": full[vid].shape, "offset": (lo,) + (0,) * (full[vid].ndim - 1)} if declared else {}
        ctx.protect(vid, arrays[vid], **kw)
    arrays[3] = full[3].copy()
    ctx.protect(3, arrays[3], replicated=declared)
    return arrays


def main() -> None:
    mode, base, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = {"ckpt_dir": f"{base}/L", "glbl_dir": f"{base}/G", "meta_dir": f"{base}/M", "local_test": 1,
           "verbosity": 3, "block_size": 256, "transfer_size": 1, **spec["cfg"]}
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg)  # a head serves here and exits (SystemExit)
    comm, rank, size = ctx.comm, ctx.comm.rank, ctx.comm.size
    if mode == "write":
        arrays = protect(ctx, 0, True, size, rank)
        for s in range(1, spec["count"] + 1):
            for vid, a in protect(ctx, s, True, size, rank).items():
                arrays[vid][...] = a
            ctx.checkpoint(s, spec["level"])
            reply = ctx.wait_post_processing()
            assert reply is None or reply["ok"], reply
        ctx._close()  # the job ends without finalize: its checkpoints stay
        return
    arrays = protect(ctx, -1, spec["declared"], spec.get("old_size", size), rank)  # -1: no step's values
    try:
        ctx.recover()
        step = int(arrays[3][0])
        want = protect_values(step, spec.get("old_size", size) if not spec["declared"] else size, rank)
        exact = all(arrays[v].tobytes() == want[v].tobytes() for v in want)
        out = {"status": "ok", "from": list(ctx.recovered_from), "step": step, "exact": exact}
    except ftidask.FTIError as exc:
        out = {"status": "error", "type": type(exc).__name__, "message": str(exc)}
    with open(f"{base}/result-{spec['tag']}-{rank}.json", "w") as fh:
        json.dump(out, fh)
    comm.Barrier()
    then = spec.get("then")  # the restarted run goes on: checkpoints at this layout, numbered after the step recovered
    if then and out["status"] == "ok":
        for s in range(out["step"] + 1, out["step"] + 1 + then["count"]):
            for vid, a in protect_values(s, size, rank).items():
                arrays[vid][...] = a
            ctx.checkpoint(s, then["level"])
            reply = ctx.wait_post_processing()
            assert reply is None or reply["ok"], reply
    ctx.finalize() if spec.get("finalize") else ctx._close()


def protect_values(step: int, size: int, rank: int) -> dict[int, np.ndarray]:
    full = values(step)
    out = {vid: full[vid][lo:lo + n] for vid, (lo, n) in blocks(rank, size).items()}
    out[3] = full[3]
    return out


if __name__ == "__main__":
    main()
