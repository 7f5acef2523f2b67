"""SIGKILL at a random time, twice in a row: each restart recovers a checkpoint whose commit completed, bit for bit.

A child process checkpoints in a loop and, AFTER each ``checkpoint()`` returns, appends the id to a side file
(fsynced): the newest committed checkpoint is at least that one. It is killed at a random moment, restarted (it
recovers, checks what it got against the state of that step, notes it, and checkpoints on with the ids that
follow), killed again, and a last restart in the test recovers. Every recovery must be exact (never a mix of
states) and never older than the last id noted before it (never nothing). Unlike test_crash.py, the restarted
run's own checkpoints are killed too: the first checkpoints after a recovery, whose ids continue.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from campaign import kept
from conftest import ROOT

import ftidask

CHILD = r"""
import json, os, sys
import numpy as np
import ftidask

root, cfg = sys.argv[1], json.loads(sys.argv[2])
levels, wait = cfg.pop("levels"), cfg.pop("wait")
side = open(os.path.join(root, "side.log"), "a")

def note(*words):
    side.write(" ".join(map(str, words)) + "\n"); side.flush(); os.fsync(side.fileno())

def values(step):
    rng = np.random.default_rng(step)
    return rng.integers(-1000, 1000, 300_000).astype(np.float64), rng.integers(0, 99, 70_001).astype(np.int32)

ctx = ftidask.init(ckpt_dir=root + "/L", glbl_dir=root + "/G", meta_dir=root + "/M", verbosity=4, **cfg)
a, b, step = np.zeros(300_000), np.zeros(70_001, np.int32), np.zeros(1, np.int64)
state = ftidask.State({"step": 0})
for vid, x in enumerate((a, b, step, state)):
    ctx.protect(vid + 1, x)
if ctx.status() != 0:
    ctx.recover()
    s = int(step[0])
    want = values(s)
    exact = a.tobytes() == want[0].tobytes() and b.tobytes() == want[1].tobytes() and state["step"] == s
    note("R", s, "exact" if exact else "MIX")
pending = None
while True:
    s = int(step[0]) + 1
    a[:], b[:] = values(s)
    step[0] = state["step"] = s
    handle = ctx.checkpoint(s, levels[s % len(levels)], wait=wait)
    if not wait:
        a[:] = -1.0  # the checkpoint holds the values of the call
        if pending is not None:
            note("C", pending[0], pending[1].result().id)
        pending = (s, handle)
        a[:], b[:] = values(s)
    else:
        note("C", s, handle.id)
"""

CONFIGS = {
    "l1-l4": dict(levels=[1, 1, 4]),
    "keep-l4": dict(levels=[4, 1], keep_l4_ckpt=1),
    "dcp": dict(levels=[5, 5, 8, 1], enable_dcp=1, dcp_block_size=4096),
    "async": dict(levels=[1, 4], wait=False),
    "async-dcp": dict(levels=[5, 8], wait=False, enable_dcp=1, async_snapshot="copy"),
}


def _side(root: Path) -> list[list[str]]:
    path = root / "side.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _kill_after_commit(root: Path, config: dict, rng: random.Random) -> None:
    """Run the child until it notes a new commit, then SIGKILL it after a random delay."""
    import json

    before = sum(w[0] == "C" for w in _side(root))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), json.dumps(config)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while sum(w[0] == "C" for w in _side(root)) == before:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.25))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _check(lines: list[list[str]]) -> int:
    """Every recovery exact and at least the last commit noted before it; the last commit noted."""
    last = 0
    for words in lines:
        if words[0] == "C" and len(words) == 3:  # a line cut by the kill has fewer words
            last = max(last, int(words[1]))
        elif words[0] == "R" and len(words) == 3:
            assert words[2] == "exact", f"a mix of states recovered: {words}"
            assert int(words[1]) >= last, f"recovered {words[1]}, but {last} was committed"
            last = int(words[1])
    return last


def _run(tmp_path: Path, name: str, seed: int) -> None:
    config = {"wait": True, **CONFIGS[name]}
    rng = random.Random(seed)
    for _crash in range(2):  # killed, restarted (recovers, checkpoints on), killed again
        _kill_after_commit(tmp_path, config, rng)
    last = _check(_side(tmp_path))
    kw = {k: v for k, v in config.items() if k not in ("levels", "wait")}
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4, **kw)
    a, b, step = np.zeros(300_000), np.zeros(70_001, np.int32), np.zeros(1, np.int64)
    state = ftidask.State({"step": -1})
    for vid, x in enumerate((a, b, step, state)):
        ctx.protect(vid + 1, x)
    assert ctx.status() == 1
    ctx.recover()
    s = int(step[0])
    assert s >= last and state["step"] == s, (s, last)
    want = np.random.default_rng(s)
    assert a.tobytes() == want.integers(-1000, 1000, 300_000).astype(np.float64).tobytes()
    assert b.tobytes() == want.integers(0, 99, 70_001).astype(np.int32).tobytes()
    ctx.finalize()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_killed_twice_at_random_times(tmp_path, name):
    _run(tmp_path, name, seed=sum(map(ord, name)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 11), 5))  # the others: -m campaign (CI's budget)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_killed_twice_at_random_times_many_seeds(tmp_path, name, seed):
    _run(tmp_path, name, seed)
