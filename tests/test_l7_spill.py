"""Differential L3 (level 7) with the XOR delta spilled to its scratch file, over a whole run of 4 ranks as threads
(:class:`~ftidask.engine.grouplevels.ThreadTransport`, the MPI backend's engine and level code): what an interrupted
variable, a failed checkpoint or a scratch file that cannot be read back leave behind.

Every rank protects 2 MiB that change every 1024th value (256 runs of one 4 KiB block): with ``XOR_IN_MEMORY`` at
64 KiB, each delta keeps its first 16 runs in memory and spills the rest.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from test_dcp_mpi import _parity_rows

from ftidask.api.context import Context
from ftidask.dcp import files
from ftidask.engine.grouplevels import run_ranks
from ftidask.levels import rs_delta
from ftidask.model.config import load_config
from ftidask.model.errors import CheckpointError
from ftidask.storage import files as storage

sys.path.insert(0, os.path.dirname(__file__))
import leaks  # noqa: E402

NRANKS = 4
N = 262_144  # float64: 2 MiB a rank


def arrays(rank: int, version: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.random.default_rng(10 + rank).random(N)
    a[::1024] += version  # one block in two of 4 KiB changes from a version to the next
    return a, np.arange(rank, rank + 40, dtype=np.int32) * version


def _ranks(base: Path, program) -> list:
    cfg = load_config(None, ckpt_dir=str(base / "L"), glbl_dir=str(base / "G"), meta_dir=str(base / "M"),
                      local_test=1, node_size=1, group_size=NRANKS, enable_dcp=1, dcp_block_size=4096, verbosity=4,
                      exec_id="l7")
    results, errors = run_ranks(cfg, NRANKS, lambda t: program(Context(cfg, t), t.rank), wait=60)
    assert errors == [], errors
    return results


def _protected(ctx, rank: int, version: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = arrays(rank, version)
    ctx.protect(1, a)
    ctx.protect(2, b)
    return a, b


def _recover(ctx, rank: int) -> list:
    a, b = _protected(ctx, rank, 0)
    ctx.recover()
    want_a, want_b = arrays(rank, ctx.recovered_from[0])
    return [ctx.recovered_from[0], a.tobytes() == want_a.tobytes() and b.tobytes() == want_b.tobytes()]


def _checkpoint(ctx, a, b, rank: int, version: int) -> None:
    a[...], b[...] = arrays(rank, version)
    ctx.checkpoint(version, 7)


def _open_icp_3(ctx, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoints 1 and 2 (level 7) written, the arrays changed whole, iCP checkpoint 3 at level 7 opened."""
    a, b = _protected(ctx, rank, 0)
    for version in (1, 2):
        _checkpoint(ctx, a, b, rank, version)
    a[...], b[...] = arrays(rank, 3)
    ctx.init_icp(3, 7)
    return a, b


def _own(base: Path, ckpt: int) -> list[Path]:
    return [next(base.glob(f"L/node{r}/l7/l3/ckpt{ckpt}.*/Ckpt{ckpt}-Rank{r}.fti")) for r in range(NRANKS)]


def _assert_full_encoding(base: Path, ckpt: int) -> None:
    own = _own(base, ckpt)
    rows = _parity_rows(own)
    for r in range(NRANKS):
        assert (own[r].parent / f"Ckpt{ckpt}-RSed{r}.fti").read_bytes() == rows[r], f"rank {r}: not a full encoding's"


def _lose_node_and_recover(base: Path, node: int, want: int) -> None:
    import shutil

    shutil.rmtree(base / "L" / f"node{node}")
    assert _ranks(base, _recover) == [[want, True]] * NRANKS


def _next_two(base: Path, updates: list) -> None:
    """Two restarts, each recovering and writing one checkpoint at level 7 (4, then 5): the parity of each is a full
    encoding's; the second is patched from the deltas (its base is checkpoint 2, retired by checkpoint 4)."""
    for version in (4, 5):
        def step(ctx, rank, version=version):
            a, b = _protected(ctx, rank, 0)
            ctx.recover()
            _checkpoint(ctx, a, b, rank, version)

        updates.clear()
        _ranks(base, step)
        _assert_full_encoding(base, version)
    assert updates == [None] * NRANKS, updates


@pytest.fixture
def updates(monkeypatch) -> list:
    """What each rank's ``rs_delta.update`` returned (None: the parity was patched from the deltas)."""
    got: list = []
    real = rs_delta.update

    def update(*args, **kw):
        why = real(*args, **kw)
        got.append(why)
        return why

    monkeypatch.setattr(rs_delta, "update", update)
    return got


@pytest.fixture
def spill(monkeypatch):
    monkeypatch.setattr(files, "XOR_IN_MEMORY", 64 << 10)
    monkeypatch.setattr(rs_delta, "STRIPE", 100_000)  # several stripes


def _interrupting_storage(nth: int) -> tuple[types.ModuleType, dict]:
    """``dcp.files``' storage module, whose ``pwrite_all`` raises KeyboardInterrupt (Ctrl-C) before its ``nth`` call
    in rank 1's thread once armed: before a run of changed blocks captured in the delta is written."""
    proxy = types.ModuleType(storage.__name__)
    proxy.__dict__.update(vars(storage))
    state = {"armed": False, "calls": 0}

    def pwrite_all(*args):
        if state["armed"] and threading.current_thread().name == "ftidask-group-1":
            state["calls"] += 1
            if state["calls"] == nth:
                state["armed"] = False
                raise KeyboardInterrupt(f"injected before data write {nth}")
        return storage.pwrite_all(*args)

    proxy.pwrite_all = pwrite_all
    return proxy, state


@pytest.mark.parametrize("nth", [5, 100])  # a run whose delta is kept in memory, one spilled
def test_a_variable_interrupted_before_a_write_and_added_again_keeps_the_parity_a_full_encoding(
        tmp_path, monkeypatch, spill, nth):
    """iCP (level 7): Ctrl-C in ``add_var_icp`` on rank 1, after a run's old XOR new was taken and before the run was
    written; the checkpoint stays open and the variable is added again (as a notebook cell run again). The run is
    then taken once more from the same old bytes: two equal deltas of one range cancel, and the patched parity
    missed that run (main). A variable interrupted leaves its delta unknown: it is dropped and the group encodes the
    parity in full. The parity is a full encoding's, and node 1 lost, checkpoint 3 comes back exactly."""
    proxy, state = _interrupting_storage(nth)
    monkeypatch.setattr(files, "storage", proxy)

    def program(ctx, rank):
        _open_icp_3(ctx, rank)
        state["armed"] |= rank == 1
        interrupted = False
        try:
            ctx.add_var_icp(1)
        except KeyboardInterrupt:
            interrupted = True
            ctx.add_var_icp(1)  # again, in the checkpoint still open
        ctx.add_var_icp(2)
        ctx.finalize_icp()
        return interrupted

    assert _ranks(tmp_path, program) == [False, True, False, False]
    _assert_full_encoding(tmp_path, 3)
    _lose_node_and_recover(tmp_path, 1, 3)


def test_a_checkpoint_failed_after_its_files_are_complete_closes_every_scratch_file(tmp_path, spill, updates):
    """Checkpoint 3 fails after the files of ranks 0, 1 and 3 are complete (rank 2 did not add a variable): their
    deltas' scratch files, never handed to the level, stayed open (their descriptors and disk space, the size of
    the changed state) as long as the failed checkpoint's frames lived: in a notebook, the exception kept as
    ``sys.last_value``, until the next one (main). They are closed when the checkpoint is dropped; checkpoint 2
    stays, and the next checkpoint writes a parity that is a full encoding's."""
    def program(ctx, rank):
        _open_icp_3(ctx, rank)
        ctx.add_var_icp(1)
        if rank != 2:
            ctx.add_var_icp(2)
        try:
            ctx.finalize_icp()
        except CheckpointError as exc:
            return exc  # kept, with its frames, as IPython keeps the last one
        return None

    kept = _ranks(tmp_path, program)
    assert all(isinstance(exc, CheckpointError) for exc in kept), kept
    gc.collect()
    open_scratch = [t for t in leaks.descriptors(tmp_path) if t.endswith("(deleted)")]
    assert open_scratch == [], f"scratch files of the failed checkpoint left open: {open_scratch}"
    del kept
    assert _ranks(tmp_path, _recover) == [[2, True]] * NRANKS

    _next_two(tmp_path, updates)


def test_a_scratch_file_unreadable_on_one_rank_fails_the_checkpoint_everywhere(tmp_path, monkeypatch, spill,
                                                                                  updates):
    """Rank 1's scratch file is cut to nothing just before the exchange (its disk lost the pages): its reads fail
    while the others' succeed. Every rank takes part in every exchange and the checkpoint fails on all of them
    with one error; checkpoint 2 stays and, node 1 lost, comes back exactly; the next two checkpoints encode, then
    patch, parities that are full encodings."""
    real = rs_delta._exchange

    def exchange(ch, xor, width, problems):
        if threading.current_thread().name == "ftidask-group-1":
            assert xor.scratch is not None, "nothing was spilled: the test does not test the scratch file"
            os.ftruncate(xor.scratch.fd, 0)
        return real(ch, xor, width, problems)

    monkeypatch.setattr(rs_delta, "_exchange", exchange)

    def program(ctx, rank):
        a, b = _protected(ctx, rank, 0)
        for version in (1, 2):
            _checkpoint(ctx, a, b, rank, version)
        try:
            _checkpoint(ctx, a, b, rank, 3)
        except CheckpointError as exc:
            return str(exc)
        return ""

    errors = _ranks(tmp_path, program)
    assert len(set(errors)) == 1 and "scratch file" in errors[0], errors
    # checkpoints 1 and 2 encoded their parity (no base yet); at 3 the others patched theirs (then removed), rank 1
    # raised
    assert updates[:2 * NRANKS].count(None) == 0 and updates[2 * NRANKS:] == [None] * (NRANKS - 1), updates
    monkeypatch.setattr(rs_delta, "_exchange", real)
    _lose_node_and_recover(tmp_path, 1, 2)

    _next_two(tmp_path, updates)
    _lose_node_and_recover(tmp_path, 2, 5)


@pytest.mark.slow  # the other ranks wait 5 s for rank 1
def test_a_rank_interrupted_as_its_file_is_renamed_leaves_no_scratch_file_open(tmp_path, monkeypatch, spill):
    """Ctrl-C on rank 1 as its finished file is renamed into checkpoint 3 (its delta spilled, not yet handed to the
    checkpoint): the scratch file stayed open with the interrupt's frames (main). The other ranks, left waiting by
    rank 1, fail the checkpoint at the collective's timeout; none keeps a scratch file open, and checkpoint 2 stays."""
    from ftidask.engine import dcpwrite

    proxy = types.ModuleType(storage.__name__)
    proxy.__dict__.update(vars(storage))
    armed = {"on": False}

    def rename_into(*args):
        if armed["on"] and threading.current_thread().name == "ftidask-group-1":
            armed["on"] = False
            raise KeyboardInterrupt("injected as the file is renamed")
        return storage.rename_into(*args)

    proxy.rename_into = rename_into
    monkeypatch.setattr(dcpwrite, "storage", proxy)
    cfg = load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                      local_test=1, node_size=1, group_size=NRANKS, enable_dcp=1, dcp_block_size=4096, verbosity=4,
                      exec_id="l7")

    def program(ctx, rank):
        a, b = _protected(ctx, rank, 0)
        for version in (1, 2):
            _checkpoint(ctx, a, b, rank, version)
        armed["on"] |= rank == 1
        try:
            _checkpoint(ctx, a, b, rank, 3)
        except (KeyboardInterrupt, CheckpointError) as exc:
            return exc  # kept, with its frames, as IPython keeps the last one
        return None

    kept, _errors = run_ranks(cfg, NRANKS, lambda t: program(Context(cfg, t), t.rank), wait=5)
    assert isinstance(kept[1], KeyboardInterrupt), kept
    gc.collect()
    open_scratch = [t for t in leaks.descriptors(tmp_path) if t.endswith("(deleted)")]
    assert open_scratch == [], f"scratch files left open: {open_scratch}"
    del kept
    assert _ranks(tmp_path, _recover) == [[2, True]] * NRANKS
