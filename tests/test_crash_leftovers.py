"""Leftovers found by the crash campaign (test_crash_campaign.py): a checkpoint's files that no restart ever removed.

A checkpoint interrupted before its commit record is never recovered, and its files are removed at the next start
(docs/guide.md): whichever run that start begins, and on every node the run had, even those a restart on fewer ranks
no longer has; a finalize killed part-way leaves a run whose next start removes the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from mpi_util import need_mpi
from test_crash_campaign import assert_no_leftovers, expected, lines, mpi_job

import ftidask
from ftidask.storage.files import find_paths

FIRST_KILLED = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(ckpt_dir=sys.argv[1] + "/L", glbl_dir=sys.argv[1] + "/G", meta_dir=sys.argv[1] + "/M",
                   verbosity=4, enable_dcp=int(sys.argv[4]))
a = np.arange(300_000, dtype=np.float64)
ctx.protect(1, a)
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "write_record", 1)   # its file whole, no commit record
ctx.checkpoint(1, int(sys.argv[3]))
"""


@pytest.mark.parametrize("level", [1, 4, 5, 8])
def test_a_run_killed_before_its_first_commit_leaves_nothing_once_the_next_run_is_over(tmp_path, level):
    """A checkpoint interrupted before its commit record is never recovered, and its files are removed at the next
    start (docs/guide.md). A run killed during its FIRST checkpoint has nothing to restart: the next init started a
    new run (a new exec_id) and nothing ever removed the dead run's rank file (the size of the state, in glbl_dir
    at L4) nor its directories: each such kill leaked a checkpoint for good."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FIRST_KILLED, str(tmp_path), str(ROOT / "tests"), str(level),
                           str(int(level > 4))], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name == "Ckpt1-Rank0.fti" for p in find_paths(tmp_path, "*")), "the kill came before the file was written"
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4, enable_dcp=int(level > 4))
    a = np.zeros(300_000)
    ctx.protect(1, a)
    assert ctx.status() == 0
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    a[:] = 7.0
    ctx.checkpoint(2, level)
    ctx.finalize()
    assert_no_leftovers(tmp_path, {}, f"level {level}")


FINALIZE_KILLED = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(ckpt_dir=sys.argv[1] + "/L", glbl_dir=sys.argv[1] + "/G", meta_dir=sys.argv[1] + "/M",
                   verbosity=4, enable_dcp=1, dcp_block_size=4096)
a = np.zeros(300_000)
ctx.protect(1, a)
for ckpt_id, level in ((1, 8), (2, 8), (3, 4), (4, 5)):
    a[:] = ckpt_id
    ctx.checkpoint(ckpt_id, level)
crashpoints.install(sys.argv[3])
ctx.finalize()
"""


@pytest.mark.parametrize("point", ["ftidask.engine.dcpstore:DcpStore.clear", "ftidask.storage.removal:remove_tree",
                                   "ftidask.storage.removal:remove_tree:after"])
def test_a_finalize_killed_while_it_removes_leaves_nothing_once_the_next_run_is_over(tmp_path, point):
    """finalize marked the run finalized, then cleared the differential checkpoints' spares, and its remover thread
    deleted the trash (the checkpoints moved out of the way) while the context closed. Killed after the mark, the run
    was over: the next init started a new run, and the spares and the trash (whole checkpoints) stayed for good.
    The mark now comes last: killed before it, the run has no commit record left, and the next init starts it
    afresh, under its name, removing what it left."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FINALIZE_KILLED, str(tmp_path), str(ROOT / "tests"), point],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    want, status = expected(tmp_path)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4, enable_dcp=1, dcp_block_size=4096)
    a = np.zeros(300_000)
    ctx.protect(1, a)
    assert ctx.status() == status
    if want is not None:
        ctx.recover()
        assert ctx.recovered_from[0] == want and (a == want).all()
    ctx.finalize()
    assert_no_leftovers(tmp_path, {}, point)


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=need_mpi())])
def test_a_checkpoint_killed_before_its_commit_on_more_ranks_leaves_nothing_after_a_restart_on_fewer(tmp_path, ranks):
    """4 ranks on 4 nodes, killed once every rank file of checkpoint 2 is written, before its commit record. The
    restart on 2 ranks removes the interrupted checkpoint's files on its own nodes (0 and 1) at its start; those on
    nodes 2 and 3, which no rank of it has, stayed for good (rank 0 removes the retired checkpoints' files on the
    nodes the run no longer has, and now their garbage too)."""
    spec = dict(mode="sync", levels=[1], steps=2, finalize=False, cfg={},
                point=[0, "ftidask.engine.runstate:RunState.write_record", 2])
    proc = mpi_job(4, tmp_path, spec, {})
    assert "C 1" in proc.stdout and "C 2" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(find_paths(tmp_path, "Ckpt2-Rank*.fti"))) == 4
    assert expected(tmp_path) == (1, 1)
    proc = mpi_job(ranks, tmp_path, dict(mode="verify", levels=[1], cfg={}), {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines(proc, "R")[0][1:3] == ["1", "exact"], proc.stdout
    assert_no_leftovers(tmp_path, {}, f"restarted on {ranks} ranks")
