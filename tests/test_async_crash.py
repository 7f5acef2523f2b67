"""SIGKILL while asynchronous checkpoints are in flight: the restart recovers the last committed
checkpoint or a newer one, exactly as it was at its call, never a mix, never nothing.

A child process checkpoints in a loop (each checkpoint's arrays hold its id; right after each call it
overwrites them, so a checkpoint that read live memory would hold garbage) and is killed for real at a
random moment; the test restarts the run and checks what it recovers.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from campaign import kept
from conftest import ROOT

import ftidask

CHILD = r"""
import sys
import numpy as np
import ftidask

dirs = dict(ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global", meta_dir=sys.argv[1] + "/Meta")
ctx = ftidask.init(exec_id="crash", async_snapshot=sys.argv[2], enable_dcp=1, **dirs)
a = np.zeros(1 << 20)            # 8 MiB
b = np.zeros(300_000, np.int32)
ctx.protect(1, a)
ctx.protect(2, b)
levels = [int(x) for x in sys.argv[3].split(",")]
previous = None
for i in range(1, 100000):
    a[:] = i
    b[:] = i
    handle = ctx.checkpoint(i, levels[i % len(levels)], wait=False)
    a[:] = -1.0  # the checkpoint holds the values at the call
    b[::7] = -1
    if previous is not None:
        previous.result()
        print("committed", previous.ckpt_id, flush=True)
    previous = handle
"""


def _run_once(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    mechanism = rng.choice(["auto", "copy"])
    levels = rng.choice(["1", "4", "1,4", "5", "1,8"])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = tmp_path / f"run{seed}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(base), mechanism, levels], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed = 0
    deadline = time.monotonic() + 60
    want = rng.randint(1, 6)  # kill after this many commits, at a random moment after it
    while committed < want and time.monotonic() < deadline:
        words = proc.stdout.readline().split()
        if not words:
            break
        committed = int(words[1])
    time.sleep(rng.uniform(0, 0.08))
    os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    for line in out.splitlines():  # the last line may be cut short by the kill
        words = line.split()
        if len(words) == 2 and words[0] == "committed" and words[1].isdigit():
            committed = max(committed, int(words[1]))
    assert committed >= 1, f"the child committed nothing: {err[-2000:]}"
    ctx = ftidask.init(exec_id="crash", enable_dcp=1, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"),
                       meta_dir=str(base / "Meta"))
    a, b = np.full(1 << 20, -5.0), np.full(300_000, -5, np.int32)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.recover()
    got = int(a[0])
    assert got >= committed, f"recovered {got}, but {committed} was committed (seed {seed})"
    assert (a == got).all() and (b == got).all(), f"a mix of states recovered (seed {seed})"
    ctx._close()


@pytest.mark.parametrize("seed", range(8))
def test_sigkill_in_flight(tmp_path, seed):
    _run_once(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(8, 58), 12))
def test_sigkill_in_flight_50_runs(tmp_path, seed):
    _run_once(tmp_path, seed)
