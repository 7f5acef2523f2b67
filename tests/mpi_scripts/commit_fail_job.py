"""Rank script: rank 0 cannot write the commit record of checkpoint 2 (its meta_dir is full).

usage: commit_fail_job.py DIR
Every rank must fail checkpoint 2 with the same CheckpointError (none waits in a barrier), and a
restarted run must recover checkpoint 1. Each rank writes ``DIR/result-<rank>.json``.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.storage import files as storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the seam
from diskfull import full_commit_records  # noqa: E402


def main() -> None:
    base = sys.argv[1]
    dirs = {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "verbosity": 4}
    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs)
    data = np.arange(1000.0) + comm.rank
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    real_open_temp = storage.open_temp
    if comm.rank == 0:  # the seam: only rank 0 writes commit records, and its disk is full
        full_commit_records()
    data += 10
    result = {}
    try:
        ctx.checkpoint(2, 1)
    except ftidask.FTIError as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    storage.open_temp = real_open_temp
    ctx._close()
    ctx = ftidask.init(comm=comm, **dirs)
    out = np.zeros(1000)
    ctx.protect(1, out)
    ctx.recover()
    result.update(source=list(ctx.recovered_from), intact=bool(np.array_equal(out, np.arange(1000.0) + comm.rank)))
    ctx.finalize()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
