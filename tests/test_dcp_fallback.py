"""A damaged newest differential checkpoint: recovery falls back to the previous one, kept as the spare.

FTI's POSIX dCP stacks checkpoints as layers of one file and recovers the last intact layer when the
file is cut (its dCP suite's corrupt_check). Here each differential checkpoint has its own file, and the
previous one stays whole as the spare until the next differential checkpoint patches it: recovery tries
it after every newer checkpoint (tests/test_itf_matrix.py runs FTI's sequence over mpiexec).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.storage.files import find_paths

sys.path.insert(0, str(Path(__file__).parent))
import _dcp_crash_child as child  # noqa: E402
from mpi_util import need_mpi, run  # noqa: E402
from test_dcp import _assert_same, _kw, _rank_file  # noqa: E402

CHILD = str(Path(__file__).parent / "_dcp_crash_child.py")


def _truncate(path: Path, cut: int = 1000) -> None:
    os.truncate(path, path.stat().st_size - cut)


def _restart(root: Path, like: np.ndarray, **extra):
    """A new process of the run: init (``extra``: config keys), protect a zeroed array shaped like ``like`` (id 1)."""
    ctx = ftidask.init(**_kw(root, **extra))
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
    assert not list(find_paths(tmp_path / "m", "fallback-*")) and not list(find_paths(tmp_path, "Spare*"))
    assert diff.blocks_changed == diff.blocks_total and s1 is not None and s3 is not None


def test_a_fallback_recovered_in_the_same_process_keeps_the_spare_after_the_next_checkpoint(tmp_path):
    """The process that wrote checkpoints 1-3 recovers (checkpoint 3's file cut): checkpoint 2, from the spare. The
    damaged checkpoint 3, retired by checkpoint 4, never replaces it: with checkpoint 4 cut too, a restart still
    recovers checkpoint 2 (as after a restart, see the test above)."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(40_000, dtype=np.float64)
    ctx.protect(1, a)
    _s1, s2, _s3 = _states(ctx, a, 5, range(1, 4))
    _truncate(_rank_file(ctx))
    ctx.recover()
    assert ctx.recovered_from == (2, 1) and a.tobytes() == s2.tobytes()
    a[5] = 5.5
    ctx.checkpoint(4, 5)
    assert [r.ckpt_id for r in ctx.state.fallbacks()] == [2]
    _truncate(_rank_file(ctx))
    _closed(ctx)
    ctx2, b = _restart(tmp_path, a)
    ctx2.recover()
    _closed(ctx2)
    assert ctx2.recovered_from == (2, 1) and b.tobytes() == s2.tobytes()


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


@pytest.mark.parametrize("full", [1, 4])
def test_no_fallback_past_a_full_checkpoint_of_the_level(tmp_path, full):
    """L1_DCP checkpoints 1-2, then full checkpoints 3-4 at level ``full``; checkpoint 4's file cut. Checkpoint 3
    (committed, not kept) came between: the spare (checkpoint 2) is no longer the checkpoint before the newest,
    and recovery never goes back past 3 to it (docs/dcp.md: "a full checkpoint of the level between them")."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    for i, level in ((1, 5), (2, 5), (3, full), (4, full)):
        a[:] = i
        ctx.checkpoint(i, level)
    _truncate(_rank_file(ctx))
    _closed(ctx)
    ctx2, b = _restart(tmp_path, a)
    with pytest.raises(ftidask.NoCheckpointError):
        ctx2.recover()
    _closed(ctx2)
    assert ctx2.recovered_from is None and not b.any(), f"recovered {ctx2.recovered_from}, past checkpoint 3"


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
    got = child.recovered_step(str(tmp_path))
    assert got in {3, *printed, (printed or [3])[-1] + 1}, (got, printed)
    assert got >= (printed or [3])[-1]  # never older than a checkpoint reported committed
    assert _child(tmp_path, 8).returncode == 0
    assert child.recovered_step(str(tmp_path)) == 8


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


@pytest.mark.parametrize("ranks", [2, 4])
@need_mpi()[0]
@need_mpi()[1]
def test_restart_on_another_number_of_ranks_falls_back_too(tmp_path, ranks):
    """4 ranks write L4_DCP checkpoints 1-3 of a global array; rank 1's newest file is cut; a restart on 2 ranks
    redistributes checkpoint 2 from the spares (as one on 4 ranks recovers it directly), exactly, on every rank."""
    run(4, "dcp_fallback_job.py", "write", str(tmp_path), timeout=120)
    (newest,) = tmp_path.glob("Global/*/l4/ckpt3.*/Ckpt3-Rank1.fti")
    _truncate(newest, 100)
    run(ranks, "dcp_fallback_job.py", "recover", str(tmp_path), timeout=120)
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(ranks)]
    assert got == [{"from": [2, 4], "exact": True}] * ranks, got


@need_mpi()[0]
@need_mpi()[1]
def test_the_checkpoint_after_a_fallback_redistributed_leaves_the_spares_alone(tmp_path):
    """Checkpoint 2 recovered from the spares of 4 ranks on 2 (checkpoint 3 cut): the next checkpoint is written
    beside the spares, not by patching the old ranks' 0 and 1 (a kill during it would leave nothing to recover)."""
    run(4, "dcp_fallback_job.py", "write", str(tmp_path), timeout=120)
    (newest,) = tmp_path.glob("Global/*/l4/ckpt3.*/Ckpt3-Rank1.fti")
    _truncate(newest, 100)
    spares = {p: p.read_bytes() for p in tmp_path.glob("Global/*/l4/dcp/Spare-Rank*.fti")}
    assert len(spares) == 4
    run(2, "dcp_fallback_job.py", "continue", str(tmp_path), timeout=120)
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert got == [{"from": [2, 4], "exact": True}] * 2, got
    assert all(p.exists() and p.read_bytes() == before for p, before in spares.items()), "a spare was patched"


# --- found by review: stale fallbacks, kills while retiring, keep_last_ckpt ---------------------------------

def _closed(ctx):
    ctx._closed = True
    if ctx._run_lock is not None:
        ctx._run_lock.release()


CHILD_FINALIZE = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, crashpoints, ftidask
from ftidask.engine import runstate
crashpoints.kill_at_call(runstate.RunState, {point!r}, {nth}, after={after})   # SIGKILL
ctx = ftidask.init(**{kw!r})
a = np.zeros(10_000); ctx.protect(1, a)
for i in (1, 2, 3):
    a[:] = 100 + i
    ctx.checkpoint(i, 5)
print("finalizing", flush=True)
ctx.finalize()
"""


# The finalize's calls: delete_record 1 and 2 retired checkpoints 1 and 2, write_run 1 was the init's, write_run 2
# the finalize's mark of the sequence numbers used (before any record goes), write_run 3 marks the run finalized.
@pytest.mark.parametrize("point,nth,after", [("delete_record", 3, True), ("write_run", 3, False)])
def test_finalize_killed_then_fresh_run_with_same_exec_id_recovers_its_own_checkpoint(tmp_path, point, nth, after):
    """Finalize killed once the last commit record is gone (the fallbacks were deleted before it) and before the
    run is marked finalized. The next init with the same exec_id is a fresh start (no record); a later restart recovers that
    run's own checkpoint 1, never the finalized run's previous checkpoint (its fallback, seq 3, is gone)."""
    extra = {"exec_id": "runx"}
    k = _kw(tmp_path, **extra)
    script = CHILD_FINALIZE.format(tests=str(Path(__file__).parent), point=point, nth=nth, after=after, kw=k)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9 and "finalizing" in r.stdout, r.stderr  # killed in the finalize
    ctx = ftidask.init(**k)
    assert ctx.status() == 0  # finalize had removed every record: a fresh start, as FTI
    b = np.full(10_000, 7.0)
    ctx.protect(1, b)
    ctx.checkpoint(1, 4)  # the new run's first checkpoint (any level that does not consume the L1 spare)
    _closed(ctx)
    ctx2, c = _restart(tmp_path, np.zeros(10_000), **extra)
    ctx2.recover()
    _closed(ctx2)
    assert ctx2.recovered_from == (1, 4) and c[0] == 7.0, \
        f"recovered {ctx2.recovered_from} value {c[0]}: the finalized run's state, not this run's checkpoint 1"


def test_a_fallback_without_commit_records_is_a_restart_and_never_outranks_a_new_checkpoint(tmp_path):
    """The newest commit record damaged (outside harm), the fallback (seq 2) left: status() says 1, since recover()
    would recover it; an application that started afresh anyway checkpoints after it (sequence numbers count the
    fallback), so the next restart recovers the new checkpoint, not the stale fallback."""
    extra = {"exec_id": "r"}
    k = _kw(tmp_path, **extra)
    ctx, a = _restart(tmp_path, np.zeros(10_000), **extra)
    for i in (1, 2, 3):
        a[:] = i
        ctx.checkpoint(i, 5)
    _closed(ctx)
    rec = tmp_path / "m/r/commits/s00000003.json"
    raw = json.loads(rec.read_text())
    raw["timestamp"] += 1
    rec.write_text(json.dumps(raw))
    ctx = ftidask.init(**k)
    status = ctx.status()
    b = np.full(10_000, 7.0)
    ctx.protect(1, b)
    if status == 0:  # FTI's application: nothing to recover, start over
        ctx.checkpoint(1, 8)
    _closed(ctx)
    ctx2, c = _restart(tmp_path, np.zeros(10_000), **extra)
    ctx2.recover()
    _closed(ctx2)
    assert status == 1 or (ctx2.recovered_from == (1, 4) and c[0] == 7.0), (status, ctx2.recovered_from, c[0])



def test_a_restart_without_dcp_counts_no_fallback_and_drops_it(tmp_path):
    """The same fallback (the newest commit record damaged) and a restart without enable_dcp, whose start removes
    the spares: status() said 1 where recover() raised NoCheckpointError; it says 0, and the fallback record goes
    with its spares (a later restart with dCP on finds neither)."""
    k = _kw(tmp_path, exec_id="r")
    ctx, a = _restart(tmp_path, np.zeros(10_000), exec_id="r")
    for i in (1, 2, 3):
        a[:] = i
        ctx.checkpoint(i, 5)
    _closed(ctx)
    rec = tmp_path / "m/r/commits/s00000003.json"
    rec.write_text(rec.read_text()[:-5])  # torn: no commit record left that verifies
    assert list((tmp_path / "m/r/commits").glob("fallback-l*.json"))
    ctx = ftidask.init(**{**k, "enable_dcp": 0})
    assert ctx.status() == 0
    ctx.protect(1, np.zeros(10_000))
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    _closed(ctx)
    assert not list((tmp_path / "m/r/commits").glob("fallback-l*.json"))


CHILD_RETIRE = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, crashpoints, ftidask
from ftidask.engine import runstate
crashpoints.kill_at_call(runstate.RunState, "delete_record", 1, after=True)  # ckpt 1's record gone, 1 still whole
ctx = ftidask.init(**{kw!r})
a = np.zeros(10_000); ctx.protect(1, a)
for i in (1, 2):
    a[:] = i
    ctx.checkpoint(i, 5)
"""


def test_killed_while_retiring_then_newest_damaged_still_recovers_the_previous_checkpoint(tmp_path):
    """Killed in remove_checkpoint right after checkpoint 1's record is deleted: its fallback record was written
    before, so with checkpoint 2's file then damaged the restart recovers checkpoint 1 from the spare."""
    k = _kw(tmp_path)
    r = subprocess.run([sys.executable, "-c", CHILD_RETIRE.format(tests=str(Path(__file__).parent), kw=k)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    whole = sorted(p.name for p in find_paths(tmp_path, "*.fti"))
    f = next(iter(find_paths(tmp_path, "ckpt2.*/Ckpt2-Rank0.fti")))
    os.truncate(f, f.stat().st_size - 50)
    ctx, b = _restart(tmp_path, np.zeros(10_000))
    try:
        ctx.recover()
    except ftidask.NoCheckpointError as exc:
        pytest.fail(f"files {whole}: checkpoint 1 is whole, yet {exc}")
    finally:
        _closed(ctx)
    assert b[0] == 1.0


@pytest.mark.parametrize("level", [5, 8])
def test_keep_last_ckpt_after_a_fallback_recovery(tmp_path, level):
    """After a restart that recovered the previous checkpoint (the newest file cut), finalize with
    keep_last_ckpt = 1 keeps that one (the damaged newest cannot be flushed, nor kept where it is at L4):
    the next run restarts from it."""
    extra = {"keep_last_ckpt": 1}
    k = _kw(tmp_path, **extra)
    ctx, a = _restart(tmp_path, np.zeros(10_000), **extra)
    for i in (1, 2, 3):
        a[:] = i
        ctx.checkpoint(i, level)
    f = ctx._rank_file(ctx.state.records()[-1])
    os.truncate(f, f.stat().st_size - 100)
    _closed(ctx)
    ctx2, b = _restart(tmp_path, np.zeros(10_000), **extra)
    ctx2.recover()
    assert ctx2.recovered_from == (2, level - 4)
    ctx2.finalize()  # keep_last_ckpt keeps the newest checkpoint that can be kept: 2, from the spare
    ctx3 = ftidask.init(**k)
    assert ctx3.status() == 2
    c = np.zeros(10_000)
    ctx3.protect(1, c)
    ctx3.recover()
    assert ctx3.recovered_from == (2, 4) and (c == 2).all()
    ctx3.finalize()


def test_cli_list_names_the_fallback(tmp_path, capsys):
    """`ftidask list` says which uncommitted file a restart may still fall back to (the spare), not 'not committed'."""
    from ftidask.tools.cli import main

    ctx = ftidask.init(**_kw(tmp_path, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                             meta_dir=str(tmp_path / "Meta")))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    _states(ctx, a, 5, range(1, 4))
    ctx._closed = True
    assert main(["list", str(tmp_path)]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "the previous differential checkpoint" in rows["2"] and "not committed" not in rows["2"], rows
    assert rows["3"].endswith("sound"), rows


def test_a_forged_fallback_with_the_last_sequence_number_never_hides_a_new_checkpoint(tmp_path):
    """A fallback record forged with seq 2**63 - 1 (plausible): the next checkpoint's seq would be one no record may
    hold, so it would be committed unreadable and retire checkpoint 3. It fails instead (CheckpointError), and
    checkpoint 3 stays committed and recoverable."""
    from ftidask.engine.runstate import seal_json

    ctx, a = _restart(tmp_path, np.zeros(10_000), exec_id="r")
    for i in (1, 2, 3):
        a[:] = i
        ctx.checkpoint(i, 5)
    path = ctx.state.records_dir / "fallback-l1.json"
    raw = json.loads(path.read_text())
    raw["seq"] = 2**63 - 1
    path.write_text(json.dumps(seal_json(raw)))
    a[:] = 4
    with pytest.raises(ftidask.CheckpointError):
        ctx.checkpoint(4, 5)
    assert [r.ckpt_id for r in ctx.state.records()] == [3]
    _closed(ctx)
    ctx2, b = _restart(tmp_path, np.zeros(10_000), exec_id="r")
    ctx2.recover(ckpt_id=3)
    _closed(ctx2)
    assert ctx2.recovered_from == (3, 1) and (b == 3).all()
