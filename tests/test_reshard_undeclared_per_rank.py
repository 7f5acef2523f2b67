"""Undeclared variables on the same number of ranks and another node layout: rank r gets old rank r's array
(docs/mpi.md). Undeclared arrays are per-rank data: their dtype or presence may differ between ranks. The planner
checked every old rank's record of such a variable (one dtype for all, every rank holding it), called the difference
damage, and skipped to an older checkpoint without a word, or refused the restart. And a variable some ranks declare
and another protects undeclared was committed, then read as damage by a restart on another layout: refused now
before anything is written. Found by a review.

The ranks are threads over the real engine (``run_ranks``), as in tests/test_reshard_partial_vars.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

N = 4


def _config(base: Path, node_size: int):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=node_size, verbosity=4)


def _value(rank: int, ckpt: int) -> np.ndarray:
    """Rank 2's array is int32, the others' float64; rank 0 alone has variable 2 (its own bookkeeping)."""
    return (np.arange(5, dtype=np.int32) + 10 * ckpt) if rank == 2 else np.full(5, rank + 0.5 * ckpt)


def _write(base: Path) -> None:
    def program(t) -> None:
        ctx = Context(_config(base, 1), t)
        a = _value(t.rank, 1)
        ctx.protect(1, a)
        if t.rank == 0:
            ctx.protect(2, np.arange(3.0) + 100)
        ctx.checkpoint(1, 4)
        a[:] = _value(t.rank, 2)
        ctx.checkpoint(2, 1)
        ctx._close()

    assert run_ranks(_config(base, 1), N, program, wait=60)[1] == []


def test_undeclared_per_rank_arrays_come_back_on_another_node_layout(tmp_path):
    _write(tmp_path)

    def program(t):
        ctx = Context(_config(tmp_path, 2), t)
        a = np.full(5, -1, _value(t.rank, 2).dtype)
        ctx.protect(1, a)
        b = np.full(3, -1.0)
        if t.rank == 0:
            ctx.protect(2, b)
        ctx.recover()
        ctx._close()
        return ctx.recovered_from[0], a.tobytes() == _value(t.rank, 2).tobytes(), t.rank != 0 or b.tolist() == [
            100.0, 101.0, 102.0]

    results, errors = run_ranks(_config(tmp_path, 2), N, program, wait=60)
    assert errors == [] and results == [(2, True, True)] * N, (results, errors)


def test_a_variable_declared_by_some_ranks_and_undeclared_on_another_is_refused_before_writing(tmp_path):
    def program(t):
        ctx = Context(_config(tmp_path, 1), t)
        ctx.protect(0, np.full(2, float(t.rank)), global_shape=(8,), offset=(2 * t.rank,))
        ctx.checkpoint(1, 4)
        if t.rank < N - 1:
            ctx.protect(1, np.full(2, 7.0), global_shape=(6,), offset=(2 * t.rank,))
        else:
            ctx.protect(1, np.full(2, 9.0))  # undeclared: no restart on another layout could place it
        try:
            ctx.checkpoint(2, 4)
        except ftidask.CheckpointError as exc:
            return str(exc)
        finally:
            ctx._close()
        return "committed"

    results, errors = run_ranks(_config(tmp_path, 1), N, program, wait=60)
    assert errors == [], errors
    assert results[0] != "committed", results
    assert all(r == results[0] for r in results), results
    assert f"rank {N - 1} protects, without a decomposition" in results[0] and "declared by rank(s) [0, 1, 2]" \
        in results[0], results[0]

    def restart(t):  # on 3 ranks: checkpoint 1 redistributed, never an error
        ctx = Context(_config(tmp_path, 1), t)
        lo, hi = 8 * t.rank // 3, 8 * (t.rank + 1) // 3
        got = np.full(hi - lo, -1.0)
        ctx.protect(0, got, global_shape=(8,), offset=(lo,))
        ctx.recover()
        ctx._close()
        return ctx.recovered_from[0], got.tolist() == [float(i // 2) for i in range(lo, hi)]

    results, errors = run_ranks(_config(tmp_path, 1), 3, restart, wait=60)
    assert errors == [] and results == [(1, True)] * 3, (results, errors)


def test_a_per_rank_state_protected_replicated_now_comes_back_on_another_node_layout(tmp_path):
    """A loop's counter of a checkpoint written before it was protected replicated (each rank's own Value), read by
    a run that protects it replicated, on the same number of ranks and another node layout: each rank its own, as
    on the same layout (the declaration on one side only), never "declared replicated here, none there"."""
    def write(t):
        ctx = Context(_config(tmp_path, 1), t)
        ctx.protect(2, ftidask.Value(5 + t.rank))
        ctx.checkpoint(1, 1)
        ctx._close()

    assert run_ranks(_config(tmp_path, 1), N, write, wait=60) == ([None] * N, [])

    def restart(t):
        ctx = Context(_config(tmp_path, 2), t)
        value = ftidask.Value(None)
        ctx.protect(2, value, replicated=True)
        ctx.recover()
        ctx._close()
        return value.value

    assert run_ranks(_config(tmp_path, 2), N, restart, wait=60) == ([5 + r for r in range(N)], [])
