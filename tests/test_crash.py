"""A process killed (SIGKILL) in the middle of a checkpoint: the next run recovers the previous one."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths

CHILD = r"""
import sys, numpy as np, ftidask
dirs = dict(ckpt_dir=sys.argv[1] + '/Local', glbl_dir=sys.argv[1] + '/Global', meta_dir=sys.argv[1] + '/Meta',
            verbosity=3)
ctx = ftidask.init(**dirs)
arrays = [np.zeros(4_000_000), np.zeros(3_000_000, np.int32)]
for vid, a in enumerate(arrays):
    ctx.protect(vid + 1, a)
for i in range(1, 100000):
    for a in arrays:
        a[:] = i
    ctx.checkpoint(i, 4 if i % 3 == 0 else 1)
    print(i, flush=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.29, 0.41, 0.77])
def test_sigkill_mid_checkpoint(tmp_path, delay):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env)
    # Wait for at least one committed checkpoint, then kill at a point that varies with `delay`.
    first = proc.stdout.readline()
    assert first.strip() == "1", first
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    dirs = dict(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                meta_dir=str(tmp_path / "Meta"), verbosity=3)
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    a, b = np.full(4_000_000, -1.0), np.full(3_000_000, -1, np.int32)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.recover()
    ckpt_id, _level = ctx.recovered_from
    assert (a == ckpt_id).all() and (b == ckpt_id).all()
    # The run continues: a new checkpoint commits and the stale temporary files do not get in the way.
    ctx.checkpoint(ckpt_id + 1000, 1)
    leftovers = find_paths(tmp_path, ".*.tmp-*")  # not rglob: the retired checkpoint is deleted meanwhile
    leftovers += [p for p in find_paths(tmp_path, "ckpt*.s*") if p.is_dir()
                  and not (tmp_path / "Meta" / ctx.exec_id / "commits" / f"s{int(p.name.split('.s')[1]):08d}.json").exists()]
    ctx2 = ftidask.init(**dirs)
    ctx2.protect(1, a)
    ctx2.protect(2, b)
    ctx2.recover()
    assert ctx2.recovered_from[0] == ckpt_id + 1000
    assert leftovers == []


FINALIZE_CHILD = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
dirs = dict(ckpt_dir=sys.argv[1] + '/Local', glbl_dir=sys.argv[1] + '/Global', meta_dir=sys.argv[1] + '/Meta',
            verbosity=4)
ctx = ftidask.init(**dirs)
a = np.zeros(100_000)
ctx.protect(1, a)
for ckpt_id, level in ((1, 4), (2, 1)):   # the L1 checkpoint does not retire the older L4 one
    a[:] = ckpt_id
    ctx.checkpoint(ckpt_id, level)
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "delete_record", 1, after=True)
ctx.finalize()   # killed once it has removed the first checkpoint's commit record
"""


def test_sigkill_in_finalize_keeps_the_newest_checkpoint(tmp_path):
    """finalize removes the run's checkpoints oldest first: a process killed part-way leaves the newest one
    recoverable, never only an older one (the restart would silently go back further than its last checkpoint)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FINALIZE_CHILD, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), verbosity=4)
    assert ctx.status() == 1
    a = np.full(100_000, -1.0)
    ctx.protect(1, a)
    ctx.recover()
    assert ctx.recovered_from == (2, 1) and (a == 2).all()
    ctx.finalize()
