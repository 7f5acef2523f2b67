"""The previous differential checkpoint, kept as the spares, on a real LocalCluster: FTI's dCP test
(a truncated newest file) recovers the checkpoint before it (docs/dcp.md, "A truncated or damaged file")."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_dcp import _init, _state

import ftidask
from ftidask.storage.files import find_paths

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 2
BLOCK = 1024


@pytest.fixture
def client(dask_client):
    return dask_client


def _step(ctx, k):
    """Change one row of the field (a few blocks), keep the counts."""
    field = ctx.protected[1]
    ctx.protect(1, da.where(da.arange(96)[:, None] == 5 * k, field + 1, field))


def _assert_same(arrays, saved):
    assert sorted(arrays) == sorted(saved)
    for vid, ref in saved.items():
        got = arrays[vid].compute()
        assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes()


def _root(dirs, level):
    return Path(dirs["glbl_dir" if level == 8 else "ckpt_dir"])


def _truncate(dirs, level, ckpt_id, rank=1):
    """Cut a tail off rank ``rank``'s file of checkpoint ``ckpt_id`` (FTI's corrupt_check)."""
    (path,) = find_paths(_root(dirs, level), f"ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-Rank{rank}.fti")
    os.truncate(path, os.path.getsize(path) - 777)


def _spares(dirs, level):
    """Each spare's bytes, by path (the spares of the test's level only)."""
    paths = find_paths(_root(dirs, level), f"l{level - 4}/dcp/Spare-Rank*.fti")
    return {str(p): Path(p).read_bytes() for p in paths}


def _fallback(ctx, level):
    path = ctx.state.records_dir / f"fallback-l{level - 4}.json"
    return json.loads(path.read_text())["ckpt_id"] if path.exists() else None


@pytest.mark.parametrize("level", [5, 8])
def test_a_truncated_newest_file_falls_back_to_the_spares(client, dirs, level):
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(1).random((96, 64), chunks=(24, 64)), name="field")
    ctx.protect(2, da.arange(3000, chunks=750, dtype=np.int32), name="counts")
    saved = {}
    for k in (1, 2, 3):
        _step(ctx, k)
        ctx.checkpoint(k, level)
        saved[k] = _state(ctx)
    assert _fallback(ctx, level) == 2 and len(_spares(dirs, level)) == NWORKERS
    _truncate(dirs, level, 3)

    # A new client on the same cluster: checkpoint 3 does not verify, 2 is read from the spares.
    ctx2 = _init(client, dirs)
    assert ctx2.status() == 1
    _assert_same(ctx2.recover(), saved[2])
    assert ctx2.recovered_from == (2, level - 4)
    # The next checkpoint is written in full beside the spares, which stay as they are.
    spares = _spares(dirs, level)
    _step(ctx2, 4)
    info = ctx2.checkpoint(4, level)
    assert info.blocks_changed == info.blocks_total
    assert _spares(dirs, level) == spares and _fallback(ctx2, level) == 2
    assert not find_paths(_root(dirs, level), "dcp/SpareNext-Rank*.fti")  # renamed into checkpoint 4
    _truncate(dirs, level, 4, rank=0)

    ctx3 = _init(client, dirs)  # the damaged checkpoint 4 never replaced the spares: 2 again
    _assert_same(ctx3.recover(), saved[2])
    assert ctx3.recovered_from == (2, level - 4)
    for k in (5, 6):
        _step(ctx3, k)
        ctx3.checkpoint(k, level)
        saved[k] = _state(ctx3)
    assert _fallback(ctx3, level) == 5

    ctx4 = _init(client, dirs)
    _assert_same(ctx4.recover(), saved[6])
    assert ctx4.recovered_from == (6, level - 4)


@pytest.mark.parametrize("level", [5, 8])
def test_spares_damaged_too_recover_nothing_and_finalize_leaves_nothing(client, dirs, level):
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(2).random((96, 64), chunks=(24, 64)), name="field")
    for k in (1, 2, 3):
        _step(ctx, k)
        ctx.checkpoint(k, level)
    assert _fallback(ctx, level) == 2
    _truncate(dirs, level, 3)
    (spare,) = [p for p in _spares(dirs, level) if p.endswith("Spare-Rank0.fti")]
    os.truncate(spare, os.path.getsize(spare) - 777)
    ctx._close()  # the job ends (a context of it left open would keep the run from ctx2's finalize)

    ctx2 = _init(client, dirs)
    mine = np.full(5, 7.0)
    ctx2.protect(1, da.zeros((96, 64), chunks=(48, 64)), name="field")
    ctx2.protect(3, mine)
    held = ctx2.protected[1]
    with pytest.raises(ftidask.NoCheckpointError, match="spares of rank"):
        ctx2.recover()
    assert ctx2.protected[1] is held and (mine == 7.0).all()

    ctx2.finalize()
    assert not list(ctx2.state.records_dir.glob("fallback-*"))
    assert not [p for p in find_paths(_root(dirs, level), "*") if p.is_file()]
    assert not [p for p in find_paths(Path(dirs["ckpt_dir"]), "*") if p.is_file()]


def test_a_single_process_runs_previous_checkpoint_is_stitched_from_its_spare(client, tmp_path):
    """A checkpoint of the single-process backend read on Dask (stitch): its fallback too."""
    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "local_test": 1, "verbosity": 3}
    a = np.arange(8192, dtype=np.float64)
    ctx = ftidask.init(enable_dcp=1, dcp_block_size=BLOCK, **dirs)
    ctx.protect(1, a)
    saved = {}
    for k in (1, 2, 3):
        a[k * 1000] += 1
        ctx.checkpoint(k, 5)
        saved[k] = a.copy()
    ctx._close()
    (path,) = find_paths(dirs["ckpt_dir"], "ckpt3.s*/Ckpt3-Rank0.fti")
    os.truncate(path, os.path.getsize(path) - 777)
    ctx = ftidask.init(client=client, enable_dcp=1, dcp_block_size=BLOCK, **dirs)
    out = ctx.recover()
    assert np.asarray(out[1]).tobytes() == saved[2].tobytes()
    assert ctx.recovered_from == (2, 1) and 1 in ctx.spares.pinned  # its spare is left alone by the next one
    ctx._close()


def checkpoint_three_times(ctx, level, seed, chunks, step, state):
    """Protect a (96, 64) random field cut in ``chunks`` and checkpoint it at ``level`` after each of ``step(ctx, k)``
    for k = 1, 2, 3; ``state(ctx)`` after each, by checkpoint id."""
    ctx.protect(1, da.random.default_rng(seed).random((96, 64), chunks=chunks), name="field")
    saved = {}
    for k in (1, 2, 3):
        step(ctx, k)
        ctx.checkpoint(k, level)
        saved[k] = state(ctx)
    return saved


def _three_checkpoints(client, dirs, level, seed, **extra):
    """A context (``extra``: config keys) that wrote checkpoints 1-3 at ``level``; the states each holds."""
    ctx = _init(client, dirs, **extra)
    return ctx, checkpoint_three_times(ctx, level, seed, (24, 64), _step, _state)


def test_keep_last_ckpt_at_l4_dcp_after_a_fallback_keeps_the_previous_checkpoint(client, dirs):
    """keep_last_ckpt after a restart that fell back from a cut L4_DCP checkpoint: finalize keeps the checkpoint
    recovered (the newest, damaged, is not kept where it is), so the next run restarts from it."""
    ctx, saved = _three_checkpoints(client, dirs, 8, 3, keep_last_ckpt=1)
    _truncate(dirs, 8, 3)
    ctx._close()  # the job ends
    ctx2 = _init(client, dirs, keep_last_ckpt=1)
    _assert_same(ctx2.recover(), saved[2])
    ctx2.finalize()
    ctx3 = _init(client, dirs, keep_last_ckpt=1)
    assert ctx3.status() == 2
    _assert_same(ctx3.recover(), saved[2])
    assert ctx3.recovered_from == (2, 4)
    ctx3.finalize()


def test_a_fallback_recovered_by_the_client_that_wrote_the_damaged_checkpoint_keeps_the_spares(client, dirs):
    """The client that wrote checkpoints 1-3 recovers (checkpoint 3 cut): checkpoint 2, from the spares. Checkpoint 3,
    passed over, is retired by checkpoint 4 without replacing them: checkpoint 2 stays the fallback."""
    ctx, saved = _three_checkpoints(client, dirs, 5, 4)
    _truncate(dirs, 5, 3)
    _assert_same(ctx.recover(), saved[2])
    _step(ctx, 4)
    ctx.checkpoint(4, 5)
    assert _fallback(ctx, 5) == 2
    _truncate(dirs, 5, 4, rank=0)
    ctx2 = _init(client, dirs)
    _assert_same(ctx2.recover(), saved[2])
    assert ctx2.recovered_from == (2, 1)


class _ClientDied(BaseException):
    """The client process dies here (raised through every handler, as a kill would stop them)."""


@pytest.mark.parametrize("level", [5, 8])
def test_a_client_killed_while_retiring_leaves_the_previous_checkpoint_recoverable(client, dirs, level, monkeypatch):
    """The client dies as checkpoint 3 retires checkpoint 2, when it comes to name the fallback; checkpoint 3's file
    is then cut. Checkpoint 2 is whole: a new client recovers it. Before, its files had already been renamed to the
    spares while the fallback record still named checkpoint 1: checkpoint 2's commit record pointed at directories
    without its files, and nothing was recovered (NoCheckpointError)."""
    from ftidask.engine.runstate import RunState

    original = RunState.note_retired

    def note_retired(self, record, kept):
        if record.ckpt_id == 2:
            raise _ClientDied
        return original(self, record, kept)

    monkeypatch.setattr(RunState, "note_retired", note_retired)
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(5).random((96, 64), chunks=(24, 64)), name="field")
    saved = {}
    for k in (1, 2, 3):
        _step(ctx, k)
        try:
            ctx.checkpoint(k, level)
        except _ClientDied:
            assert k == 3
        saved[k] = _state(ctx)
    monkeypatch.setattr(RunState, "note_retired", original)
    _truncate(dirs, level, 3)
    ctx2 = _init(client, dirs)
    _assert_same(ctx2.recover(), saved[2])
    assert ctx2.recovered_from == (2, level - 4)


def test_spares_found_damaged_are_never_patched(client, dirs):
    """The client that wrote checkpoints 1-3 recovers with checkpoint 3 cut and a bit of a spare flipped in a block
    that never changes: nothing (NoCheckpointError). Checkpoint 4 must then write the spares in full: before, the
    client patched them from the FB hashes it noted, the damaged block stayed, and checkpoint 4, committed and
    reported written, never verified."""
    ctx, saved = _three_checkpoints(client, dirs, 5, 6)
    row = saved[3][1][90].tobytes()  # a row that _step never changes
    for path in _spares(dirs, 5):
        data = Path(path).read_bytes()
        off = data.find(row)
        if off > 0:
            with open(path, "r+b") as fh:
                fh.seek(off + 8)
                fh.write(bytes([data[off + 8] ^ 1]))
            break
    else:
        pytest.fail("row 90 is in no spare")
    _truncate(dirs, 5, 3)
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    _step(ctx, 4)
    ctx.checkpoint(4, 5)
    saved[4] = _state(ctx)
    ctx2 = _init(client, dirs)
    _assert_same(ctx2.recover(), saved[4])


def test_export_of_a_dask_run_falls_back_to_the_spares(client, dirs, tmp_path):
    """The Dask run's newest checkpoint truncated: ``ftidask export`` writes checkpoint 2, read from the workers'
    spares (the fallback a recovery takes), the global array exactly."""
    zarr = pytest.importorskip("zarr")
    from ftidask.tools.zarr_export import export_checkpoint

    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(1).random((96, 64), chunks=(24, 64)), name="field")
    saved = {}
    for k in (1, 2, 3):
        _step(ctx, k)
        ctx.checkpoint(k, 5)
        saved[k] = ctx.protected[1].compute()
    _truncate(dirs, 5, 3)
    result = export_checkpoint(None, tmp_path / "out.zarr", **dirs)
    assert result.ckpt_id == 2
    assert zarr.open_group(str(tmp_path / "out.zarr"), mode="r")["field"][...].tobytes() == saved[2].tobytes()


@pytest.mark.parametrize("level", [5, 8])
def test_finalize_interrupted_at_the_newest_commit_record_leaves_it_recoverable(client, dirs, level, monkeypatch):
    """finalize moved the newest differential checkpoint's files to the spares (cleared next) before dropping its
    commit record: a client stopped in between (here: a failure injected where the record goes, the files as a kill
    leaves them) left a restart nothing to recover. Its files now stay where the record points."""
    import crashpoints

    from ftidask.engine.runstate import RunState

    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(1).random((96, 64), chunks=(24, 64)), name="field")
    ctx.protect(2, da.arange(3000, chunks=750, dtype=np.int32), name="counts")
    for k in (1, 2, 3):
        _step(ctx, k)
        ctx.checkpoint(k, level)
    saved = _state(ctx)
    monkeypatch.setattr(RunState, "delete_record", crashpoints._counted(RunState.delete_record, 1, False, fail=True))
    with pytest.raises(crashpoints.InjectedFailure):
        ctx.finalize()
    monkeypatch.undo()

    ctx2 = _init(client, dirs)
    assert ctx2.status() == 1
    _assert_same(ctx2.recover(), saved)
    assert ctx2.recovered_from == (3, level - 4)
    ctx2.finalize()
