"""What one recovery call leaves for the next one of the same restart (found by a review):

- ``stored_size()`` (FTI's order: sizes first) then ``recover_file(other run's file)`` then ``recover()`` loaded the
  other file again and said it recovered the run's newest checkpoint (with dCP: a partial load of the wrong file);
- a ``recover(ckpt_id=...)``, ``recover(level=...)`` or ``recover_var(id, ckpt_id)`` refused (a read-only array, a
  size) made every later plain ``recover()``/``recover_var(id)``/``snapshot()`` load that older checkpoint, or
  refuse for ever with its error;
- ``realloc(id)`` of an unprotected id took the stored name even when another protected id had it since.
A plain recovery loads the newest committed checkpoint that verifies, from its own files, whatever came before it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import ProtectError, RecoveryError


def _dirs(base, **kw):
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 4,
            **kw}


def _crashed_run(base, sizes=(10, 10), **kw) -> None:
    """Checkpoint 1 (L4) holds 1.0 (``sizes[0]`` items, named "temp"), checkpoint 2 (L1) 2.0 (``sizes[1]``); then
    the process dies without finalize."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ctx = ftidask.init(**_dirs(base, **kw))
            a = np.ones(sizes[0])
            ctx.protect(1, a, name="temp")
            ctx.checkpoint(1, 4)
            a = np.full(sizes[1], 2.0)
            ctx.protect(1, a, name="temp")
            ctx.checkpoint(2, 1)
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def _other_file(base) -> str:
    """A file of another run holding 7.0 for variable 1."""
    ctx = ftidask.init(**_dirs(base, keep_last_ckpt=1))
    ctx.protect(1, np.full(10, 7.0))
    ctx.checkpoint(1, 4)
    ctx.finalize()
    (path,) = (base / "G").rglob("Ckpt1-Rank0.fti")
    return str(path)


@pytest.mark.parametrize("dcp", [0, 1])
def test_recover_after_stored_size_and_recover_file_loads_the_runs_own_newest(tmp_path, dcp):
    _crashed_run(tmp_path / "run", enable_dcp=dcp)
    other = _other_file(tmp_path / "other")
    ctx = ftidask.init(**_dirs(tmp_path / "run", enable_dcp=dcp))
    assert ctx.status() == 1
    a = np.zeros(10)
    ctx.protect(1, a, name="temp")
    assert ctx.stored_size(1) == 80
    ctx.recover_file(other)
    assert (a == 7.0).all()
    a[:] = 0
    ctx.recover()
    assert (a == 2.0).all() and ctx.recovered_from == (2, 1)
    ctx.finalize()


def test_a_refused_recover_of_an_older_checkpoint_leaves_the_newest_to_a_plain_recover(tmp_path):
    _crashed_run(tmp_path)
    ctx = ftidask.init(**_dirs(tmp_path))
    frozen = np.zeros(10)
    frozen.flags.writeable = False
    ctx.protect(1, frozen, name="temp")
    with pytest.raises(RecoveryError):
        ctx.recover(1, 4)
    a = np.zeros(10)
    ctx.protect(1, a, name="temp")
    ctx.recover()
    assert (a == 2.0).all() and ctx.recovered_from == (2, 1)
    ctx.finalize()


def test_an_older_checkpoint_refused_for_its_size_does_not_refuse_the_newest(tmp_path):
    _crashed_run(tmp_path, sizes=(10, 20))
    ctx = ftidask.init(**_dirs(tmp_path))
    a = np.zeros(20)
    ctx.protect(1, a, name="temp")
    with pytest.raises(RecoveryError):
        ctx.recover(1, 4)
    assert ctx.stored_size(1) == 80  # the refused one's size, for a realloc before recover(1, 4) again
    ctx.recover()
    assert (a == 2.0).all() and ctx.recovered_from == (2, 1)
    ctx.finalize()


def test_recover_var_after_a_refused_older_one_loads_the_newest(tmp_path):
    _crashed_run(tmp_path, sizes=(10, 20))
    ctx = ftidask.init(**_dirs(tmp_path))
    a = np.zeros(20)
    ctx.protect(1, a, name="temp")
    with pytest.raises(RecoveryError):
        ctx.recover_var(1, 1)
    ctx.recover_var(1)
    assert (a == 2.0).all()
    ctx.finalize()


def test_snapshot_after_a_refused_older_recover_loads_the_newest(tmp_path):
    _crashed_run(tmp_path, sizes=(10, 20))
    ctx = ftidask.init(**_dirs(tmp_path, ckpt_l1=1, snapshot_unit="iterations"))
    a = np.zeros(20)
    ctx.protect(1, a, name="temp")
    with pytest.raises(RecoveryError):
        ctx.recover(level=4)
    ctx.snapshot()  # a restart's snapshot() recovers
    assert (a == 2.0).all() and ctx.recovered_from == (2, 1)
    ctx.finalize()


def test_realloc_of_an_id_whose_stored_name_another_id_has_now_is_refused(tmp_path):
    _crashed_run(tmp_path)
    ctx = ftidask.init(**_dirs(tmp_path))
    b = np.zeros(3)
    ctx.protect(2, b, name="temp")
    with pytest.raises(ProtectError, match="temp"):
        ctx.realloc(1)
    assert 1 not in ctx.protected
    ctx.finalize()


@pytest.mark.parametrize("async_ckpt", [0, 1])
def test_a_checkpoint_committed_on_a_restart_ends_it_for_snapshot(tmp_path, async_ckpt):
    """A restart that checkpoints its own state before its first snapshot() (as the docs say: a checkpoint committed
    since ends the restart): snapshot() recovered that checkpoint all the same, rolling back what the program did
    after it (asynchronous: the checkpoint was still in flight)."""
    _crashed_run(tmp_path, sizes=(10, 10))
    ctx = ftidask.init(**_dirs(tmp_path, ckpt_l1=100, snapshot_unit="iterations", async_ckpt=async_ckpt))
    a = np.full(10, 42.0)
    ctx.protect(1, a, name="temp")
    ctx.checkpoint(10, 1)
    a[:] = 43.0
    assert ctx.snapshot() == ftidask.FTI_SCES
    assert (a == 43.0).all() and ctx.recovered_from is None and ctx.status() == 0
    ctx.finalize()
