"""After a recovery from the spares (the newest differential checkpoint damaged past what its L2/L3 redundancy
rebuilds), the next checkpoint of the level is written in full and leaves the spares alone (docs/dcp.md: "the
spares untouched"): the rank files, and at L2 and L3 the spare partner copies and parities too (the checkpoint after
it, once the spares are patched again, ships deltas from them, L2, or updates the parity, L3). On a real
LocalCluster."""

from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask
from ftidask.storage.files import find_paths

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]
NWORKERS = 3
BLOCK = 512


@pytest.fixture
def client(dask_client):
    return dask_client


def _init(client, dirs):
    return ftidask.init(client=client, enable_dcp=1, dcp_block_size=BLOCK, group_size=3, **dirs)


def _step(ctx, k):
    field = ctx.protected[1]
    ctx.protect(1, da.where(da.arange(96)[:, None] == 5 * k, field + k, field))


def _state(ctx):
    return {vid: a.compute().tobytes() for vid, a in ctx.protected.items()}


def _spares(dirs, level):
    """Every spare of the level (rank files, partner copies, parities and their records): bytes by path."""
    return {str(p): Path(p).read_bytes() for p in find_paths(dirs["ckpt_dir"], f"l{level - 4}/dcp/Spare*")}


def _damage(dirs, ckpt_id, level):
    """Past what the level rebuilds: L2 rank 1's file and the copy of it its partner holds; L3 rank 1's file and
    every parity file."""
    names = [f"Ckpt{ckpt_id}-Rank1.fti"] + ([f"Ckpt{ckpt_id}-Pcof2.fti"] if level == 6 else
                                           [f"Ckpt{ckpt_id}-RSed{r}.fti" for r in range(3)])
    for name in names:
        (path,) = find_paths(dirs["ckpt_dir"], f"ckpt{ckpt_id}.s*/{name}")
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0x5A
        Path(path).write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("level", [6, 7])
def test_the_checkpoint_after_a_fallback_leaves_every_spare_alone(client, dirs, level):
    ctx = _init(client, dirs)
    ctx.protect(1, da.random.default_rng(level).random((96, 64), chunks=(32, 64)), name="field")
    saved = {}
    for k in (1, 2, 3):
        _step(ctx, k)
        ctx.checkpoint(k, level)
        saved[k] = _state(ctx)
    kinds = {Path(p).name.split("-")[0] for p in _spares(dirs, level)}
    assert kinds == ({"Spare", "SparePcof"} if level == 6 else {"Spare", "SpareRSed"}), kinds
    _damage(dirs, 3, level)
    ctx._close()

    ctx = _init(client, dirs)
    out = ctx.recover()
    assert ctx.recovered_from == (2, level - 4)
    assert {v: a.compute().tobytes() for v, a in out.items()} == saved[2]
    spares = _spares(dirs, level)
    _step(ctx, 4)
    info = ctx.checkpoint(4, level)
    assert info.blocks_changed == info.blocks_total  # written in full beside the spares
    assert _spares(dirs, level) == spares, "the checkpoint after a fallback changed the spares"
    saved[4] = _state(ctx)
    ctx._close()
    ctx = _init(client, dirs)
    out = ctx.recover()
    assert ctx.recovered_from == (4, level - 4)
    assert {v: a.compute().tobytes() for v, a in out.items()} == saved[4]
    ctx.finalize()
