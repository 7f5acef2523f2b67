"""Asynchronous checkpoints over MPI when mpi4py runs below MPI_THREAD_MULTIPLE: every checkpoint is
written before the call returns (a background thread may not make MPI calls), and says so."""

from __future__ import annotations

import subprocess
import sys

from mpi_util import env, mpiexec, need_mpi

pytestmark = need_mpi()

CODE = r"""
import sys
import numpy as np
from mpi4py import MPI
import ftidask

base = sys.argv[1]
ctx = ftidask.init(comm=MPI.COMM_WORLD, async_ckpt=1, local_test=1, ckpt_dir=base + "/L", glbl_dir=base + "/G", meta_dir=base + "/M")
a = np.full(1 << 18, float(ctx.comm.rank))
ctx.protect(1, a)
handle = ctx.checkpoint(1, 1)
assert handle.mechanism == "blocking" and handle.done(), handle
a[:] = -1
assert handle.result().id == 1
ctx.recover()
assert (a == ctx.comm.rank).all()
ctx.finalize()
print("THREAD", MPI.Query_thread(), "OK", flush=True)
"""


def test_async_below_thread_multiple_is_blocking(tmp_path):
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", CODE, str(tmp_path)],
                          env={**env(), "MPI4PY_RC_THREAD_LEVEL": "serialized"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("OK") == 2 and "THREAD 3" not in proc.stdout
    assert "asynchronous checkpoints are written before the call returns" in proc.stderr
    # ... and what to do about it (docs/troubleshooting.md): the level MPI gave, the one needed, how to ask for it
    assert "MPI was initialized with MPI_THREAD_SERIALIZED" in proc.stderr, proc.stderr
    assert "MPI_THREAD_MULTIPLE" in proc.stderr and "mpi4py.rc.thread_level = 'multiple'" in proc.stderr, proc.stderr
