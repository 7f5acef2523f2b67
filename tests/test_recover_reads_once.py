"""A restart reads each byte once: with nothing lost, only the ranks' own files are opened (no partner
copy, no parity), and every byte is verified before an array holds it, on every path: the copy after
verification, the staged pages moved under fresh arrays (ftidask.engine.pagemove), a rebuild from
redundancy. Issue 16, item 3.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from recovery_counts import counting_checks

import ftidask
from ftidask.api.context import Context
from ftidask.engine import pagemove
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff import compression, hashing, reader, readhash
from ftidask.model.config import load_config
from ftidask.model.errors import NoCheckpointError
from ftidask.storage.files import find_paths

NRANKS = 4
_opened: list[list[str]] = []  # every file opened while a list is installed (an audit hook sees all threads)


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened and isinstance(args[0], (str, bytes, Path)):
        _opened[-1].append(str(args[0]))


sys.addaudithook(_audit)


def config(base: Path) -> dict:
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"),
            "local_test": 1, "node_size": 1, "group_size": NRANKS, "block_size": 1, "transfer_size": 1,
            "verbosity": 4}


def values(rank: int, version: int) -> np.ndarray:
    return np.random.default_rng(rank).random(5000 + 1000 * rank) + version


def write(base: Path, versions: list[tuple[int, int]]) -> None:
    """Checkpoints (id, level) in order, 4 ranks as threads; the id is also the values' version."""
    def step(t):
        ctx = Context(cfg, t)
        a = np.zeros_like(values(t.rank, 0))
        ctx.protect(1, a)
        for ckpt_id, level in versions:
            a[...] = values(t.rank, ckpt_id)
            ctx.checkpoint(ckpt_id, level)

    cfg = load_config(None, **config(base))
    assert run_ranks(cfg, NRANKS, step, wait=60)[1] == []


def recover(base: Path) -> tuple[list[dict], list[str]]:
    """Every rank's recovery into arrays of 7s: what it recovered (bit for bit?) or its error; the paths opened."""
    def step(t):
        ctx = Context(cfg, t)
        a = np.full_like(values(t.rank, 0), 7)
        ctx.protect(1, a)
        try:
            ctx.recover()
        except NoCheckpointError:
            return {"error": "NoCheckpointError", "untouched": bool((a == 7).all())}
        return {"from": ctx.recovered_from, "exact": np.array_equal(a, values(t.rank, ctx.recovered_from[0]))}

    cfg = load_config(None, **config(base))
    _opened.append([])
    try:
        results, errors = run_ranks(cfg, NRANKS, step, wait=60)
        return results, _opened[-1]
    finally:
        _opened.pop()
        assert errors == [], errors


def latest(base: Path, name: str) -> list[Path]:
    return sorted(p for p in base.glob(f"Local/**/ckpt3.s*/{name}") if p.is_file())


def is_redundancy(path: str) -> bool:
    return "Pcof" in path or "RSed" in path


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    for at in (len(raw) // 3, len(raw) // 2, len(raw) - 20):
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("level", [2, 3])
def test_nothing_lost_reads_the_own_files_only(tmp_path, level):
    """Every partner copy or parity corrupted (sizes kept), every own file sound: the recovery succeeds from
    the own files, opens no redundancy file, and rewrites nothing (the redundancy is left to the next checkpoint)."""
    write(tmp_path, [(3, level)])
    red = latest(tmp_path, "Ckpt3-Pcof*.fti" if level == 2 else "Ckpt3-RSed*.fti*")
    assert len(red) == NRANKS * (1 if level == 2 else 2)  # L3: each parity and its .hash record
    for path in red:
        flip(path)
    before = {p: p.read_bytes() for p in red}
    results, opened = recover(tmp_path)
    assert results == [{"from": (3, level), "exact": True}] * NRANKS
    assert [p for p in opened if is_redundancy(p)] == []
    assert all(p.read_bytes() == b for p, b in before.items())


@pytest.mark.parametrize("level", [2, 3])
def test_erased_redundancy_is_rebuilt_at_restart(tmp_path, level):
    """Every partner copy or parity erased (a stat finds it), every own file sound: the recovery rebuilds them,
    so that the checkpoint then survives the loss of the own files, as FTI's does (its ckpt_consistency
    check: partner files erased, restart, crash, every rank file erased, restart)."""
    write(tmp_path, [(3, level)])
    red = latest(tmp_path, "Ckpt3-Pcof*.fti" if level == 2 else "Ckpt3-RSed*.fti*")
    before = {p: p.read_bytes() for p in red}
    for path in red:
        path.unlink()
    results, _opened = recover(tmp_path)
    assert results == [{"from": (3, level), "exact": True}] * NRANKS
    for path in red:  # the same parity or copy as the checkpoint wrote (a rebuilt .hash names no fb_hashes)
        if path.suffix == ".hash":
            got, was = json.loads(path.read_text()), json.loads(before[path])
            assert (got["hash"], got["size"]) == (was["hash"], was["size"])
        else:
            assert path.read_bytes() == before[path]
    own = latest(tmp_path, "Ckpt3-Rank*.fti")
    for path in own[:2] if level == 3 else own[::2]:  # L3: half the group; L2: non-adjacent ranks
        path.unlink()
    results, _opened = recover(tmp_path)
    assert results == [{"from": (3, level), "exact": True}] * NRANKS


def test_a_rebuild_is_verified_before_the_arrays_are_touched(tmp_path):
    """A damaged own file is rebuilt from parity; a parity damaged in a way its own record cannot see (record
    rewritten to match) gives a wrong rebuild, which the file's hashes refuse: the arrays get the older
    checkpoint bit for bit, never a byte of the bad rebuild."""
    write(tmp_path, [(1, 4), (3, 3)])
    flip(latest(tmp_path, "Ckpt3-Rank0.fti")[0])
    parity = latest(tmp_path, "Ckpt3-RSed0.fti")[0]  # the first parity a rebuild of member 0 uses
    flip(parity)
    record_path = parity.with_name(parity.name + ".hash")
    record = json.loads(record_path.read_text())
    record["hash"] = hashing.new_hasher(record["hash_id"])
    record["hash"].update(parity.read_bytes())
    record["hash"] = record["hash"].hexdigest()
    record_path.write_text(json.dumps(record))
    results, opened = recover(tmp_path)
    assert any(is_redundancy(p) for p in opened)  # the loss needed the parity
    assert results == [{"from": (1, 4), "exact": True}] * NRANKS


def test_a_damaged_own_file_is_rebuilt_and_recovered(tmp_path):
    write(tmp_path, [(3, 2)])
    flip(latest(tmp_path, "Ckpt3-Rank2.fti")[0])
    results, opened = recover(tmp_path)
    assert results == [{"from": (3, 2), "exact": True}] * NRANKS
    assert any("Pcof" in p for p in opened)


# --- fresh arrays: verified pages moved under them (ftidask.engine.pagemove) -----------------------------

BIG = 4_400_000  # float64s: 35 MiB, above glibc's largest mmap threshold, so a new array is always fresh pages


def fresh(n: int, dtype=np.float64) -> np.ndarray:
    """A new array of untouched pages (when above 32 MiB). Above glibc's largest mmap threshold malloc maps
    fresh pages, unless its heap's free top is larger than the array (freed memory of earlier tests in this
    process): such an allocation is kept while the next one is tried, so that malloc must map pages."""
    kept = []
    for _ in range(8):
        out = np.empty(n, dtype)
        if n * out.itemsize < (32 << 20) or pagemove.movable(out):
            return out
        kept.append(out)
    raise AssertionError(f"malloc gave no untouched pages for {n} x {np.dtype(dtype)}")


def flip_data(path: Path) -> None:
    """Flip one byte in the middle of the file: in a container's data, same size."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))


def checkpointed(dirs: dict, arrays: list[np.ndarray], level: int = 1) -> None:
    ctx = ftidask.init(**dirs)
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a)
    ctx.checkpoint(1, level)
    ctx._close()  # as a job that ends: the checkpoint stays (finalize would remove it)


def test_fresh_arrays_get_verified_pages_moved_under_them(dirs, small_moves):
    data = [np.random.default_rng(i).random(BIG + 333 * i) for i in range(2)] + [np.arange(10)]
    checkpointed(dirs, data)
    ctx = ftidask.init(**dirs)
    out = [fresh(a.size, a.dtype) for a in data]
    assert not pagemove.movable(out[2])  # the small one is copied
    for i, a in enumerate(out):
        ctx.protect(i + 1, a)
    ctx.recover()
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    assert pagemove.stats["moved_bytes"] >= 2 * (BIG * 8 - 8192)
    out[0][:] = 1.5  # the moved pages are ordinary memory of the array: written, checkpointed, recovered
    ctx.checkpoint(2, 1)
    again = [fresh(a.size, a.dtype) for a in data]
    for i, a in enumerate(again):
        ctx.protect(i + 1, a)
    ctx.recover()
    assert (again[0] == 1.5).all() and np.array_equal(again[1], data[1])
    ctx.finalize()
    # malloc's realloc cannot mremap a chunk now made of several mappings: it falls back to a copy
    out[1].resize(BIG * 2, refcheck=False)
    assert np.array_equal(out[1][:data[1].size], data[1])


@pytest.mark.parametrize("damage", ["data", "truncate"])
def test_a_damaged_file_leaves_fresh_arrays_untouched(dirs, small_moves, damage):
    """The file is read into staged pages and fails its hash: not a byte reaches the arrays, whose pages are
    still never touched (pagemap), and nothing was moved."""
    checkpointed(dirs, [np.random.default_rng(0).random(BIG)])
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    if damage == "data":
        flip_data(path)
    else:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
    ctx = ftidask.init(**dirs)
    a = fresh(BIG)
    ctx.protect(1, a)
    with pytest.raises(NoCheckpointError):
        ctx.recover()
    assert pagemove.stats["moved_bytes"] == 0
    assert pagemove.movable(a)  # every whole page still never touched
    assert not a.any()


def _rchar() -> int:
    """Bytes this process has read with read(2) and its kind so far (/proc/self/io; page cache hits included)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


def _protect_fresh(ctx, like: list[np.ndarray]) -> list[np.ndarray]:
    """Fresh arrays (untouched pages) the sizes of ``like``, protected under ids 1, 2, ..."""
    out = [fresh(a.size) for a in like]
    for i, a in enumerate(out):
        ctx.protect(i + 1, a)
    return out


def test_a_differential_file_is_read_once_into_fresh_arrays(dirs, small_moves):
    """A dCP file (level 5) was checked whole, block by block, then copied into the arrays: read twice. Into fresh
    arrays it is now read once, into staged pages, each block checked against its digest as it arrives (the digests
    against the container hashes first), then moved under the arrays: here a file patched by a later checkpoint."""
    dirs = dict(dirs, enable_dcp=1, dcp_block_size=4096)
    data = [np.random.default_rng(i).random(BIG + 333 * i) for i in range(2)]
    ctx = ftidask.init(**dirs)
    for i, a in enumerate(data):
        ctx.protect(i + 1, a)
    ctx.checkpoint(1, 5)
    ctx.checkpoint(2, 5)  # the second of the two alternating files
    data[1][1000:2000] += 1.0
    info = ctx.checkpoint(3, 5)  # the first file patched: these blocks only
    assert 0 < info.blocks_changed < info.blocks_total
    ctx._close()
    restart = ftidask.init(**dirs)
    out = _protect_fresh(restart, data)
    before = _rchar()
    restart.recover()
    read = _rchar() - before
    assert restart.recovered_from == (3, 1)  # a dCP checkpoint is recorded at its base level, as FTI does
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    nbytes = sum(a.nbytes for a in data)
    assert pagemove.stats["moved_bytes"] >= nbytes - 2 * 8192
    assert nbytes <= read < 1.1 * nbytes, read / nbytes  # once (2.0x before), the table and digests beside it
    out[0][-3000:] = 2.5  # the moved pages are the arrays' own: the next differential checkpoint sees this change
    info = restart.checkpoint(4, 5)
    assert 0 < info.blocks_changed < info.blocks_total
    restart._close()
    again = ftidask.init(**dirs)
    last = _protect_fresh(again, data)
    again.recover()
    assert again.recovered_from == (4, 1) and all(np.array_equal(a, b) for a, b in zip(last, out))


@pytest.mark.parametrize("damage", ["data", "digests"])
def test_a_damaged_differential_file_leaves_fresh_arrays_untouched(dirs, small_moves, damage):
    """A data block, or a block digest (the block-hash section, before the table), changed in the only dCP
    checkpoint: refused while staged, not a byte moved under the arrays, whose pages stay untouched."""
    dirs = dict(dirs, enable_dcp=1, dcp_block_size=4096)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.random.default_rng(0).random(BIG))
    ctx.checkpoint(1, 5)
    ctx._close()
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 if damage == "data" else parsed.fb.fs + 100] ^= 0x5A
    path.write_bytes(bytes(raw))
    restart = ftidask.init(**dirs)
    a = fresh(BIG)
    restart.protect(1, a)
    with pytest.raises(NoCheckpointError, match="does not match" if damage == "data" else "block hashes"):
        restart.recover()
    assert pagemove.stats["moved_bytes"] == 0 and pagemove.movable(a) and not a.any()


def test_a_damaged_newest_differential_file_falls_back_into_fresh_arrays(dirs, small_moves):
    """The newest dCP file fails a block digest while staged: its pages are dropped and the older file (the
    previous checkpoint) is read into new staged pages, moved under the fresh arrays bit for bit."""
    dirs = dict(dirs, enable_dcp=1, dcp_block_size=4096)
    data = np.random.default_rng(4).random(BIG)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, data)
    ctx.checkpoint(1, 5)
    older = data.copy()
    data[:5000] += 1.0
    ctx.checkpoint(2, 5)
    ctx._close()
    flip_data(next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti"))))
    restart = ftidask.init(**dirs)
    a = fresh(BIG)
    restart.protect(1, a)
    restart.recover()
    assert restart.recovered_from == (1, 1) and np.array_equal(a, older)
    assert pagemove.stats["moved_bytes"] >= BIG * 8 - 8192


def _compressible(n: int, seed: int) -> np.ndarray:
    """A random walk rounded to 2 decimals: zstd shrinks it, to about a third."""
    return np.round(np.cumsum(np.random.default_rng(seed).standard_normal(n)), 2)


def test_compressed_variables_are_decoded_once_into_fresh_arrays(dirs, small_moves, monkeypatch):
    """A compressed variable was decoded twice in a recovery: once to check that it decodes (before any array
    is touched), then again into the array. Into fresh arrays, each container is now read, hashed and decoded
    once, into the staged pages moved under the array; a container stored raw (incompressible) is copied."""
    grown, noise = _compressible(BIG, 0), np.random.default_rng(1).integers(0, 256, BIG, np.uint8)
    ctx = ftidask.init(**dirs, compressor="zstd")
    ctx.protect(1, grown[:BIG // 2].copy())
    ctx.protect(2, noise)
    ctx.checkpoint(1, 1)
    ctx.protect(1, grown)  # grown: a second container, in an appended block
    ctx.checkpoint(2, 1)
    ctx._close()
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
    plain = {vid: compression.plain_ids(info.extra) for vid, info in parsed.vars.items()}
    packed = [m for _b, _c, m in parsed.containers() if m.hascontent and m.containerid not in plain[m.id]]
    assert len(packed) == 2 and plain[2]  # var 1's two containers compressed, var 2's stored raw
    calls, checks = [], []
    decode, read = compression.decode_container, readhash.read_decoded_into
    # the verification's decoding (decode_container) never runs; each container is read and decoded into the staged
    # pages once (a few frames at a time, hashed as they are read)
    monkeypatch.setattr(compression, "decode_container", lambda *a, **k: checks.append(1) or decode(*a, **k))
    monkeypatch.setattr(readhash, "read_decoded_into", lambda *a, **k: calls.append(1) or read(*a, **k))
    restart = ftidask.init(**dirs)
    out = [fresh(BIG), fresh(BIG, np.uint8)]
    restart.protect(1, out[0])
    restart.protect(2, out[1])
    restart.recover()
    assert np.array_equal(out[0], grown) and np.array_equal(out[1], noise)
    assert len(calls) == len(packed) and not checks
    assert pagemove.stats["moved_bytes"] >= BIG * 8 - 8192


def test_a_compressed_container_that_does_not_decode_leaves_fresh_arrays_untouched(dirs, small_moves):
    """Hashes match (a forged file) but the bytes do not decode: refused while staged, nothing moved."""
    from test_hostile_inputs import forge_committed

    ctx = ftidask.init(**dirs, compressor="zstd")
    ctx.protect(1, _compressible(BIG, 2))
    info = ctx.checkpoint(1, 1)
    ctx._close()
    forge_committed(dirs, info.seq, 1, bytes(64))
    restart = ftidask.init(**dirs)
    a = fresh(BIG)
    restart.protect(1, a)
    with pytest.raises(NoCheckpointError, match="cannot be decoded"):
        restart.recover()
    assert pagemove.stats["moved_bytes"] == 0 and pagemove.movable(a) and not a.any()


def test_touched_and_foreign_arrays_are_copied(dirs, small_moves, tmp_path):
    shape = (2200, 2000)  # BIG float64s
    data = [np.random.default_rng(i).random(shape) for i in range(4)]
    checkpointed(dirs, data)
    touched = np.ones(shape)
    mapped = np.memmap(tmp_path / "m.bin", dtype=np.float64, mode="w+", shape=shape)
    fortran = np.asfortranarray(fresh(BIG).reshape(shape))  # fresh, but not in the stored (C) order
    untouched = fresh(BIG).reshape(shape)
    assert not any(pagemove.movable(x) for x in (touched, mapped, fortran, np.frombuffer(bytearray(1 << 21))))
    ctx = ftidask.init(**dirs)
    for i, a in enumerate([touched, mapped, fortran, untouched]):
        ctx.protect(i + 1, a)
    ctx.recover(ids=[1, 2, 3])  # only these: the fourth stays as it is
    assert all(np.array_equal(a, b) for a, b in zip([touched, mapped, fortran], data))
    assert pagemove.stats["moved_bytes"] == 0 and pagemove.movable(untouched)


def test_a_failed_consensus_leaves_every_ranks_fresh_arrays_untouched(tmp_path):
    """Rank 2's file is damaged and nothing older exists: ranks 0, 1 and 3 verified theirs into staged pages,
    which they drop; every rank's arrays stay as they were."""
    if not pagemove.enabled:
        pytest.skip("no native page_move in this build")
    big = lambda rank, version: np.random.default_rng(rank).random(BIG) + version  # noqa: E731
    cfg = load_config(None, **config(tmp_path))

    def write_step(t):
        ctx = Context(cfg, t)
        ctx.protect(1, big(t.rank, 3))
        ctx.checkpoint(3, 1)

    assert run_ranks(cfg, NRANKS, write_step, wait=60)[1] == []
    flip_data(latest(tmp_path, "Ckpt3-Rank2.fti")[0])

    def recover_step(t):
        ctx = Context(cfg, t)
        a = fresh(BIG)
        staged = pagemove.movable(a)
        ctx.protect(1, a)
        with pytest.raises(NoCheckpointError):
            ctx.recover()
        return staged, pagemove.movable(a), bool((a == 0).all())

    results, errors = run_ranks(cfg, NRANKS, recover_step, wait=60)
    assert errors == []
    assert results == [(True, True, True)] * NRANKS  # staged, dropped: every array's pages still never touched


# --- the copy after verification ----------------------------------------------------------------------------

@pytest.mark.parametrize("dcp", [False, True])
def test_the_parallel_copy_fills_every_byte_and_sees_a_truncated_file(dirs, monkeypatch, dcp):
    """Plain and dCP files alike: arrays with a zero-copy view get the verified bytes by the parallel copy."""
    monkeypatch.setattr(reader, "_COPY_PIECE", 4096 * 3)
    monkeypatch.setattr(reader, "_COPY_THREADS", 3)
    data = [np.random.default_rng(i).random(10_000 + i) for i in range(3)]
    if dcp:
        dirs = dict(dirs, enable_dcp=1, dcp_block_size=512)
    checkpointed(dirs, data, level=5 if dcp else 1)
    ctx = ftidask.init(**dirs)
    out = [np.ones_like(a) for a in data]
    for i, a in enumerate(out):
        ctx.protect(i + 1, a)
    ctx.recover()
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
        reader.verify_data(fh, parsed)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 30_000)
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="changed|modified"):
        reader.read_into(fh, parsed, {1: _Bytes(out[0])})


class _Bytes:
    def __init__(self, a: np.ndarray) -> None:
        self.mv = memoryview(a.view(np.uint8))

    def view(self, start: int, stop: int) -> memoryview:
        return self.mv[start:stop]

    def store(self, start: int, data: bytes) -> None:
        self.mv[start:start + len(data)] = data


def test_recover_file_moves_pages_under_fresh_arrays_too(dirs, small_moves):
    data = np.random.default_rng(5).random(BIG)
    checkpointed(dirs, [data])
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    ctx = ftidask.init(**dirs)
    a = fresh(BIG)
    ctx.protect(1, a)
    ctx.recover_file(path)
    assert np.array_equal(a, data) and pagemove.stats["moved_bytes"] >= BIG * 8 - 8192
    flip_data(path)
    b = fresh(BIG)
    ctx.protect(1, b)
    with pytest.raises(ftidask.RecoveryError, match="hash does not match"):
        ctx.recover_file(path)
    assert pagemove.movable(b)


# --- FTI's order: stored_size / realloc (or var_id) before recover -------------------------------------------

def test_stored_size_realloc_then_recover_verifies_the_file_once(dirs, monkeypatch):
    """FTI's restart: FTI_GetStoredSize and FTI_Realloc, then FTI_Recover. The file stored_size verified (its
    search) is loaded as it is by the recovery that follows, not read and hashed a second time."""
    data = np.random.default_rng(3).random(300_000)
    checkpointed(dirs, [data, np.arange(10)])
    checked = counting_checks(monkeypatch)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.zeros(1))
    ctx.protect(2, np.zeros(10, np.int64))
    assert ctx.stored_size(1) == data.nbytes and ctx.var_id("var2", create=False) == 2  # its default name
    a = ctx.realloc(1)
    ctx.recover()
    assert np.array_equal(a, data) and len(checked) == 1
    ctx.recover()  # a second recovery verifies again
    assert np.array_equal(a, data) and len(checked) == 2


@pytest.mark.parametrize("how", ["bytes, times restored", "replaced"])
def test_a_file_changed_after_stored_size_is_verified_again(dirs, monkeypatch, how):
    """Between stored_size and recover the file is damaged, its modification time set back (only the change
    time tells), or replaced by another: the recovery verifies afresh, finds the damage, and touches nothing."""
    import os

    checkpointed(dirs, [np.random.default_rng(4).random(300_000)])
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    checked = counting_checks(monkeypatch)
    ctx = ftidask.init(**dirs)
    a = np.full(300_000, 7.0)
    ctx.protect(1, a)
    assert ctx.stored_size(1) == a.nbytes
    before = path.stat()
    if how == "replaced":
        damaged = path.with_name("other")
        damaged.write_bytes(path.read_bytes())
        flip_data(damaged)
        damaged.rename(path)
    else:
        flip_data(path)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(NoCheckpointError):
        ctx.recover()
    assert (a == 7.0).all() and len(checked) == 2


def test_ranks_verify_again_when_one_rank_file_changed(tmp_path):
    """4 ranks: every rank's stored_size verified its file; one rank's file is then damaged. All ranks take the
    full search (one rank alone skipping it would pair different collectives), and all fail the same way."""
    write(tmp_path, [(1, 1)])
    cfg = load_config(None, **config(tmp_path))
    target = sorted(tmp_path.glob("Local/**/Ckpt1-Rank2.fti"))[0]
    barrier = threading.Barrier(NRANKS)

    def step(t):
        ctx = Context(cfg, t)
        a = np.full_like(values(t.rank, 0), 7)
        ctx.protect(1, a)
        assert ctx.stored_size(1) == a.nbytes
        if barrier.wait() == 0:
            flip_data(target)
        barrier.wait()
        try:
            ctx.recover()
        except NoCheckpointError:
            return "NoCheckpointError", bool((a == 7).all())
        return "recovered", bool(np.array_equal(a, values(t.rank, 1)))

    results, errors = run_ranks(cfg, NRANKS, step, wait=60)
    assert errors == [] and results == [("NoCheckpointError", True)] * NRANKS, results


def test_arrays_in_use_are_told_without_walking_the_process_mappings(monkeypatch):
    """A recovery into arrays already in use (a warm restart, a recover() in a loop) never stages them, and learns
    it from their first pagemap entries: /proc/self/smaps, which walks every resident page of the process, is read
    only for an array that could be staged."""
    calls = []
    real = pagemove._plain_mappings
    monkeypatch.setattr(pagemove, "_plain_mappings", lambda: calls.append(1) or real())
    touched = np.ones(32 << 20, np.uint8)
    assert pagemove.movable_arrays({1: touched, 2: touched[: 20 << 20]}) == {} and not calls
    new = fresh(32 << 20, np.uint8)  # not np.empty: malloc may serve it from a free heap top earlier tests touched
    calls.clear()
    if pagemove.enabled:
        assert list(pagemove.movable_arrays({1: touched, 2: new})) == [2] and calls == [1]
