"""Differential checkpoints on Dask since a task claims the spare it patches (fence.claim): what stays on disk
after each checkpoint, and what a restart recovers when the newest checkpoint's file is damaged, on a real
LocalCluster (levels 5-8, full checkpoints between, recoveries and checkpoints after them, asynchronous ones)."""

import re
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_dcp_fallback import checkpoint_three_times  # noqa: E402

import ftidask  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(600)]
NWORKERS = 3
BLOCK = 512
SPARE = re.compile(r"Spare(|Pcof|RSed)-Rank\d+\.fti(\.hash)?$")


@pytest.fixture
def client(dask_client):
    return dask_client


def _init(client, dirs, **kw):
    return ftidask.init(client=client, enable_dcp=1, dcp_block_size=BLOCK, group_size=3, **dirs, **kw)


def _step(ctx, k):
    field = ctx.protected[1]
    ctx.protect(1, da.where(da.arange(96)[:, None] == 5 * k % 96, field + k, field))


def _state(ctx):
    return {vid: a.compute().tobytes() for vid, a in ctx.protected.items()}


def _files(dirs):
    return [p for root in (dirs["ckpt_dir"], dirs["glbl_dir"]) for p in find_paths(Path(root), "*") if p.is_file()]


def _strays(dirs):
    """Files that no committed checkpoint, spare or run state accounts for: a claimed spare left in a checkpoint
    directory, a spare directory holding anything but spares, temporary files."""
    out = []
    for p in _files(dirs):
        if p.name.startswith(".trash-") or any(part.startswith(".trash-") for part in p.parts):
            continue  # deleted in the background
        if p.parent.name == "dcp":
            if not SPARE.match(p.name):
                out.append(p)
        elif p.name.startswith("Spare") or ".tmp" in p.name:
            out.append(p)
    return out


def _own_file(dirs, ckpt_id, rank):
    (path,) = [p for p in find_paths(dirs["ckpt_dir"], f"ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-Rank{rank}.fti")] or [
        p for p in find_paths(dirs["glbl_dir"], f"ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-Rank{rank}.fti")]
    return Path(path)


def _probe(client, dirs, newest, saved, rank=1):
    """Flip a byte of the newest checkpoint's file of ``rank``; a new client recovers: the data of the checkpoint it
    names, bit for bit, or an FTI error (no traceback from deep inside). The byte is put back. What it recovered."""
    path = _own_file(dirs, newest, rank)
    data = path.read_bytes()
    with open(path, "r+b") as fh:
        fh.seek(len(data) // 2)
        fh.write(bytes([data[len(data) // 2] ^ 0x5A]))
    ctx = _init(client, dirs)
    try:
        try:
            out = ctx.recover()
        except ftidask.FTIError as exc:
            return ("none", type(exc).__name__)
        got = ctx.recovered_from[0]
        assert {v: a.compute().tobytes() for v, a in out.items()} == saved[got], f"recovered {got}: wrong data"
        return got
    finally:
        ctx._close()
        path.write_bytes(data)


def _three_checkpoints(client, dirs, level, seed, **kw):
    """A context protecting a field, checkpointed three times at ``level`` (each after a step); its states."""
    ctx = _init(client, dirs, **kw)
    return ctx, checkpoint_three_times(ctx, level, seed, (32, 64), _step, _state)


def _newest_recovered(ctx, client, dirs, saved, newest=6):
    """A restart after ``ctx`` closed (no finalize): the newest checkpoint recovered bit for bit; its context."""
    ctx._close()
    ctx2 = _init(client, dirs)
    out = ctx2.recover()
    assert ctx2.recovered_from[0] == newest
    assert {v: a.compute().tobytes() for v, a in out.items()} == saved[newest]
    return ctx2


@pytest.mark.slow
@pytest.mark.parametrize("level", [5, 6, 7, 8])
def test_dcp_full_dcp_sequence_leaves_no_stray_and_recovers(client, dirs, level):
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(level).random((96, 64), chunks=(32, 64)), name="field")
    ctx.protect(2, da.arange(3000, chunks=1000, dtype=np.int32), name="counts")
    saved, seen = {}, []
    for k, lv in enumerate([level, level, level, level - 4, level, level], start=1):
        _step(ctx, k)
        ctx.checkpoint(k, lv)
        saved[k] = _state(ctx)
        assert not _strays(dirs), (k, _strays(dirs))
        seen.append((k, lv, _probe(client, dirs, k, saved)))
    print(seen)
    for k, lv, got in seen:
        if lv in (6, 7, 2, 3):  # a damaged file of L2/L3 is rebuilt: the newest, always
            assert got == k, seen
        else:
            assert got in (k - 1, ("none", "NoCheckpointError")), seen
    # the newest, undamaged, after all of it
    _newest_recovered(ctx, client, dirs, saved).finalize()
    assert not _files(dirs), _files(dirs)


@pytest.mark.slow
@pytest.mark.parametrize("level", [5, 6, 7, 8])
def test_asynchronous_dcp_checkpoints_in_a_row(client, dirs, level):
    """Checkpoints 2-4 asynchronous, one after the other (the claims of one and the retirement of the one before
    it on the same workers), then one waited for: each one after the first two patches its spare; no stray file;
    the newest recovers, and a damaged newest falls back as the design says."""
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(10 + level).random((96, 64), chunks=(32, 64)), name="field")
    saved, handles = {}, []
    for k in range(1, 7):
        _step(ctx, k)
        if k in (1, 6):
            info = ctx.checkpoint(k, level)
        else:
            handles.append(ctx.checkpoint(k, level, wait=False))
        saved[k] = _state(ctx)
    infos = [h.result() for h in handles] + [info]
    assert all(i.blocks_changed < i.blocks_total for i in infos[2:]), [(i.blocks_changed, i.blocks_total)
                                                                         for i in infos]
    assert not _strays(dirs), _strays(dirs)
    got = _probe(client, dirs, 6, saved)
    assert got == (6 if level in (6, 7) else 5), got
    ctx2 = _newest_recovered(ctx, client, dirs, saved)
    for k in (7, 8):  # a recovery, then checkpoints
        _step(ctx2, k)
        ctx2.checkpoint(k, level)
        saved[k] = _state(ctx2)
        assert not _strays(dirs), _strays(dirs)
    assert _probe(client, dirs, 8, saved) == (8 if level in (6, 7) else 7)
    ctx2.finalize()
    assert not _files(dirs), _files(dirs)


@pytest.mark.slow
@pytest.mark.parametrize("level", [5, 7])
def test_keep_last_ckpt_then_differential_checkpoints_again(client, dirs, level):
    """keep_last_ckpt: the finalized run keeps its newest checkpoint and no spare; the next run recovers it, writes
    differential checkpoints from there (the first in full: no spare) and finalizes the same way."""
    ctx, saved = _three_checkpoints(client, dirs, level, 20 + level, keep_last_ckpt=1)
    ctx.finalize()
    assert not [p for p in _files(dirs) if p.name.startswith("Spare") or p.parent.name == "dcp"], _files(dirs)
    for run in (1, 2):
        ctx = _init(client, dirs, keep_last_ckpt=1)
        out = ctx.recover()
        newest = max(saved)
        assert ctx.recovered_from[0] == newest
        assert {v: a.compute().tobytes() for v, a in out.items()} == saved[newest]
        infos = []
        for k in (newest + 1, newest + 2, newest + 3):
            _step(ctx, k)
            infos.append(ctx.checkpoint(k, level))
            saved[k] = _state(ctx)
            assert not _strays(dirs), _strays(dirs)
        assert infos[0].blocks_changed == infos[0].blocks_total and infos[2].blocks_changed < infos[2].blocks_total
        assert _probe(client, dirs, max(saved), saved) == (max(saved) if level == 7 else max(saved) - 1)
        ctx.finalize()
        assert not [p for p in _files(dirs) if p.name.startswith("Spare") or p.parent.name == "dcp"], _files(dirs)


@pytest.mark.slow
@pytest.mark.parametrize(("level", "point"), [(5, "dcp-block"), (6, "ftidask.levels.partner_delta:protect"),
                                              (7, "ftidask.levels.rs_delta:update"), (8, "dcp-block")])
def test_worker_killed_with_a_claimed_spare(client, dirs, level, point):
    """A worker killed once its task claimed a spare (halfway through patching its file, or in the L2/L3 step with
    the spare partner copy or parity claimed): the checkpoint fails, the newest committed one recovers bit for bit
    (also with a damaged file, as the level allows), nothing claimed is left anywhere, the run goes on."""
    from conftest import wait_for_replaced_workers
    from test_dask_backend import crash_worker

    ctx, saved = _three_checkpoints(client, dirs, level, 30 + level)
    _step(ctx, 4)  # changes a row of the first chunk: its rank patches a block (sticky: it writes it again)
    rank = next(r for index, r, _d, _n in ctx.state.records()[-1].extra["chunks"]["1"] if index == [0, 0])
    crash_worker(client, rank, point)
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
        ctx.checkpoint(4, level)
    wait_for_replaced_workers(client, NWORKERS)
    assert not _strays(dirs), _strays(dirs)
    assert not find_paths(dirs["ckpt_dir"], "ckpt4.s*") and not find_paths(dirs["glbl_dir"], "ckpt4.s*")
    assert _probe(client, dirs, 3, saved, rank=0) in ((3,) if level in (6, 7) else (3, 2, ("none", "NoCheckpointError")))
    for k in (5, 6):
        _step(ctx, k)
        ctx.checkpoint(k, level)
        saved[k] = _state(ctx)
        assert not _strays(dirs), _strays(dirs)
    assert _probe(client, dirs, 6, saved) == (6 if level in (6, 7) else 5)
    _newest_recovered(ctx, client, dirs, saved).finalize()
    assert not _files(dirs), _files(dirs)
