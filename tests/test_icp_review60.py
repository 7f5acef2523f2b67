"""Review 60: incremental checkpoints (iCP) on one process.

* An add_var_icp interrupted at levels 5-8 (differential) patched some blocks of the spare; the variable added again
  in the checkpoint still open must rewrite them: the commit recovers, bit for bit, the values of the second add.
* A variable protected as another kind between init_icp and its add (a Python state for an array, another global
  array declaration) is refused at the add, as a size change is: the checkpoint stays open.
"""

from __future__ import annotations

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import CheckpointError
from ftidask.storage import files as storage_files

BLOCK = 1024
N = 1 << 16  # float64: 512 KiB, 512 blocks


def _kw(root):
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=2,
                enable_dcp=1, dcp_block_size=BLOCK, dcp_page_tracking=0)


def _interrupt_after(monkeypatch, n):
    """Ctrl-C as the ``n``-th data write of a differential checkpoint starts (the earlier ones are in the file)."""
    real, calls = storage_files.pwrite_all, [0]

    def pwrite_all(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return real(*args, **kwargs)

    monkeypatch.setattr(storage_files, "pwrite_all", pwrite_all)
    return calls


@pytest.mark.parametrize("level", [5, 8])
def test_add_again_after_ctrl_c_commits_the_values_of_the_second_add(tmp_path, monkeypatch, level):
    ctx = ftidask.init(**_kw(tmp_path))
    a, b = np.zeros(N), np.arange(2048.0)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, level)
    ctx.checkpoint(2, level)  # the first file is the spare that checkpoint 3 patches
    ctx.init_icp(3, level)
    blocks = a.reshape(-1, BLOCK // 8)
    blocks[::2] = 1.0  # every other block changed: one write each
    calls = _interrupt_after(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        ctx.add_var_icp(1)
    assert calls[0] == 4  # three blocks of 1.0 are in the spare now
    monkeypatch.undo()
    a[:] = 0.0  # back to the base's values (the blocks patched among them)...
    blocks[1::4] = 2.0  # ...and some others changed
    want = a.copy()
    ctx.add_var_icp(1)
    a[:] = -1.0  # after the add: not in the checkpoint
    ctx.add_var_icp(2)  # unchanged, never interrupted: compared with the base as ever
    info = ctx.finalize_icp()
    ctx._closed = True

    c2 = ftidask.init(**_kw(tmp_path))
    x, y = np.full(N, -7.0), np.zeros(2048)
    c2.protect(1, x)
    c2.protect(2, y)
    c2.recover()
    assert c2.recovered_from[0] == 3  # the new checkpoint's file verifies against its own hashes
    assert x.tobytes() == want.tobytes()
    assert y.tobytes() == b.tobytes()
    c2._closed = True
    # Variable 1's containers are rewritten whole (512 blocks), variable 2's 16 are not; each counted once.
    assert (info.blocks_changed, info.blocks_total) == (512, 512 + 16)


def test_stats_count_each_block_once_after_an_interrupted_add(tmp_path, monkeypatch):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.zeros(N)
    ctx.protect(1, a)
    ctx.checkpoint(1, 5)
    ctx.checkpoint(2, 5)
    ctx.init_icp(3, 5)
    _interrupt_after(monkeypatch, 1)
    a[:BLOCK // 8] = 3.0
    with pytest.raises(KeyboardInterrupt):
        ctx.add_var_icp(1)
    monkeypatch.undo()
    ctx.add_var_icp(1)
    info = ctx.finalize_icp()
    assert info.blocks_total == N * 8 // BLOCK
    ctx._closed = True


def _reopen_value(root, obj):
    c = ftidask.init(**_kw(root))
    c.protect(5, obj)
    c.recover()
    c._closed = True
    return obj


@pytest.mark.parametrize("level", [1, 5])
def test_state_protected_as_an_array_in_between_is_refused(tmp_path, level):
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(5, ftidask.Value(7))
    ctx.init_icp(1, level)
    ctx.protect(5, np.array([56], np.uint8))  # as many bytes as the state's JSON "7"
    with pytest.raises(CheckpointError, match=r"variable 5 is an array, a Python state \(json\) when checkpoint 1 "
                                              r"started; what it is must not change in between"):
        ctx.add_var_icp(5)
    ctx.protect(5, ftidask.Value(7))  # as it was: the checkpoint is still open, the add is repeated
    ctx.add_var_icp(5)
    ctx.finalize_icp()
    ctx._closed = True
    assert _reopen_value(tmp_path, ftidask.Value(None)).value == 7


@pytest.mark.parametrize("level", [1, 5])
def test_array_protected_as_a_state_in_between_is_refused(tmp_path, level):
    ctx = ftidask.init(**_kw(tmp_path))
    arr = np.array([56], np.uint8)
    ctx.protect(5, arr)
    ctx.init_icp(1, level)
    ctx.protect(5, ftidask.Value(7))
    with pytest.raises(CheckpointError, match=r"variable 5 is a Python state \(json\), an array when checkpoint 1"):
        ctx.add_var_icp(5)
    ctx.protect(5, arr)
    ctx.add_var_icp(5)
    ctx.finalize_icp()
    ctx._closed = True
    assert _reopen_value(tmp_path, np.zeros(1, np.uint8)).tolist() == [56]


def test_global_array_declaration_changed_in_between_is_refused(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.arange(4.0), global_shape=(8,), offset=(0,))
    ctx.init_icp(1, 1)
    ctx.protect(1, np.arange(4.0), global_shape=(8,), offset=(4,))
    with pytest.raises(CheckpointError, match="what it is must not change in between"):
        ctx.add_var_icp(1)
    ctx.protect(1, np.arange(4.0), global_shape=(8,), offset=(0,))
    ctx.add_var_icp(1)
    ctx.finalize_icp()
    ctx._closed = True



def test_realloc_without_an_array_after_a_recovery_keeps_the_recovered_values(tmp_path):
    """Before: realloc(id) after recover() made an empty array of the stored size the protected one: the values
    recovered were gone from it (FTI_Realloc keeps a buffer's contents)."""
    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M")}
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(70, dtype=np.int64))
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.zeros(3, np.int64))
    grown = ctx.realloc(1)
    ctx.recover()
    assert ctx.realloc(1) is grown and grown.tobytes() == np.arange(70, dtype=np.int64).tobytes()
    assert ctx.protected[1] is grown
    ctx.finalize()



def test_realloc_of_a_python_state_not_protected_says_what_to_protect(tmp_path):
    """Before: a 1-byte uint8 array, protected in the state's place, which the next recover() refused."""
    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M")}
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(6.0))
    ctx.protect(2, ftidask.Value(5))
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.zeros(6))
    with pytest.raises(ftidask.RecoveryError, match=r"realloc\(2\): the checkpoint holds a Python state"):
        ctx.realloc(2)
    state = ftidask.Value(0)
    ctx.protect(2, state)
    assert ctx.realloc(2) is state
    ctx.recover()
    assert state.value == 5
    ctx.finalize()


@pytest.mark.parametrize("level", [5, 8])
def test_add_again_after_ctrl_c_past_the_write_commits_the_values_of_the_second_add(tmp_path, monkeypatch, level):
    """Ctrl-C right after a differential add's data was written (in its write tracking, before the add was
    counted): before, the repeated add compared with the base and skipped the blocks the first add had patched,
    and the committed checkpoint failed its own hash."""
    from ftidask.dcp import track

    block, n = 1024, 1 << 14
    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "enable_dcp": 1, "dcp_block_size": block}
    ctx = ftidask.init(**dirs)
    a = np.zeros(n)
    ctx.protect(1, a)
    ctx.checkpoint(1, level)
    ctx.checkpoint(2, level)
    ctx.init_icp(3, level)
    a.reshape(-1, block // 8)[::2] = 1.0
    real = track.DcpTracking.after_hash

    def interrupted(self, var_id, digests):
        monkeypatch.setattr(track.DcpTracking, "after_hash", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(track.DcpTracking, "after_hash", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctx.add_var_icp(1)
    a[:] = 0.0
    a[block // 8 + 1] = 4.0
    want = a.copy()
    ctx.add_var_icp(1)
    ctx.finalize_icp()
    ctx._close()
    again = ftidask.init(**dirs)
    back = np.full(n, -7.0)
    again.protect(1, back)
    again.recover()
    assert again.recovered_from[0] == 3 and back.tobytes() == want.tobytes()
    again.finalize()
