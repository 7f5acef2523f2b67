"""Differential and incremental checkpoints on a real LocalCluster (worker processes, real kills)."""

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")


from conftest import wait_for_replaced_workers
from test_dask_backend import crash_worker, lose_workers

import ftidask
from ftidask.ftiff.blockhash import FLAG_DCP
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.storage.files import find_paths

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 4
BLOCK = 1024


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster, restored after the tests that kill workers (conftest.py)


def _init(client, dirs, **kw):
    return ftidask.init(client=client, enable_dcp=1, dcp_block_size=BLOCK, **dirs, **kw)


def _start(ctx):
    """Two variables, chunked so that every worker holds some chunks."""
    ctx.protect(1, da.random.default_rng(0).random((160, 128), chunks=(40, 64)), name="field")
    ctx.protect(2, da.arange(4000, chunks=500, dtype=np.int32), name="counts")


def _step(ctx, k):
    """Change one row of the field (a few blocks of two chunks), keep the counts."""
    field = ctx.protected[1]
    ctx.protect(1, da.where(da.arange(160)[:, None] == 7 * k, field + 1, field))


def _checkpoints(ctx, level, count):
    """Checkpoints 1..count at ``level``, one step of change before each; their infos."""
    infos = []
    for k in range(count):
        _step(ctx, k)
        infos.append(ctx.checkpoint(k + 1, level))
    return infos


def _state(ctx):
    return {vid: a.compute() for vid, a in ctx.protected.items()}


def _assert_same(arrays, saved):
    assert sorted(arrays) == sorted(saved)
    for vid, ref in saved.items():
        got = arrays[vid].compute()
        assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("level", [5, 6, 7, 8])
def test_differential_checkpoints_write_only_changed_blocks(client, dirs, level):
    ctx = _init(client, dirs)
    _start(ctx)
    infos = _checkpoints(ctx, level, 4)
    saved = _state(ctx)
    # Checkpoints 1 and 2 fill the two alternating files; 3 and 4 patch them (two steps of change).
    assert infos[0].blocks_changed == infos[0].blocks_total
    last = infos[-1]
    assert last.level == level and 0 < last.blocks_changed < last.blocks_total // 10
    assert last.bytes_written == last.blocks_changed * BLOCK
    if level == 6:  # L2 sent deltas, not files
        assert last.partner_bytes < sum(last.file_sizes) // 5 < infos[0].partner_bytes
    record = ctx.state.records()[-1]
    assert record.extra.get("dcp") and record.level == level - 4
    for path in find_paths(dirs["ckpt_dir" if level != 8 else "glbl_dir"], "Ckpt4-Rank*.fti"):
        with open(path, "rb") as fh:  # complete FTI-FF files, every block checked
            parsed = parse_ftiff(fh, str(path))
            assert parsed.fb.flags & FLAG_DCP
            verify_data(fh, parsed)
    ctx2 = _init(client, dirs)
    assert ctx2.status() == 1
    _assert_same(ctx2.recover(), saved)
    assert ctx2.recovered_from == (4, level - 4)


@pytest.mark.parametrize(("level", "ranks"), [(6, [1]), (7, [0, 3]), (8, [0, 1, 2, 3])])
def test_lost_workers_after_differential_checkpoints(client, dirs, level, ranks):
    ctx = _init(client, dirs)
    _start(ctx)
    _checkpoints(ctx, level, 4)
    saved = _state(ctx)
    lose_workers(client, dirs, ranks)
    client.wait_for_workers(NWORKERS - len(ranks) if len(ranks) < NWORKERS else 1, timeout=60)
    ctx2 = _init(client, dirs)
    _assert_same(ctx2.recover(), saved)


@pytest.mark.parametrize("stage", ["write", "patch", "after-write"])
def test_worker_killed_during_a_differential_checkpoint(client, dirs, stage):
    """Killed before patching, halfway through patching its spare (at its first changed block), or
    after its file is complete but before the commit."""
    ctx = _init(client, dirs)
    _start(ctx)
    _checkpoints(ctx, 5, 3)
    saved = _state(ctx)
    _step(ctx, 3)
    # the rank holding the field's first chunk row, which the step changes (sticky: it writes it again)
    rank = next(r for index, r, _d, _n in ctx.state.records()[-1].extra["chunks"]["1"] if index == [0, 0])
    crash_worker(client, rank, {"write": "ftidask.backends.dask.dcp_tasks:write_rank_dcp", "patch": "dcp-block",
                                "after-write": "ftidask.backends.dask.dcp_tasks:write_differential:after"}[stage])
    with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
        ctx.checkpoint(4, 5)
    assert 4 not in [r.ckpt_id for r in ctx.state.records()]
    wait_for_replaced_workers(client, NWORKERS)  # the nanny restarts the killed worker
    ctx2 = _init(client, dirs)
    _assert_same(ctx2.recover(), saved)
    # the run goes on: the next differential checkpoints are correct (a torn spare is rewritten)
    _step(ctx, 4)
    ctx.checkpoint(5, 5)
    _step(ctx, 5)
    ctx.checkpoint(6, 5)
    again = _state(ctx)
    _assert_same(_init(client, dirs).recover(), again)


def test_damaged_block_is_never_returned(client, dirs):
    ctx = _init(client, dirs)
    _start(ctx)
    _checkpoints(ctx, 5, 2)
    saved = _state(ctx)
    _step(ctx, 2)
    ctx.checkpoint(3, 5)

    def flip(path):  # one flipped bit in the middle of a data block
        with open(path, "rb") as fh:
            parsed = parse_ftiff(fh, str(path))
        meta = next(m for _b, _c, m in parsed.containers() if m.hascontent)
        with open(path, "r+b") as fh:
            fh.seek(meta.fptr + meta.chunksize // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x10]))

    flip(find_paths(dirs["ckpt_dir"], "Ckpt3-Rank1.fti")[0])
    ctx2 = _init(client, dirs)  # the previous checkpoint, kept whole as the spares (docs/dcp.md)
    _assert_same(ctx2.recover(), saved)
    assert ctx2.recovered_from == (2, 1)
    flip(find_paths(dirs["ckpt_dir"], "dcp/Spare-Rank1.fti")[0])
    with pytest.raises(ftidask.NoCheckpointError, match="Rank1|rank 1|damaged|hash"):
        _init(client, dirs).recover()


def test_finalize_removes_the_spares(client, dirs):
    ctx = _init(client, dirs)
    _start(ctx)
    _checkpoints(ctx, 6, 3)
    assert find_paths(dirs["ckpt_dir"], "dcp/Spare*-Rank*.fti")
    ctx.finalize()
    assert not list(find_paths(Path(dirs["ckpt_dir"]), "dcp/*"))


def test_incremental_checkpoint(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    _start(ctx)
    ctx.checkpoint(1, 1)
    before = _state(ctx)
    ctx.init_icp(2, 2)
    ctx.add_var_icp(2)
    _step(ctx, 1)
    with pytest.raises(ftidask.CheckpointError, match=r"misses protected variables \[1\]"):
        ctx.finalize_icp()
    assert [r.ckpt_id for r in ctx.state.records()] == [1]
    with ctx.incremental(3, 2) as icp:
        icp.add(1)  # the field as it is now
        pinned = ctx.protected[1].compute()
        _step(ctx, 2)  # changed after it was added: not in checkpoint 3
        icp.add(2)
    assert icp.info is not None and icp.info.level == 2
    ctx.init_icp(4, 2, False)  # FTI_InitICP(id, level, activate): not due, so add and finalize do nothing
    ctx.add_var_icp(1)
    assert ctx.finalize_icp() is None
    assert 4 not in [r.ckpt_id for r in ctx.state.records()]
    out = ftidask.init(client=client, **dirs).recover()
    assert out[1].compute().tobytes() == pinned.tobytes() != before[1].tobytes()
    assert out[2].compute().tobytes() == before[2].tobytes()


def test_differential_levels_need_enable_dcp(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    _start(ctx)
    with pytest.raises(ftidask.LevelError, match="enable_dcp"):
        ctx.checkpoint(1, 5)
    assert ctx.state.records() == []


def test_retired_checkpoints_are_deleted_in_the_background(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    _start(ctx)
    _checkpoints(ctx, 2, 4)
    root = Path(dirs["ckpt_dir"])
    end = time.monotonic() + 60  # (a loaded machine's workers delete slowly)
    while time.monotonic() < end:
        left = sorted({p.name.split(".s")[0] for p in root.glob("node*/*/l*/ckpt*")})
        trash = list(root.glob("node*/*/l*/.trash-*"))
        if left == ["ckpt4"] and not trash:
            break
        time.sleep(0.1)
    assert left == ["ckpt4"] and not trash
    ctx.finalize()


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _spill_on_worker(in_memory: int) -> int:
    """On a worker: ``dcp.files.XOR_IN_MEMORY`` set to ``in_memory`` (a test seam) and the bytes written to the
    deltas' scratch files counted (``XorScratch.spilled``); the previous bound."""
    from ftidask.dcp import delta, files

    old, files.XOR_IN_MEMORY = files.XOR_IN_MEMORY, in_memory
    real = delta.XorScratch.append

    def append(self, data):
        delta.XorScratch.spilled += int(data.nbytes)
        return real(self, data)

    delta.XorScratch.spilled, delta.XorScratch.append, delta.XorScratch.real_append = 0, append, real
    return old


def _spill_off_worker(old: int, root: str) -> tuple[int, list[str]]:
    """Undo :func:`_spill_on_worker`: the bytes spilled, and the scratch files (unlinked) under ``root`` still open."""
    from ftidask.dcp import delta, files

    files.XOR_IN_MEMORY = old
    spilled = delta.XorScratch.spilled
    delta.XorScratch.append = delta.XorScratch.real_append
    del delta.XorScratch.real_append, delta.XorScratch.spilled
    still = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root) and target.endswith("(deleted)"):
            still.append(target)
    return spilled, still


@pytest.mark.parametrize("spill", [False, True])
def test_l3_parity_is_updated_from_the_deltas(client, dirs, spill):
    """Level 7 on the workers: the parity patched from the deltas is a full encoding's, and rebuilds two lost
    workers' files. ``spill``: every data run's delta in the worker's scratch file (``XOR_IN_MEMORY`` 0 there, as
    past 16 MiB), handed to the parity task on the same worker, closed after it."""
    from test_dcp_mpi import _parity_rows

    ctx = _init(client, dirs, group_size=4)
    _start(ctx)
    logger, seen = logging.getLogger("ftidask"), _Messages()
    old_level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    old = client.run(_spill_on_worker, 0) if spill else {}
    try:
        _checkpoints(ctx, 7, 4)
    finally:
        logger.removeHandler(seen)
        logger.setLevel(old_level)
        after = {w: client.run(_spill_off_worker, n, str(dirs["ckpt_dir"]), workers=[w])[w] for w, n in old.items()}
    # checkpoints 1 and 2 have no spare parity yet; 3 and 4 update theirs
    assert sum("re-encodes its parity in full" in m for m in seen.messages) == 2, seen.messages
    if spill:
        assert sum(spilled for spilled, _still in after.values()) > 0, after  # the workers whose chunks changed
        assert [still for _spilled, still in after.values()] == [[]] * len(after), after
    root = Path(dirs["ckpt_dir"])
    own = [next(root.glob(f"node{r}/*/l3/ckpt4.*/Ckpt4-Rank{r}.fti")) for r in range(NWORKERS)]
    rows = _parity_rows(own)
    for r in range(NWORKERS):
        assert (own[r].parent / f"Ckpt4-RSed{r}.fti").read_bytes() == rows[r]
    saved = _state(ctx)
    lose_workers(client, dirs, [1, 2])
    client.wait_for_workers(NWORKERS - 2, timeout=60)
    _assert_same(_init(client, dirs, group_size=4).recover(), saved)


def test_a_full_local_disk_names_the_workers_file(client, tmp_path):
    """A differential write on a full disk said only "No space left on device" with the task's key: the error names
    the worker's file now, as the other backends' do."""
    from diskfull import tmpfs

    with tmpfs(tmp_path / "fs", "256k") as fs:
        ctx = ftidask.init(client=client, ckpt_dir=str(fs / "Local"), glbl_dir=str(tmp_path / "Global"),
                           meta_dir=str(tmp_path / "Meta"), enable_dcp=1, verbosity=4)
        ctx.protect(1, da.zeros(1 << 17, chunks=1 << 16))  # 1 MiB: no room for it
        with pytest.raises(ftidask.CheckpointError, match=r"No space left on device: '/.*Local/"):
            ctx.checkpoint(1, 5)
        ctx._close()
