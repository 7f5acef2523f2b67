"""Child process of tests/test_dcp_crash.py: differential checkpoints of a deterministic state.

Usage: python _dcp_crash_child.py ROOT STEPS LEVEL [POINT:N]. On a restart it recovers and goes on
from the recovered step. Prints each committed step. With POINT:N it kills itself (SIGKILL) at the
N-th time it reaches POINT (see :data:`CRASH_POINTS`), counted over the whole run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import ftidask
from ftidask.dcp import files as dcp
from ftidask.engine import dcpstore

sys.path.insert(0, str(Path(__file__).parent))
import crashpoints  # noqa: E402

# Where a differential checkpoint can be killed: a crash point wrapped around a product function.
CRASH_POINTS = {
    "write_var": lambda n: crashpoints.kill_at_call(dcpstore.DcpHandle, "write_var", n),  # a variable's patch starts
    "block": crashpoints.kill_at_block_write,  # before a write of changed blocks into the spare
    "finished": lambda n: crashpoints.kill_at_call(dcp.DcpFileWriter, "finish", n, after=True),  # file complete
    "renamed": lambda n: crashpoints.kill_at_call(dcpstore.DcpHandle, "finish", n, after=True),  # renamed, no record
    "retired": lambda n: crashpoints.kill_at_call(dcpstore.DcpStore, "retire", n, after=True),  # now the spare
}

SIZES = {1: (200_000, np.float64), 2: (50_000, np.int32), 3: (300_000, np.uint8)}


def config(root: str) -> dict:
    return dict(ckpt_dir=f"{root}/l", glbl_dir=f"{root}/g", meta_dir=f"{root}/m", enable_dcp=1,
                dcp_block_size=4096, verbosity=4)


def initial() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {vid: rng.integers(0, 1000, size=n).astype(dt) for vid, (n, dt) in SIZES.items()}


def update(arrays: dict[int, np.ndarray], step: int) -> None:
    """Step ``step``'s changes: a few scattered elements and one region, in place."""
    rng = np.random.default_rng(step)
    for vid, arr in arrays.items():
        idx = rng.integers(0, arr.size, size=5)
        arr[idx] = rng.integers(0, 1000, size=5)
        if (step + vid) % 3 == 0:
            lo = int(rng.integers(0, arr.size - 20_000))
            arr[lo:lo + 20_000] = rng.integers(0, 1000, size=20_000)


def state(step: int) -> dict[int, np.ndarray]:
    arrays = initial()
    for k in range(1, step + 1):
        update(arrays, k)
    return arrays


def recovered_step(root: str) -> int:
    """Recover ROOT's run in a fresh context (no finalize); the state must be exactly that of the step it holds,
    which is returned. NoCheckpointError passes through."""
    ctx = ftidask.init(**config(root))
    arrays = {vid: np.zeros(n, dt) for vid, (n, dt) in SIZES.items()}
    step = np.zeros(1, np.int64)
    for vid, arr in arrays.items():
        ctx.protect(vid, arr)
    ctx.protect(99, step)
    try:
        ctx.recover()
    finally:
        ctx._closed = True
    want = state(int(step[0]))
    for vid in arrays:
        assert arrays[vid].tobytes() == want[vid].tobytes(), f"variable {vid} at step {int(step[0])}"
    return int(step[0])


def main() -> None:
    root, steps, level = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:
        point, _sep, count = sys.argv[4].partition(":")
        CRASH_POINTS[point](int(count or "1"))
    ctx = ftidask.init(**config(root))
    arrays = initial()
    step = np.zeros(1, np.int64)
    for vid, arr in arrays.items():
        ctx.protect(vid, arr)
    ctx.protect(99, step)
    if ctx.status():
        ctx.recover()
    for k in range(int(step[0]) + 1, steps + 1):
        update(arrays, k)
        step[0] = k
        ctx.checkpoint(k, level)
        print(k, flush=True)
    ctx._closed = True  # keep the run (no finalize): the test recovers from it


if __name__ == "__main__":
    main()
