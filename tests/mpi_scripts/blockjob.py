"""What the resharding dCP jobs share (dcp_fallback_job, reshard_older_job, reshard_spare_job): a run of one block
of a global float64 array per rank, and a recovery reported as a JSON-able dict."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ftidask


def init_block(base: str, size: int, *, node_size: int = 1, group_size: int | None = None
               ) -> tuple[ftidask.Context, np.ndarray, slice]:
    """A context over COMM_WORLD (dCP on, blocks of 4 KiB, simulated nodes) protecting this rank's block of a
    global array of ``size`` elements as id 1: (context, block, the block's slice of the global array)."""
    comm = MPI.COMM_WORLD
    n = size // comm.size
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                       enable_dcp=1, dcp_block_size=4096, local_test=1, node_size=node_size,
                       group_size=comm.size if group_size is None else group_size, verbosity=3)
    a = np.zeros(n)
    ctx.protect(1, a, global_shape=(size,), offset=(comm.rank * n,))
    return ctx, a, slice(comm.rank * n, (comm.rank + 1) * n)


def recover_report(ctx: ftidask.Context, a: np.ndarray, mine: slice, want: Callable[[int], np.ndarray],
                   message: bool = True) -> dict:
    """Recover; what was recovered and whether the block is exactly its values, or the error's class (and message)."""
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        return {"error": type(exc).__name__, **({"message": str(exc)[:500]} if message else {})}
    return {"from": list(ctx.recovered_from), "exact": bool(np.array_equal(a, want(ctx.recovered_from[0])[mine]))}
