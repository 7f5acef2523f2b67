"""``stored_size`` on MPI ranks that hold blocks of different sizes: ``stored_size_job.py BASE`` on 3 ranks.

Phase ``write``: the sizes before and after checkpoint 1, a ``total=`` refused on rank 1 only, then the context is
closed unfinalized (a crash). Phase ``restart``, a new init of the run in the same job: the sizes of the checkpoint
to recover, before and after recover(). Each rank writes ``BASE/{phase}-{rank}.json``; tests/test_lifecycle_mpi.py
checks them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ftidask

RANK = MPI.COMM_WORLD.rank


def sizes(ctx: Any, vid: int = 1) -> list[int]:
    """This rank's size of ``vid`` and the job's (FTI_GetStoredSize is the rank's own)."""
    return [ctx.stored_size(vid), ctx.stored_size(vid, total=True)]


def phase(base: str, name: str) -> None:
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global",
                       meta_dir=f"{base}/Meta", local_test=1, node_size=1, group_size=3, verbosity=4)
    a = np.full(10 * (RANK + 1), float(RANK))  # 80, 160, 240 bytes
    ctx.protect(1, a)
    result: dict[str, Any] = {"status": ctx.status()}
    if name == "write":
        result["before"] = sizes(ctx)
        ctx.checkpoint(1, 1)
        result["after"], result["absent"] = sizes(ctx), sizes(ctx, 9)
        try:
            ctx.stored_size(1, total="yes" if RANK == 1 else True)
        except ftidask.FTIError as exc:
            result["refused"] = [type(exc).__name__, str(exc)]
        ctx._close()  # the crash: the checkpoint stays for the restart
    else:
        a[:] = -1
        result["restart"] = sizes(ctx)
        ctx.recover()
        result["recovered"] = sizes(ctx) + [bool((a == RANK).all())]
        ctx.finalize()
    Path(base, f"{name}-{RANK}.json").write_text(json.dumps(result))


def main() -> None:
    phase(sys.argv[1], "write")
    phase(sys.argv[1], "restart")


if __name__ == "__main__":
    main()
