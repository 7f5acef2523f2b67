"""Smaller things a new user meets: what finalize leaves on disk, what the resilient loop says on a
restart, the demo cleaning up after itself."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths


def _empty_dirs(root: Path) -> list[Path]:
    return [Path(d) for d, subdirs, files in os.walk(root) if not subdirs and not files]


def test_finalize_leaves_no_empty_run_directories(dirs, tmp_path):
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(1000.0))
    for ckpt_id, level in ((1, 1), (2, 4), (3, 1)):
        ctx.checkpoint(ckpt_id, level)
    ctx.finalize()
    leftover = [p for p in find_paths(tmp_path, "*") if ctx.exec_id in p.parts and "Meta" not in p.parts]
    assert leftover == [], leftover
    assert all(p in (tmp_path / "Local" / "node0", tmp_path / "Global") for p in _empty_dirs(tmp_path)), \
        _empty_dirs(tmp_path)
    assert (tmp_path / "Meta" / ctx.exec_id / "run.json").is_file()  # the run's state stays


def test_finalize_keeping_the_last_checkpoint_prunes_only_empty_dirs(dirs, tmp_path):
    ctx = ftidask.init(**dirs, keep_last_ckpt=1)
    ctx.protect(1, np.arange(1000.0))
    ctx.checkpoint(1, 1)
    ctx.finalize()
    assert len(list(find_paths(Path(dirs["glbl_dir"]), "Ckpt*-Rank0.fti"))) == 1
    assert not any(ctx.exec_id in p.parts for p in _empty_dirs(tmp_path))
    again = ftidask.init(**dirs, keep_last_ckpt=1)  # status 2: restart from the kept L4 checkpoint
    again.protect(1, out := np.zeros(1000))
    again.recover()
    assert np.array_equal(out, np.arange(1000.0))
    again._close()


def test_finalize_keeping_the_last_checkpoint_removes_the_older_ones(dirs, tmp_path):
    ctx = ftidask.init(**dirs, keep_last_ckpt=1)
    ctx.protect(1, a := np.arange(1000.0))
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 1)  # after a level-4 one: both committed until finalize
    ctx.finalize()
    names = sorted(p.parent.name for p in find_paths(tmp_path, "Ckpt*-Rank0.fti"))
    assert names and all(name.startswith("ckpt2.") for name in names), names  # checkpoint 1 is gone, as in FTI
    again = ftidask.init(**dirs, keep_last_ckpt=1)
    again.protect(1, out := np.zeros(1000))
    again.recover()
    assert np.array_equal(out, np.arange(1000.0) + 1) and again.recovered_from[0] == 2
    again._close()


def test_resilient_loop_says_where_it_restarted(dirs, caplog):
    caplog.set_level(logging.INFO, logger="ftidask")  # the default verbosity keeps a level set before
    dirs = {k: v for k, v in dirs.items() if k != "verbosity"}
    u = np.zeros(4)
    ctx = ftidask.init(**dirs)
    with ftidask.ResilientLoop(ctx, arrays={1: u}, every=10, level=1, iterations=25) as loop:
        for i in loop:
            u += 1
            if i == 14:
                break  # dies after the checkpoint at iteration 10
    ctx._close()
    ctx = ftidask.init(**dirs)
    with ftidask.ResilientLoop(ctx, arrays={1: u}, every=10, level=1, iterations=25) as loop:
        assert loop.start == 10
    assert "restart: recovered checkpoint 10 (level 1), resuming at iteration 10" in caplog.text
    ctx.finalize()


def test_demo_says_where_its_files_are_and_removes_them(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "heat_demo.py")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical bit for bit: True" in proc.stdout
    removed = re.search(r"removed the demo's files \((.+)\)", proc.stdout)
    assert removed and not Path(removed.group(1)).exists(), proc.stdout
    assert list(tmp_path.iterdir()) == []  # the reference run's directory is gone too
    kept = tmp_path / "kept"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "heat_demo.py"), "--workdir", str(kept)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and f"the demo's files are in {kept}" in proc.stdout, proc.stdout + proc.stderr
    assert (kept / "result.npy").is_file()
