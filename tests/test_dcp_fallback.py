"""A damaged newest differential checkpoint: recovery falls back to the previous one, kept as the spare.

FTI's POSIX dCP stacks checkpoints as layers of one file and recovers the last intact layer when the
file is cut (its dCP suite's corrupt_check). Here each differential checkpoint has its own file, and the
previous one stays whole as the spare until the next differential checkpoint patches it: recovery tries
it after every newer checkpoint (tests/test_itf_matrix.py runs FTI's sequence over mpiexec).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ftidask

sys.path.insert(0, str(Path(__file__).parent))
import _dcp_crash_child as child  # noqa: E402
from test_dcp import _assert_same, _kw, _rank_file  # noqa: E402

CHILD = str(Path(__file__).parent / "_dcp_crash_child.py")


def _truncate(path: Path, cut: int = 1000) -> None:
    os.truncate(path, path.stat().st_size - cut)


def _restart(root: Path, like: np.ndarray):
    """A new process of the run: init, protect a zeroed array shaped like ``like`` (id 1)."""
    ctx = ftidask.init(**_kw(root))
    arr = np.zeros_like(like)
    ctx.protect(1, arr)
    return ctx, arr


def _states(ctx, a: np.ndarray, level: int, ids: range) -> list[np.ndarray]:
    """Checkpoints ``ids`` of ``a`` at ``level``, each after a change; the state each holds."""
    out = []
    for i in ids:
        a[(i * 977) % a.size] = -i
        a[i * 3000:i * 3000 + 1500] = i
        ctx.checkpoint(i, level)
        out.append(a.copy())
    return out


@pytest.mark.parametrize("level", [5, 8])
def test_a_cut_newest_file_recovers_the_previous_checkpoint(tmp_path, level, caplog):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(40_000, dtype=np.float64)
    ctx.protect(1, a)
    s1, s2, s3 = _states(ctx, a, level, range(1, 4))
    _truncate(_rank_file(ctx))
    ctx._closed = True  # the process dies
    ctx2, b = _restart(tmp_path, a)
    with caplog.at_level(logging.INFO, logger="ftidask"):
        ctx2.recover()
    assert b.tobytes() == s2.tobytes()
    assert "cannot recover checkpoint 3" in caplog.text and "kept as the spare" in caplog.text
    spare = ctx2._dcp.spare_path(level - 4)
    before = spare.read_bytes()
    # The next checkpoint must not patch the spare: it is all a crash now would recover.
    b[5] = 5.5
    info = ctx2.checkpoint(4, level)
    assert info.blocks_changed == info.blocks_total  # written in full, elsewhere
    assert spare.read_bytes() == before
    s4 = b.copy()
    _truncate(_rank_file(ctx2))
    ctx2._closed = True
    ctx3, c = _restart(tmp_path, a)
    ctx3.recover()  # checkpoint 4 is cut too: the spare (checkpoint 2) is still there
    assert c.tobytes() == s2.tobytes() and not np.array_equal(s4, s2)
    s5, s6 = _states(ctx3, c, level, range(5, 7))  # 5 in full beside the spare, 6 patches it
    ctx3._closed = True
    ctx4, d = _restart(tmp_path, a)
    ctx4.recover()
    assert d.tobytes() == s6.tobytes()
    _truncate(_rank_file(ctx4), 1)
    ctx4._closed = True
    ctx5, e = _restart(tmp_path, a)
    ctx5.recover()
    assert e.tobytes() == s5.tobytes()
    e[7] = 7
    diff = ctx5.checkpoint(7, level)  # the spare (5) was recovered: written beside it
    ctx5.checkpoint(8, level)
    _assert_same({1: e}, {1: e.copy()})
    ctx5.finalize()
    assert not list((tmp_path / "m").rglob("fallback-*")) and not list(tmp_path.rglob("Spare*"))
    assert diff.blocks_changed == diff.blocks_total and s1 is not None and s3 is not None


def test_nothing_older_than_a_cut_spare(tmp_path):
    """Both the newest file and the spare cut: the same clean NoCheckpointError, the array untouched."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    _states(ctx, a, 5, range(1, 4))
    _truncate(_rank_file(ctx))
    _truncate(ctx._dcp.spare_path(1), 10)
    ctx._closed = True
    ctx2, b = _restart(tmp_path, a)
    b[:] = 7
    with pytest.raises(ftidask.NoCheckpointError) as err:
        ctx2.recover()
    assert "checkpoint 3 (level 1)" in str(err.value) and "checkpoint 2 (level 1)" in str(err.value)
    assert (b == 7).all()


def test_fallback_only_for_the_checkpoint_asked(tmp_path):
    """recover(ckpt_id=...) may name the previous checkpoint while the newest is sound: it is read from the spare;
    the newest is still recovered by default, and stored_size sees what recover() would load."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    s1, s2 = _states(ctx, a, 5, range(1, 3))
    ctx._closed = True
    ctx2, b = _restart(tmp_path, a)
    assert ctx2.stored_size(1) == a.nbytes
    ctx2.recover(ckpt_id=1)
    assert b.tobytes() == s1.tobytes()
    ctx2.recover()  # the newest, sound: from now on the spare may be patched again
    assert b.tobytes() == s2.tobytes()
    b[0] = -1
    info = ctx2.checkpoint(3, 5)
    assert 0 < info.blocks_changed < info.blocks_total
    with pytest.raises(ftidask.NoCheckpointError):
        ctx2.recover(ckpt_id=1, level=4)
    ctx2._closed = True


def test_a_damaged_spare_is_never_recovered(tmp_path):
    """A byte flipped in the spare's data: its hash fails, so the fallback is refused like any damaged file."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    _states(ctx, a, 5, range(1, 4))
    spare = ctx._dcp.spare_path(1)
    with open(spare, "r+b") as fh:
        fh.seek(4096 + 100)
        byte = fh.read(1)
        fh.seek(4096 + 100)
        fh.write(bytes([byte[0] ^ 1]))
    os.unlink(_rank_file(ctx))
    ctx._closed = True
    ctx2, b = _restart(tmp_path, a)
    with pytest.raises(ftidask.NoCheckpointError, match="checkpoint 2"):
        ctx2.recover()
    assert not b.any()


def test_no_fallback_without_dcp_on_the_restart(tmp_path):
    """A restart without enable_dcp removes the spares at its start: only committed checkpoints are candidates."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    _states(ctx, a, 5, range(1, 3))
    os.unlink(_rank_file(ctx))
    ctx._closed = True
    ctx2 = ftidask.init(**_kw(tmp_path, enable_dcp=0))
    b = np.zeros_like(a)
    ctx2.protect(1, b)
    with pytest.raises(ftidask.NoCheckpointError) as err:
        ctx2.recover()
    assert "checkpoint 1" not in str(err.value)
    ctx2._closed = True


# --- killed after a fallback recovery -----------------------------------------------------------------

def _child(root: Path, steps: int, crash: str | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, CHILD, str(root), str(steps), "5", *([crash] if crash else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _recovered_step(root: Path) -> int:
    """Recover the child's run in a fresh context; the state must be exactly that of the step it holds."""
    ctx = ftidask.init(**child.config(str(root)))
    arrays = {vid: np.zeros(n, dt) for vid, (n, dt) in child.SIZES.items()}
    step = np.zeros(1, np.int64)
    for vid, arr in arrays.items():
        ctx.protect(vid, arr)
    ctx.protect(99, step)
    try:
        ctx.recover()
    finally:
        ctx._closed = True
    want = child.state(int(step[0]))
    for vid in arrays:
        assert arrays[vid].tobytes() == want[vid].tobytes(), f"variable {vid} at step {int(step[0])}"
    return int(step[0])


@pytest.mark.parametrize("crash", ["write_var:1", "block:2", "finished:1", "renamed:1", "retired:1",
                                   pytest.param("write_var:5", marks=pytest.mark.slow), "block:12", "renamed:2",
                                   pytest.param("retired:2", marks=pytest.mark.slow)])
def test_killed_while_writing_after_a_fallback(tmp_path, crash):
    """Steps 1-4 committed, step 4's file cut; the restart recovers step 3 from the spare, writes step 4 in full
    beside it, then step 5 by patching it, and is killed at ``crash``. The run then holds step 3 (the spare, still
    whole until step 4 is committed), or the newest step committed, exactly; and it goes on to the end."""
    assert _child(tmp_path, 4).returncode == 0
    (newest,) = tmp_path.glob("l/node*/*/l1/ckpt4.*/Ckpt4-Rank0.fti")
    _truncate(newest)
    done = _child(tmp_path, 8, crash)
    assert done.returncode == -signal.SIGKILL, done.stderr
    printed = [int(x) for x in done.stdout.split()]
    got = _recovered_step(tmp_path)
    assert got in {3, *printed, (printed or [3])[-1] + 1}, (got, printed)
    assert got >= (printed or [3])[-1]  # never older than a checkpoint reported committed
    assert _child(tmp_path, 8).returncode == 0
    assert _recovered_step(tmp_path) == 8


def test_recover_var_and_stored_size_fall_back_too(tmp_path):
    """FTI_RecoverVar's way (corrupt_check runs both): each variable alone, the sizes first, from the spare."""
    ctx = ftidask.init(**_kw(tmp_path))
    a, b = np.arange(20_000, dtype=np.int64), np.arange(3000, dtype=np.float32)
    ctx.protect(1, a)
    ctx.protect(2, b)
    want = []
    for i in (1, 2, 3):
        a[i * 100] = -i
        b[:i * 500] = i
        ctx.checkpoint(i, 8)
        want.append((a.copy(), b.copy()))
    _truncate(_rank_file(ctx), 5)
    ctx._closed = True
    ctx2 = ftidask.init(**_kw(tmp_path))
    ra, rb = np.zeros_like(a), np.zeros_like(b)
    ctx2.protect(1, ra)
    ctx2.protect(2, rb)
    assert ctx2.stored_size(2) == b.nbytes
    ctx2.recover_var(2)
    assert rb.tobytes() == want[1][1].tobytes() and not ra.any()
    ctx2.recover_var(1)
    assert ra.tobytes() == want[1][0].tobytes()
    ra[0] = 99
    ctx2.checkpoint(4, 8)  # beside the spare
    ctx2.recover()
    assert ra[0] == 99
    ctx2._closed = True
