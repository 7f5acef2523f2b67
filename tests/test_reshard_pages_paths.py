"""The failure paths of a restart on another layout into fresh arrays (ftidask.engine.reshard: their verified pages
staged, then moved under them, pagemove.Staged): a Python state that fails to decode on one rank after every array
was staged, damage on one rank only, an older checkpoint tried after the newest failed, nothing left to recover.
Every rank ends the same way; a refused checkpoint leaves the fresh arrays' pages never touched and the array in use
as it was; a later recovery in the same process takes the verified pages. 4 old ranks on 4 nodes, 4 new ranks on 2
nodes (Python states are not redistributed onto another number of ranks); the ranks are threads over the real
engine (``run_ranks``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from freshpages import map_large_arrays_afresh

import ftidask
from ftidask.api.context import Context
from ftidask.engine import pagemove
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff.reader import parse_ftiff
from ftidask.model.config import load_config
from ftidask.storage.files import find_paths

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not pagemove.enabled, reason="needs the native page helper")]

R = 4
G1 = (2048, 4096)  # float64, old blocks a 2x2 grid: strided pieces into each new rank's 16 MiB of staged pages
G2 = 8 << 20       # float64, 1-D: pieces that are runs of the old streams, read straight into the staged pages
G3 = 1000          # int64, an array in use on restart (verified, then read into after the agreement)


@pytest.fixture(autouse=True)
def _fresh_large_arrays() -> None:
    map_large_arrays_afresh()


def _fresh(shape: tuple[int, ...]) -> np.ndarray:
    """A new float64 array of untouched pages: an allocation malloc served from touched memory all the same is
    kept while the next one is tried (the fixture above makes that rare)."""
    kept = []
    for _ in range(8):
        out = np.empty(shape)
        if pagemove.movable(out):
            return out
        kept.append(out)
    raise AssertionError(f"malloc gave no untouched pages for {shape}")


def _config(base: Path, node_size: int):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=node_size, group_size=2, verbosity=4)


def glob(vid: int, ckpt: int) -> np.ndarray:
    if vid == 1:
        return (np.arange(G1[0] * G1[1], dtype=np.float64) * 0.25 + ckpt).reshape(G1)
    if vid == 2:
        return np.arange(G2, dtype=np.float64) * -1.5 + ckpt
    return np.arange(G3, dtype=np.int64) * 3 + ckpt


def block(vid: int, rank: int, old: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if vid == 1 and old:
        r, c = rank // 2, rank % 2
        return (r * G1[0] // 2, c * G1[1] // 2), (G1[0] // 2, G1[1] // 2)
    n = G1[0] if vid == 1 else G2 if vid == 2 else G3
    lo, hi = n * rank // R, n * (rank + 1) // R
    return ((lo, 0), (hi - lo, G1[1])) if vid == 1 else ((lo,), (hi - lo,))


def _sl(off, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(off, shape))


def _write(base: Path) -> None:
    """Checkpoint 1 (L4, state {"k": 1}) and checkpoint 2 (L1, state 5), by 4 ranks on 4 nodes."""
    def program(t) -> None:
        ctx = Context(_config(base, 1), t)
        arrays = {}
        for vid in (1, 2, 3):
            off, shape = block(vid, t.rank, old=True)
            arrays[vid] = np.empty(shape, np.int64 if vid == 3 else np.float64)
            ctx.protect(vid, arrays[vid], global_shape=glob(vid, 1).shape, offset=off)
        value = ftidask.Value()
        ctx.protect(9, value)
        for ckpt, level, state in ((1, 4, {"k": 1}), (2, 1, 5)):
            for vid, a in arrays.items():
                a[...] = glob(vid, ckpt)[_sl(*block(vid, t.rank, old=True))]
            value.value = state
            ctx.checkpoint(ckpt, level)
        ctx._close()

    assert run_ranks(_config(base, 1), R, program, wait=240)[1] == []


def _recover(base: Path, dict_on_rank0: bool) -> list:
    """4 ranks on 2 nodes recover into fresh arrays (1, 2), an array in use (3) and a state (rank 0's a dict when
    ``dict_on_rank0``): per rank what was recovered (the checkpoint, each array bit for bit, the pages moved), or
    the error and whether the arrays were left alone."""
    def program(t):
        ctx = Context(_config(base, 2), t)
        arrays = {}
        for vid in (1, 2, 3):
            off, shape = block(vid, t.rank, old=False)
            arrays[vid] = np.full(shape, -7, np.int64) if vid == 3 else _fresh(shape)
            ctx.protect(vid, arrays[vid], global_shape=glob(vid, 1).shape, offset=off)
        state = ftidask.State() if dict_on_rank0 and t.rank == 0 else ftidask.Value()
        ctx.protect(9, state)
        fresh = [pagemove.movable(arrays[vid]) for vid in (1, 2)]
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            return {"error": f"{type(exc).__name__}", "message": str(exc).split(":")[0], "fresh": fresh,
                    "untouched": [pagemove._never_touched(*pagemove._whole_pages(arrays[v])) for v in (1, 2)],
                    "in_use": bool((arrays[3] == -7).all())}
        finally:
            ctx._close()
        ckpt = ctx.recovered_from[0]
        return {"from": ctx.recovered_from, "fresh": fresh,
                "state": dict(state) if isinstance(state, dict) else state.value,
                "equal": [arrays[v].tobytes() == glob(v, ckpt)[_sl(*block(v, t.rank, old=False))].tobytes()
                          for v in (1, 2, 3)]}

    moved = pagemove.stats["moved_bytes"]
    results, errors = run_ranks(_config(base, 2), R, program, wait=240)
    assert errors == [], errors
    return results, pagemove.stats["moved_bytes"] - moved


def _flip(base: Path, name: str, vid: int) -> tuple[Path, int]:
    """One byte of variable ``vid``'s last container in ``name`` flipped (again: flipped back)."""
    (path,) = find_paths(base, name)
    with open(path, "rb") as fh:
        meta = [m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == vid and m.chunksize][-1]
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(meta.fptr + meta.chunksize // 2)
        fh.write(bytes([byte[0] ^ 0x10]))
    return path, meta.fptr


def test_a_state_refused_on_one_rank_after_staging_then_the_older_checkpoint(tmp_path: Path) -> None:
    """Rank 0 protects a dict where checkpoint 2 holds 5: refused after every array was staged, on every rank;
    checkpoint 1 recovered instead, its pages moved under the fresh arrays."""
    _write(tmp_path)
    got, moved = _recover(tmp_path, dict_on_rank0=True)
    for r, res in enumerate(got):
        assert res.get("from") == (1, 4) and res["fresh"] == [True, True] and res["equal"] == [True] * 3, (r, res)
    assert got[0]["state"] == {"k": 1} and all(res["state"] == {"k": 1} for res in got[1:]), got
    assert moved >= R * (G1[0] * G1[1] + G2) * 8 // R - 2 * R * 8192, moved


def test_damage_on_one_rank_then_none_left_then_a_recovery_in_the_same_process(tmp_path: Path) -> None:
    _write(tmp_path)
    # checkpoint 2: old rank 1's block of variable 1 (one new rank reads it); checkpoint 1: old rank 2's variable 2
    _flip(tmp_path / "Local", "Ckpt2-Rank1.fti", 1)
    got, _moved = _recover(tmp_path, dict_on_rank0=False)
    assert all(res.get("from") == (1, 4) and res["equal"] == [True] * 3 for res in got), got
    back = _flip(tmp_path / "Global", "Ckpt1-Rank2.fti", 2)
    got, moved = _recover(tmp_path, dict_on_rank0=False)
    assert moved == 0 and len({res["message"] for res in got}) == 1, got
    for r, res in enumerate(got):
        assert res["error"] == "NoCheckpointError" and res["fresh"] == [True, True], (r, res)
        assert res["untouched"] == [True, True] and res["in_use"], (r, res)
    _flip(tmp_path / "Global", "Ckpt1-Rank2.fti", 2)  # repaired: checkpoint 1 recovered, in this process
    assert back[0].exists()
    got, moved = _recover(tmp_path, dict_on_rank0=False)
    assert all(res.get("from") == (1, 4) and res["equal"] == [True] * 3 for res in got), got
    assert moved > 0
