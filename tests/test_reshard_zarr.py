"""A level-4 checkpoint written as Zarr, restarted on another number of ranks: each new rank reads only the chunks
that hold its pieces, each checked against the manifest's digest before it is decoded. Before, every rank verified
each old store it opened whole (decoding every chunk), then loaded its variables whole into buffers of their size.
Damage in a chunk only one new rank reads is still found before any array is touched, and every rank refuses alike.
The ranks are threads over the real engine (``run_ranks``).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from test_recover_reads_once import fresh as untouched

from ftidask.api.context import Context
from ftidask.engine import pagemove, reshard
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff import hashing
from ftidask.model.config import load_config
from ftidask.model.errors import FTIError

pytest.importorskip("zarr")

OLD, NEW = 2, 3
SHAPE = (300, 1000)  # float64: 2.3 MiB, each old rank's block 150 rows
ROWS = 30  # the stores' chunks: 30 rows (5 a old rank), so a new rank's 100 rows cut 4 of them


def config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, l4_format="zarr", keep_l4_ckpt=1, verbosity=4)


def values(version: int) -> np.ndarray:
    return np.random.default_rng(version).random(SHAPE)


def rows(rank: int, size: int) -> slice:
    return slice(SHAPE[0] * rank // size, SHAPE[0] * (rank + 1) // size)


@pytest.fixture
def small_chunks(monkeypatch):
    """Stores written in chunks of ROWS rows (Zarr's default for an array this small: one chunk)."""
    from ftidask.zarrfmt import store

    monkeypatch.setattr(store, "_chunks", lambda info: (ROWS, *info.shape[1:]) if len(info.shape) == 2 else "auto")


def write(base: Path, versions: list[tuple[int, int]]) -> None:
    """Checkpoints (id, level) in order on OLD ranks; the id is also the values' version."""
    def step(t) -> None:
        ctx = Context(config(base), t)
        mine = rows(t.rank, OLD)
        a = np.empty((mine.stop - mine.start, SHAPE[1]))
        ctx.protect(1, a, global_shape=SHAPE, offset=(mine.start, 0))
        for ckpt_id, level in versions:
            a[...] = values(ckpt_id)[mine]
            ctx.checkpoint(ckpt_id, level)
        ctx._close()

    assert run_ranks(config(base), OLD, step, wait=120)[1] == []


def recover(base: Path, fresh: bool) -> list:
    def step(t):
        ctx = Context(config(base), t)
        mine = rows(t.rank, NEW)
        n = (mine.stop - mine.start) * SHAPE[1]
        a = (untouched(n) if fresh else np.full(n, 7.0)).reshape(mine.stop - mine.start, SHAPE[1])
        ctx.protect(1, a, global_shape=SHAPE, offset=(mine.start, 0))
        try:
            ctx.recover()
        except FTIError as exc:  # NoCheckpointError, or RecoveryError after the agreement
            return {"error": f"{type(exc).__name__}: {exc}", "untouched": fresh or bool((a == 7.0).all())}
        finally:
            ctx._close()
        return {"from": ctx.recovered_from, "data": a}

    results, errors = run_ranks(config(base), NEW, step, wait=120)
    assert errors == []
    return results


@pytest.fixture
def hashed(monkeypatch):
    """Bytes of chunks hash-checked as they are read (the verified store's one-shot digests above 8 KiB; the
    metadata and the manifest are smaller), over every thread."""
    total = [0]
    lock = threading.Lock()
    digest = hashing.digest

    def counting(hid, data, *args, **kwargs):
        if len(data) > 8192:
            with lock:
                total[0] += len(data)
        return digest(hid, data, *args, **kwargs)

    monkeypatch.setattr(hashing, "digest", counting)
    return total


def _chunk_files(base: Path, ckpt_id: int) -> list[Path]:
    return sorted(p for p in (base / "Global").glob(f"*/l4/ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-Rank*.zarr/*/c/*/*"))


@pytest.mark.parametrize("fresh", [True, False])
def test_each_rank_reads_the_chunks_of_its_pieces_and_no_more(tmp_path, small_chunks, small_moves, hashed, fresh,
                                                              monkeypatch):
    """12 chunk reads of the 10 (the two chunks cut between new ranks read by both) into fresh arrays' staged pages;
    into arrays in use, no buffer of their size: each chunk checked (read and decoded), then read again after the
    agreement, 24. Before: each store verified whole by each rank that opened it (rank 1 both), every variable then
    read whole again into a buffer of its size: 40."""
    if fresh:  # each new rank's block above 32 MiB: fresh pages from malloc (test_recover_reads_once.fresh)
        monkeypatch.setattr(sys.modules[__name__], "SHAPE", (300, 42_000))
    write(tmp_path, [(1, 4)])
    chunks = _chunk_files(tmp_path, 1)
    assert len(chunks) == 2 * 5
    hashed[0] = 0
    for rank, got in enumerate(recover(tmp_path, fresh)):
        assert got["from"] == (1, 4), got.get("error")
        assert np.array_equal(got["data"], values(1)[rows(rank, NEW)])
    stored = sum(p.stat().st_size for p in chunks)
    reads = 12 if fresh else 24
    assert stored * (reads - 2) / 10 <= hashed[0] <= stored * reads / 10 + 1024, (hashed[0], stored)
    if fresh:
        assert pagemove.stats["moved_bytes"] >= 8 * SHAPE[0] * SHAPE[1] - NEW * 2 * 4096


def test_a_damaged_chunk_one_rank_reads_is_refused_on_every_rank(tmp_path, small_chunks):
    """Checkpoints 1 and 2 (level 4, both kept: keep_l4_ckpt); old rank 1's last chunk of checkpoint 2, which new rank
    2 alone reads, damaged: every rank refuses checkpoint 2 before touching its array and recovers checkpoint 1, bit
    for bit."""
    write(tmp_path, [(1, 4), (2, 4)])
    victim = _chunk_files(tmp_path, 2)[-1]
    assert "Rank1.zarr" in str(victim)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    victim.write_bytes(bytes(raw))
    for rank, got in enumerate(recover(tmp_path, fresh=False)):
        assert got.get("from") == (1, 4), got.get("error")
        assert np.array_equal(got["data"], values(1)[rows(rank, NEW)])


def test_a_chunk_changed_after_the_agreement_fails_on_every_rank(tmp_path, small_chunks, monkeypatch):
    """Arrays in use: every rank checked the chunks of its pieces and agreed; then old rank 1's last chunk changes
    before they are read into the arrays (the seam ``reshard.BEFORE_LOAD``): the rank that reads it finds it changed
    as it reads it again (each chunk checked against its digest once more), and every rank raises the same error.
    Restored, a new recovery reads it."""
    write(tmp_path, [(1, 4)])
    victim = _chunk_files(tmp_path, 1)[-1]
    saved = victim.read_bytes()
    once = threading.Lock()

    def change() -> None:
        with once:
            if victim.read_bytes() == saved:
                victim.write_bytes(saved[:-1] + bytes([saved[-1] ^ 0x40]))

    monkeypatch.setattr(reshard, "BEFORE_LOAD", change)
    got = recover(tmp_path, fresh=False)
    assert len({r["error"] for r in got}) == 1, got
    assert got[0]["error"].startswith("RecoveryError") and "failed while loading" in got[0]["error"], got[0]
    assert "does not match its hash" in got[0]["error"]
    monkeypatch.setattr(reshard, "BEFORE_LOAD", None)
    victim.write_bytes(saved)
    for rank, r in enumerate(recover(tmp_path, fresh=False)):
        assert r.get("from") == (1, 4) and np.array_equal(r["data"], values(1)[rows(rank, NEW)]), r.get("error")
