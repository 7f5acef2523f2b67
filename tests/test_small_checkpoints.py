"""A small state checkpointed often pays the fixed costs of a commit only (docs/performance.md): the checkpoint it
retires is deleted at once, not by a thread, and the garbage collection that follows looks only where the checkpoint
wrote unless something else may have left garbage (engine/collecting.py). Leftovers are still removed: those of a
failed checkpoint whose clean-up failed, at the next checkpoint; those of a checkpoint killed after its file was
renamed into place, before it was durable and before its commit record, at the next start; those planted by another
process, within FULL_EVERY checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import crashpoints
import numpy as np
import pytest
from conftest import ROOT
from test_crash_campaign import assert_no_leftovers

import ftidask
from ftidask.engine import collecting
from ftidask.engine.runstate import RunState
from ftidask.storage import files as storage
from ftidask.storage import removal


def _init(root: Path, **kw):
    return ftidask.init(ckpt_dir=str(root / "L"), glbl_dir=str(root / "G"), meta_dir=str(root / "M"), verbosity=4,
                        exec_id="small", **kw)


def _dirs(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_dir())


@pytest.fixture
def roots_seen(monkeypatch) -> list[Path]:
    """Every directory a garbage collection looks into (its roots), in order: counted, then collected as ever."""
    seen: list[Path] = []
    real = removal.collect_level_garbage

    def counting(root, *args, **kwargs):
        seen.append(Path(root))
        return real(root, *args, **kwargs)

    monkeypatch.setattr(storage, "collect_level_garbage", counting)
    return seen


def test_a_small_retired_checkpoint_is_gone_when_the_next_returns_and_no_thread_deleted_it(tmp_path):
    a = np.arange(512.0)
    ctx = _init(tmp_path)
    ctx.protect(1, a)
    for i in range(1, 6):
        a[0] = i
        ctx.checkpoint(i, 1)
        assert [p.name for p in _dirs(tmp_path / "L", "node0/small/l1/*")] == [f"ckpt{i}.s{i}"]
    assert ctx._retention.trash_pool is None  # never started: nothing was handed to it
    ctx.finalize()


def test_a_checkpoint_after_one_that_succeeded_looks_only_at_its_own_level(tmp_path, roots_seen):
    a = np.arange(512.0)
    ctx = _init(tmp_path)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx.checkpoint(2, 1)
    roots_seen.clear()
    for i in range(3, 3 + collecting.FULL_EVERY):
        ctx.checkpoint(i, 1)
    l1 = tmp_path / "L" / "node0" / "small" / "l1"
    # one full collection (every FULL_EVERY-th, whatever happened): seven directories; the others the L1 one only
    assert len(roots_seen) == collecting.FULL_EVERY - 1 + 7
    assert roots_seen.count(l1) == collecting.FULL_EVERY
    ctx.finalize()


def test_garbage_planted_by_another_process_is_removed_within_full_every_checkpoints(tmp_path):
    a = np.arange(512.0)
    ctx = _init(tmp_path)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx.checkpoint(2, 1)
    planted = tmp_path / "L" / "node0" / "small" / "l2" / "ckpt77.s77"  # at a level this run does not write
    planted.mkdir(parents=True)
    (planted / "Ckpt77-Rank0.fti").write_bytes(b"another process's")
    record_tmp = tmp_path / "M" / "small" / "commits" / ".s00000099.json.tmp-1"
    record_tmp.write_bytes(b"torn")
    for i in range(3, 3 + collecting.FULL_EVERY):
        ctx.checkpoint(i, 1)
    assert not planted.exists() and not record_tmp.exists()
    ctx.finalize()


def test_a_failed_checkpoint_whose_clean_up_failed_is_collected_by_the_next_one_everywhere(tmp_path):
    """The commit record of an L4 checkpoint cannot be written and its clean-up cannot remove its directory: the
    next checkpoint, at L1 (whose light collection would look at l1 only), removes it, as every checkpoint did
    before; the previous checkpoint is recovered in between."""
    a = np.arange(4096.0)
    ctx = _init(tmp_path)
    ctx.protect(1, a)
    for i in (1, 2, 3):
        a[:] = i
        ctx.checkpoint(i, 1)
    crashpoints.kill_at_call(RunState, "write_record", 1, fail=True)  # this process's class: put back below
    crashpoints.kill_at_call(storage, "remove_tree", 1, fail=True)  # the failed checkpoint's clean-up (drop)
    try:
        a[:] = 4
        with pytest.raises(ftidask.CheckpointError):
            ctx.checkpoint(4, 4)
    finally:
        RunState.write_record = RunState.write_record.__wrapped__
        storage.remove_tree = storage.remove_tree.__wrapped__
    left = _dirs(tmp_path / "G", "small/l4/ckpt4.s*")
    assert left and any(p.name == "Ckpt4-Rank0.fti" for p in left[0].iterdir())  # the file of the failed one
    a[:] = 0
    ctx.recover()
    assert (a == 3).all()
    a[:] = 5
    ctx.checkpoint(5, 1)
    assert not any(p.exists() for p in left)
    a[:] = 0
    ctx.recover()
    assert (a == 5).all()
    ctx.finalize()
    assert_no_leftovers(tmp_path, {}, "after a failed checkpoint")


KILLED_AFTER_RENAME = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(ckpt_dir=sys.argv[1] + "/L", glbl_dir=sys.argv[1] + "/G", meta_dir=sys.argv[1] + "/M",
                   verbosity=4, exec_id="small")
a = np.zeros(512)
ctx.protect(1, a)
for i in range(1, 6):  # light collections from the third on
    a[:] = i
    ctx.checkpoint(i, 1)
from ftidask.storage import files
crashpoints.kill_at_call(files, "_sync_at_once", 1)  # the file renamed into place, not yet durable, no record
a[:] = 6
ctx.checkpoint(6, 1)
"""


def test_a_checkpoint_killed_once_its_file_is_renamed_before_it_is_durable_recovers_the_previous(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_RENAME, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = _dirs(tmp_path / "L", "node0/small/l1/ckpt6.s*")
    assert killed and (killed[0] / "Ckpt6-Rank0.fti").is_file()  # at its name, named by no record
    a = np.zeros(512)
    ctx = _init(tmp_path)
    ctx.protect(1, a)
    assert not killed[0].exists()  # the start's collection
    ctx.recover()
    assert (a == 5).all()
    a[:] = 7
    ctx.checkpoint(7, 1)
    ctx.finalize()
    assert_no_leftovers(tmp_path, {}, "after a kill between the rename and the fsync")
