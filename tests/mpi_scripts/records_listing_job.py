"""Rank script of test_records_cache: rank 0 cannot list the commit records (no descriptor left: EMFILE) during a
checkpoint; every rank must get the same CheckpointError, and the committed checkpoints stay (records and files).

usage: records_listing_job.py DIR     (each rank writes DIR/result-<rank>.json)
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask

RANK = MPI.COMM_WORLD.rank
base = Path(sys.argv[1])
cfg = {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"),
       "local_test": 1, "node_size": 1, "verbosity": 4, "exec_id": "listing"}
a = np.arange(1000, dtype=np.float64) * (RANK + 1)
ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg)
ctx.protect(1, a)
ctx.checkpoint(1, 4)
a += 1
ctx.checkpoint(2, 1)  # L1 after L4: both kept
MPI.COMM_WORLD.Barrier()
error = None
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if RANK == 0:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fd, hard))  # no descriptor left on rank 0
try:
    ctx.checkpoint(3, 1)
except ftidask.FTIError as exc:
    error = (type(exc).__name__, str(exc))
finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
listed = [[r.ckpt_id, r.level] for r in ctx.state.records()] if RANK == 0 else None
ctx._close()
MPI.COMM_WORLD.Barrier()
if RANK == 0:  # every node's L1 checkpoint is lost: checkpoint 1 from L4
    for node in (base / "Local").glob("node*"):
        for l1 in node.glob("listing/l1"):
            for d in l1.iterdir():
                for f in d.iterdir():
                    f.unlink()
MPI.COMM_WORLD.Barrier()
ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg)
b = np.zeros_like(a)
ctx.protect(1, b)
try:
    ctx.recover()
except ftidask.FTIError as exc:  # the same on every rank: reported, not a crash of the job
    recovered = str(exc)
else:
    recovered = list(ctx.recovered_from[:2]) if ctx.recovered_from else None
same = bool((b == np.arange(1000, dtype=np.float64) * (RANK + 1)).all())
ctx._close()
(base / f"result-{RANK}.json").write_text(json.dumps({"error": error, "listed": listed, "same": same,
                                                       "recovered": recovered}))
