"""A differential (dCP) checkpoint restarted on another number of ranks: each new rank reads and checks only the
blocks of the old files that its pieces touch (each block against its digest, the digests against the container
hashes), not every old file it opens, checked whole and then loaded whole into a buffer. Damage in a block that only
one new rank reads is still found before any array is touched, and every rank refuses alike. The ranks are threads
over the real engine (``run_ranks``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff import blockhash, reader
from ftidask.model.config import load_config
from ftidask.model.errors import FormatError, NoCheckpointError
from ftidask.storage.files import find_paths

OLD, NEW = 2, 3
N = 300_000  # float64 elements of the global array: 2.3 MiB, 1.1 MiB a old rank
BLOCK = 4096


def config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=OLD, enable_dcp=1, dcp_block_size=BLOCK, verbosity=4)


def values(version: int) -> np.ndarray:
    return np.random.default_rng(version).random(N)


def block(rank: int, size: int) -> slice:
    return slice(N * rank // size, N * (rank + 1) // size)


def write(base: Path, versions: list[int]) -> None:
    """dCP checkpoints (level 5) of ``versions`` in order, on OLD ranks: the last ones patch the files of earlier."""
    def step(t) -> None:
        ctx = Context(config(base), t)
        mine = block(t.rank, OLD)
        a = values(versions[0])[mine].copy()
        ctx.protect(1, a, global_shape=(N,), offset=(mine.start,))
        for ckpt_id in versions:
            a[...] = values(ckpt_id)[mine]
            ctx.checkpoint(ckpt_id, 5)
        ctx._close()

    assert run_ranks(config(base), OLD, step, wait=120)[1] == []


@pytest.fixture
def hashed(monkeypatch):
    """Bytes passed to the dCP block hash, by thread (each rank is one thread; its reads run on it)."""
    counts: dict[int, int] = {}
    lock = threading.Lock()
    digests = blockhash.block_digests

    def counting(data, *args, **kwargs):
        with lock:
            counts[threading.get_ident()] = counts.get(threading.get_ident(), 0) + len(data)
        return digests(data, *args, **kwargs)

    monkeypatch.setattr(blockhash, "block_digests", counting)
    return counts


def recover(base: Path, fresh: bool) -> tuple[list, list[str]]:
    def step(t):
        ctx = Context(config(base), t)
        mine = block(t.rank, NEW)
        a = np.empty(mine.stop - mine.start) if fresh else np.full(mine.stop - mine.start, 7.0)
        ctx.protect(1, a, global_shape=(N,), offset=(mine.start,))
        try:
            ctx.recover()
        except NoCheckpointError as exc:
            return {"error": str(exc), "untouched": fresh or bool((a == 7.0).all())}
        finally:
            ctx._close()
        return {"from": ctx.recovered_from, "data": a}

    return run_ranks(config(base), NEW, step, wait=120)


@pytest.mark.parametrize("fresh", [True, False])
def test_each_rank_checks_the_blocks_it_reads_and_no_more(tmp_path, hashed, fresh):
    write(tmp_path, [1, 2, 3])  # checkpoint 3 patched the files of checkpoint 1
    hashed.clear()
    results, errors = recover(tmp_path, fresh)
    assert errors == []
    for rank, got in enumerate(results):
        assert got["from"] == (3, 1) and np.array_equal(got["data"], values(3)[block(rank, NEW)])
    # Every byte of the state hashed about once over the ranks: a block cut between two new ranks by both, nothing
    # else twice. Before, each rank checked every old file it opened whole (rank 1 both of them), then loaded it.
    total = sum(hashed.values())
    assert N * 8 <= total <= N * 8 + 2 * (NEW - 1) * BLOCK, (total, N * 8)


def test_a_damaged_block_one_rank_reads_is_refused_on_every_rank(tmp_path):
    """Checkpoint 1 (full dCP file) and 2 (the other file); a block in the middle of old rank 0's newest file, read by
    new rank 1 only (its piece starts at N/3), damaged: every rank refuses checkpoint 2 before touching its array and
    recovers checkpoint 1, bit for bit."""
    write(tmp_path, [1, 2])
    path = next(iter(find_paths(tmp_path / "Local", "Ckpt2-Rank0.fti")))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
    (meta,) = [m for _b, _c, m in parsed.containers() if m.id == 1 and m.hascontent]
    raw = bytearray(path.read_bytes())
    raw[meta.fptr + (N // 3 + N // 12) * 8] ^= 0x5A  # inside new rank 1's piece, in old rank 0's block
    path.write_bytes(bytes(raw))
    with open(path, "rb") as fh, pytest.raises(FormatError, match="data block .* does not match its hash"):
        reader.verify_data(fh, parsed)  # a data block (not the metadata) is what is damaged
    results, errors = recover(tmp_path, fresh=False)
    assert errors == []
    for rank, got in enumerate(results):
        assert got.get("from") == (1, 1), got.get("error")
        assert np.array_equal(got["data"], values(1)[block(rank, NEW)])


def test_any_byte_range_of_a_container_is_read_and_checked_block_by_block(tmp_path):
    """``read_blocks_checked`` on ranges that start and end anywhere (inside a block, on an edge, at the container's
    short last block): the bytes of the range, the whole blocks inside read straight into the buffer; a damaged block
    refused exactly when the range touches it."""
    import ftidask

    data = np.random.default_rng(7).random(10_000 + 3)  # 80,024 bytes: 19 blocks of 4 KiB and a short one
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       enable_dcp=1, dcp_block_size=BLOCK, verbosity=3)
    ctx.protect(1, data)
    ctx.checkpoint(1, 5)
    ctx._close()
    path = next(iter(find_paths(tmp_path / "L", "Ckpt1-Rank0.fti")))
    raw = data.view(np.uint8)
    size = raw.size
    cases = [(0, size), (1, size - 1), (BLOCK, 3 * BLOCK), (BLOCK - 1, BLOCK + 1), (5, 9), (size - 7, size),
             (19 * BLOCK, size), (19 * BLOCK + 3, size - 2), (0, BLOCK), (2 * BLOCK + 9, 7 * BLOCK)]
    rng = np.random.default_rng(1)
    cases += [tuple(sorted(rng.integers(0, size + 1, 2))) for _ in range(20)]

    def read(lo, hi):
        with open(path, "rb") as fh:
            parsed = reader.parse_ftiff(fh, str(path))
            ((bi, ci, meta),) = [(b, c, m) for b, c, m in parsed.containers() if m.hascontent]
            out = bytearray(hi - lo)
            blockhash.read_blocks_checked(fh, parsed, (bi, ci), meta, lo, hi, memoryview(out))
            return bytes(out), meta

    for lo, hi in cases:
        got, meta = read(int(lo), int(hi))
        assert got == raw[lo:hi].tobytes(), (lo, hi)
    damaged = 6  # one byte of block 6 flipped
    blob = bytearray(path.read_bytes())
    blob[meta.fptr + damaged * BLOCK + 100] ^= 0x01
    path.write_bytes(bytes(blob))
    for lo, hi in cases:
        touches = lo < hi and lo < (damaged + 1) * BLOCK and hi > damaged * BLOCK
        if touches:
            with pytest.raises(FormatError, match=f"data block {damaged} does not match"):
                read(int(lo), int(hi))
        else:
            assert read(int(lo), int(hi))[0] == raw[lo:hi].tobytes(), (lo, hi)
