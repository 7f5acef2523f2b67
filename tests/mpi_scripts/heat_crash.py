"""examples/heat_mpi.py, whose last rank dies (``os._exit``, no cleanup) when iteration N starts.

usage: heat_crash.py N [heat_mpi.py arguments]

The crash point wraps the iteration the example hands to :func:`ftidask.resilient`: the example
itself holds no test hook.
"""

import os
import runpy
import sys
from pathlib import Path

import ftidask

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "heat_mpi.py"
crash_at = int(sys.argv.pop(1))
real_resilient = ftidask.resilient


def resilient(ctx, **kwargs):
    decorate = real_resilient(ctx, **kwargs)

    def wrap(fn):
        def step(i):
            if i == crash_at and ctx.comm.rank == ctx.comm.size - 1:
                os._exit(3)  # a node dies, no cleanup
            return fn(i)

        return decorate(step)

    return wrap


ftidask.resilient = resilient
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
