"""A finished run started again under its exec_id (a fresh start): its checkpoints never take the directory
names of the finished run's, which keep_l4_ckpt leaves in l4_archive (found by a random-crash campaign)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import diskfull
import numpy as np
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths


def _dirs(base: Path) -> dict:
    return dict(ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                verbosity=4)


def _archived(base: Path) -> dict[str, bytes]:
    archive = base / "Global" / "again" / "l4_archive"
    return {str(p.relative_to(archive)): p.read_bytes() for p in sorted(find_paths(archive, "*.fti"))}


def _run(base: Path, value: float) -> None:
    ctx = ftidask.init(exec_id="again", keep_l4_ckpt=1, **_dirs(base))
    assert ctx.status() == 0  # finished without keep_last_ckpt: a fresh start
    a = np.full(1000, value)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    ctx.checkpoint(2, 4)
    ctx.finalize()


def test_finalized_run_with_an_l4_archive_runs_again(tmp_path):
    _run(tmp_path, 1.0)
    first = _archived(tmp_path)
    assert len(first) == 2
    _run(tmp_path, 2.0)  # its finalize archives checkpoints 1 and 2 again, beside the first run's
    again = _archived(tmp_path)
    assert len(again) == 4
    assert {k: again[k] for k in first} == first  # the first run's archive is untouched


KILLED_FINALIZE = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(exec_id="again", keep_l4_ckpt=1, ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global",
                   meta_dir=sys.argv[1] + "/Meta", verbosity=4)
a = np.full(1000, 1.0)
ctx.protect(1, a)
ctx.checkpoint(1, 4)
ctx.checkpoint(2, 4)
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "delete_record", 2, after=True)
ctx.finalize()   # killed once both checkpoints are archived, before the run is marked finalized
"""


def test_run_killed_in_finalize_after_archiving_runs_again(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_FINALIZE, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    first = _archived(tmp_path)
    assert len(first) == 2  # no commit record left: the next start is a fresh one
    _run(tmp_path, 2.0)
    again = _archived(tmp_path)
    assert len(again) == 4
    assert {k: again[k] for k in first} == first


def test_finalize_on_a_full_disk_still_ends_the_run(tmp_path):
    """The mark of the sequence numbers used is written before anything is removed: on a full disk it cannot be,
    and finalize goes on (removing the checkpoints frees the space that marks the run finalized, with the mark)."""
    with diskfull.tmpfs(tmp_path / "fs", "8m") as fs:
        kw = dict(_dirs(fs), exec_id="again")
        ctx = ftidask.init(**kw)
        a = np.full(100_000, 1.0)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        ctx.checkpoint(2, 4)
        diskfull.fill(fs)
        ctx.finalize()
        (fs / "filler").unlink()
        assert json.loads((fs / "Meta" / "again" / "run.json").read_text())["seq"] == 2
        ctx = ftidask.init(**kw)
        assert ctx.status() == 0
        ctx.protect(1, a)
        assert ctx.checkpoint(1, 4).seq == 3  # after the finished run's
        ctx.finalize()
