"""L2/L3: a rank's file is made durable after its partner copy or parity is written, before the commit record.

The rank file of an L2/L3 checkpoint is renamed into its directory unsynced; the group's exchange then runs while
the disk still writes it, and one fsync per rank file follows the redundancy (``storage.files.make_durable``). These
tests run 4 ranks as threads over the real engine and levels (``run_ranks``): the order of the steps, and a
failed fsync failing the checkpoint on every rank with the previous one kept.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.storage import files as storage
from ftidask.storage.files import find_paths

NRANKS = 4


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=NRANKS, block_size=1, transfer_size=1, verbosity=4)


def _values(rank: int, version: int) -> np.ndarray:
    return np.arange(50_000, dtype=np.float64) * (rank + 1) + version


def _run(base: Path, program):
    results, errors = run_ranks(_config(base), NRANKS, lambda t: program(Context(_config(base), t), t.rank), wait=60)
    assert errors == [], errors
    return results


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_the_rank_file_is_made_durable_after_the_redundancy_and_before_the_record(tmp_path, monkeypatch, level):
    seen: list[tuple[str, bool, int]] = []
    lock = threading.Lock()
    real = storage.make_durable

    def durable(path: Path) -> None:
        redundancy = list(path.parent.glob("*-Pcof*.fti")) + list(path.parent.glob("*-RSed*.fti"))
        records = len(list(find_paths(tmp_path / "Meta", "s*.json")))
        with lock:
            seen.append((path.name, bool(redundancy), records))
        real(path)

    monkeypatch.setattr(storage, "make_durable", durable)

    def program(ctx: Context, rank: int) -> None:
        ctx.protect(1, _values(rank, 1))
        ctx.checkpoint(1, level)
        ctx._close()

    _run(tmp_path, program)
    if level in (2, 3):  # once per rank, its partner copy or parity complete, no record written yet
        assert sorted(seen) == [(f"Ckpt1-Rank{r}.fti", True, 0) for r in range(NRANKS)], seen
    else:  # L1/L4 files are fsynced as they are written, as before
        assert seen == []


@pytest.mark.parametrize("level", [2, 3])
def test_a_failed_fsync_of_one_rank_file_fails_the_checkpoint_and_keeps_the_previous(tmp_path, monkeypatch, level):
    real = storage.make_durable

    def durable(path: Path) -> None:
        if path.name == "Ckpt2-Rank2.fti":
            raise OSError(errno.EIO, "Input/output error (injected)", str(path))
        real(path)

    monkeypatch.setattr(storage, "make_durable", durable)

    def write(ctx: Context, rank: int) -> str:
        a = _values(rank, 1)
        ctx.protect(1, a)
        ctx.checkpoint(1, level)
        a[:] = _values(rank, 2)
        try:
            ctx.checkpoint(2, level)
        except ftidask.CheckpointError as exc:
            return str(exc)
        finally:
            ctx._close()
        return ""

    messages = _run(tmp_path, write)
    assert all("checkpoint 2" in m and "previous checkpoint is kept" in m for m in messages), messages
    assert "Input/output error (injected)" in messages[2]
    assert not list(tmp_path.glob("Local/*/*/l*/ckpt2.*")), "the failed checkpoint's files stay"

    def recover(ctx: Context, rank: int) -> bool:
        a = np.zeros(50_000)
        ctx.protect(1, a)
        ctx.recover()
        ctx._close()
        return ctx.recovered_from == (1, level) and a.tobytes() == _values(rank, 1).tobytes()

    assert _run(tmp_path, recover) == [True] * NRANKS
