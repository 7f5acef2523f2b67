"""Incremental checkpointing: variables added one at a time, committed at the end."""

from __future__ import annotations

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import CheckpointError, ProtectError
from ftidask.storage.files import find_paths


def _kw(root, **extra):
    kw = dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=3,
              enable_dcp=1, dcp_block_size=1024)
    kw.update(extra)
    return kw


def _recover(root, like):
    ctx = ftidask.init(**_kw(root))
    out = {vid: np.zeros_like(a) for vid, a in like.items()}
    for vid, arr in out.items():
        ctx.protect(vid, arr)
    ctx.recover()
    ctx._closed = True
    return out


@pytest.mark.parametrize("level", [1, 4, 5, 8])
def test_each_variable_is_saved_as_it_was_when_added(tmp_path, level):
    ctx = ftidask.init(**_kw(tmp_path))
    a, b, c = np.arange(5000.0), np.arange(300, dtype=np.int16), np.ones((40, 50), np.float32, order="F")
    for vid, arr in ((1, a), (2, b), (3, c)):
        ctx.protect(vid, arr)
    for ckpt in (1, 2):
        ctx.init_icp(ckpt, level)
        ctx.add_var_icp(3)  # any order
        c[:] = -ckpt  # changes after the add are not in this checkpoint
        want_c = np.ones_like(c) if ckpt == 1 else np.full_like(c, -1)
        ctx.add_var_icp(1)
        saved_a = a.copy()
        a[:10] = 99
        ctx.add_var_icp(2)
        info = ctx.finalize_icp()
        assert info.id == ckpt and info.level == level
    got = _recover(tmp_path, {1: a, 2: b, 3: c})
    assert got[1].tobytes() == saved_a.tobytes()
    assert got[2].tobytes() == b.tobytes()
    assert got[3].tobytes() == want_c.tobytes()


@pytest.mark.parametrize("level", [1, 5])
def test_missing_variable_is_refused_and_previous_kept(tmp_path, level):
    ctx = ftidask.init(**_kw(tmp_path))
    a, b = np.arange(100.0), np.arange(50.0)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, level)
    ctx.checkpoint(1, level)  # at level 5, the first file is now the spare that iCP patches
    saved = {1: a.copy(), 2: b.copy()}
    a[:] = 7
    ctx.init_icp(2, level)
    ctx.add_var_icp(1)
    with pytest.raises(CheckpointError, match=r"misses protected variables \[2\] never added"):
        ctx.finalize_icp()
    got = _recover(tmp_path, saved)
    assert all(got[v].tobytes() == saved[v].tobytes() for v in saved)
    assert not find_paths(tmp_path / "l", "Ckpt2-*")
    info = ctx.checkpoint(3, level)  # the context goes on normally
    assert _recover(tmp_path, saved)[1].tobytes() == a.tobytes()
    assert info.blocks_changed in (None, info.blocks_total)  # the torn spare is rewritten in full


def test_context_manager_and_misuse(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(1000, dtype=np.int64)
    ctx.protect(7, a)
    with pytest.raises(CheckpointError, match="no incremental checkpoint"):
        ctx.add_var_icp(7)
    with ctx.incremental(1, 5) as icp:
        with pytest.raises(ProtectError):
            icp.add(8)
        icp.add(7)
        with pytest.raises(CheckpointError, match="already added"):
            icp.add(7)
        with pytest.raises(CheckpointError, match="is open"):
            ctx.checkpoint(9, 1)
    assert icp.info is not None and icp.info.blocks_total == 8
    a[0] = -1
    with pytest.raises(RuntimeError), ctx.incremental(2, 5) as icp2:
        icp2.add(7)
        raise RuntimeError("application failed mid-checkpoint")
    assert ctx._icp_slot.current is None
    got = _recover(tmp_path, {7: a})
    assert got[7][0] == 0  # checkpoint 2 was dropped; checkpoint 1 stays
    info = ctx.checkpoint(3, 5)
    assert info.blocks_changed >= 1


def test_size_change_during_icp_is_refused(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.zeros(10))
    ctx.init_icp(1, 1)
    ctx.protect(1, np.zeros(20))
    with pytest.raises(CheckpointError, match="size must not change"):
        ctx.add_var_icp(1)


def test_no_collaborator_holds_the_context(dirs):
    """An unfinalized context (a crashed program's) is freed as soon as it is dropped, without waiting
    for the cycle collector: its run lock is released at once, so a restart in the same process
    resumes the same run (a reference cycle through a collaborator once kept it locked)."""
    import gc
    import weakref

    gc.disable()
    try:
        ctx = ftidask.init(async_ckpt=0, **dirs)
        ctx.protect(1, np.arange(10.0))
        ctx.checkpoint(1, 1)
        ctx.checkpoint(2, 1, wait=False).wait()
        with ctx.incremental(3, 1) as icp:
            icp.add(1)
        exec_id, gone = ctx.exec_id, weakref.ref(ctx)
        del ctx, icp
        assert gone() is None
        again = ftidask.init(**dirs)
        assert again.exec_id == exec_id and again.status() != 0
        again._close()
    finally:
        gc.enable()


@pytest.mark.parametrize("level", [1, 5])
def test_init_icp_not_activated_makes_add_and_finalize_do_nothing(tmp_path, level):
    """FTI_InitICP(id, level, activate): FTI's loops call the three every iteration with ``activate`` true only
    when a checkpoint is due; otherwise FTI_AddVarICP and FTI_FinalizeICP return FTI_SCES and write nothing."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(2000.0)
    ctx.protect(1, a)
    for it in range(6):
        a[:] = it
        ctx.init_icp(it // 3 + 1, level, it % 3 == 0)
        ctx.add_var_icp(1)
        info = ctx.finalize_icp()
        assert (info is None) == (it % 3 != 0)
        if it % 3 == 1:  # nothing is open: an ordinary checkpoint may run between them
            assert ctx.checkpoint(10 + it, level).id == 10 + it
    assert _recover(tmp_path, {1: a})[1][0] == 4  # checkpoint 14, the newest: iteration 4's values
    with pytest.raises(CheckpointError, match="no incremental checkpoint"):  # no init at all: still a misuse
        ctx.add_var_icp(1)
    ctx.init_icp(3, level, False)
    ctx.finalize()  # an inactive one is nothing to finish
