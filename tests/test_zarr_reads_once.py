"""A level-4 checkpoint written as Zarr is read once at a restart: each chunk file read, hash-checked and decoded
into staged pages moved under fresh arrays (ftidask.engine.pagemove), as for FTI-FF files. Before, the store was
hashed file by file, every compressed chunk decoded again to see that it decodes, then read a third time into the
arrays. A damaged or forged store still touches no array. Issue 16, item 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_hostile_reads3 import _reseal
from test_recover_reads_once import _rchar, fresh

import ftidask
from ftidask.engine import pagemove
from ftidask.model.errors import NoCheckpointError, RecoveryError

pytest.importorskip("zarr")

BIG = 4_400_000  # float64s: 35 MiB, one chunk; fresh pages (test_recover_reads_once.fresh)
GRID = (3000, 3000)  # 72 MB of float64s: above 64 MiB, so Zarr's chunks (375 x 375 here): 64 chunk files


def _compressible(n: int, seed: int) -> np.ndarray:
    return np.round(np.cumsum(np.random.default_rng(seed).standard_normal(n)), 2)


def _checkpoint(dirs: dict, arrays: list[np.ndarray], compressor: str | None = None) -> Path:
    """One level-4 Zarr checkpoint of ``arrays`` (ids 1, 2, ...); the store."""
    ctx = ftidask.init(**dirs, l4_format="zarr", compressor=compressor)
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a)
    ctx.checkpoint(1, 4)
    ctx._close()
    (store,) = Path(dirs["glbl_dir"]).glob("**/Ckpt1-Rank0.zarr")
    return store


def _stored(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def _restart(dirs: dict, like: list[np.ndarray], use: bool = False) -> tuple[ftidask.Context, list[np.ndarray]]:
    """A restart protecting fresh arrays the shapes of ``like`` (``use``: arrays whose pages were written)."""
    ctx = ftidask.init(**dirs, l4_format="zarr")
    out = []
    for i, a in enumerate(like):
        b = np.full(a.shape, -1.0) if use else fresh(a.size, a.dtype).reshape(a.shape)
        ctx.protect(i + 1, b)
        out.append(b)
    return ctx, out


@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_a_zarr_store_is_read_once_into_fresh_arrays(dirs, small_moves, compressor):
    data = [_compressible(BIG, 0), np.random.default_rng(1).random(GRID)]
    store = _checkpoint(dirs, data, compressor)
    manifest = json.loads((store / "ftidask-manifest.json").read_text())
    assert sum(1 for rel in manifest["files"] if rel.count("/c/")) == 1 + 64
    ctx, out = _restart(dirs, data)
    before = _rchar()
    ctx.recover()
    read = _rchar() - before
    assert ctx.recovered_from == (1, 4)
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    stored = _stored(store)
    assert stored <= read < 1.1 * stored, read / stored  # once: 2x before, 3x compressed
    assert pagemove.stats["moved_bytes"] >= sum(a.nbytes for a in data) - 4 * 8192
    out[0][:10] = 7.0  # the moved pages are the arrays' own: checkpointed and recovered again
    ctx.checkpoint(2, 4)
    ctx._close()
    again, last = _restart(dirs, data)
    again.recover()
    assert (last[0][:10] == 7.0).all() and np.array_equal(last[1], data[1])
    again._close()


def test_arrays_in_use_are_verified_then_read(dirs, small_moves):
    """Arrays whose pages were written are never staged: the store is verified, then read into them, each chunk
    checked again (twice in all; a compressed chunk was read three times before)."""
    data = [_compressible(BIG, 2)]
    store = _checkpoint(dirs, data, "zstd")
    ctx, out = _restart(dirs, data, use=True)
    before = _rchar()
    ctx.recover()
    read = _rchar() - before
    assert np.array_equal(out[0], data[0]) and pagemove.stats["moved_bytes"] == 0
    stored = _stored(store)
    assert 2 * stored <= read < 2.1 * stored, read / stored


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["last chunk", "truncated", "missing"])
def test_a_damaged_store_leaves_fresh_arrays_untouched(dirs, small_moves, damage):
    """The first variable is read into staged pages, then a chunk of the second fails: nothing is moved, no
    array's page is touched, and the error says which file."""
    data = [np.random.default_rng(3).random(BIG), np.random.default_rng(4).random(GRID)]
    store = _checkpoint(dirs, data)
    victim = sorted(p for p in store.rglob("c/*/*") if p.is_file())[-1]  # one of the second variable's 64 chunks
    if damage == "last chunk":
        _flip(victim)
    elif damage == "truncated":
        with open(victim, "r+b") as fh:
            fh.truncate(100)
    else:
        victim.unlink()
    ctx, out = _restart(dirs, data)
    with pytest.raises(NoCheckpointError, match=victim.name):
        ctx.recover()
    assert pagemove.stats["moved_bytes"] == 0
    assert all(pagemove.movable(a) and not a.any() for a in out)


def test_a_forged_chunk_that_does_not_decode_leaves_fresh_arrays_untouched(dirs, small_moves):
    """Every hash matches (the manifest and the commit record resealed) but a chunk holds a Zstd frame that does
    not decode: refused while staged, nothing moved."""
    data = [_compressible(BIG, 5)]
    store = _checkpoint(dirs, data, "zstd")
    manifest = json.loads((store / "ftidask-manifest.json").read_text())
    (rel,) = [r for r in manifest["files"] if "/c/" in r]
    raw = bytearray((store / rel).read_bytes())
    raw[len(raw) // 2:] = bytes(len(raw) - len(raw) // 2)  # the header intact, the frame's blocks zeros
    (store / rel).write_bytes(bytes(raw))
    _reseal(dirs, store, manifest)
    ctx, out = _restart(dirs, data)
    with pytest.raises(NoCheckpointError, match="does not decode"):
        ctx.recover()
    assert pagemove.stats["moved_bytes"] == 0 and pagemove.movable(out[0]) and not out[0].any()


def test_recover_file_reads_a_zarr_store_once_into_fresh_arrays(dirs, small_moves):
    data = [np.random.default_rng(6).random(BIG)]
    store = _checkpoint(dirs, data)
    ctx, out = _restart(dirs, data)
    before = _rchar()
    ctx.recover_file(store)
    read = _rchar() - before
    assert np.array_equal(out[0], data[0]) and read < 1.1 * _stored(store)
    assert pagemove.stats["moved_bytes"] >= data[0].nbytes - 8192
    with pytest.raises(RecoveryError):  # a damaged store: refused, the arrays as they were
        _flip(next(p for p in store.rglob("*") if p.is_file() and "/c/" in p.as_posix()))
        other = fresh(BIG)
        ctx.protect(1, other)
        ctx.recover_file(store)
    assert pagemove.movable(other) and not other.any()
