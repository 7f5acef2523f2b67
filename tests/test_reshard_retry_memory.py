"""A restart on another node layout whose newest checkpoint is refused after its arrays were staged (a Python state
that does not decode on one rank), then the older checkpoint recovered: the refused checkpoint's staged pages (filled:
resident) are given back before the older one is staged. Before, they stayed mapped until the older checkpoint was
staged beside them: the recovery's peak was twice the arrays (a restart that fits memory once could be killed).
2 ranks on 2 nodes, then on 1 (Python states are not redistributed onto another number of ranks); the ranks are
threads over the real engine (``run_ranks``); the peak is the process's VmHWM, reset just before (Linux 4.0+)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine import pagemove
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not pagemove.enabled, reason="needs the native page helper")]

R, N = 2, 5 << 20  # float64: 40 MiB a rank (glibc maps each afresh: above its largest mmap threshold)
MIB = 1 << 20


def _config(base: Path, node_size: int):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=node_size, group_size=2, verbosity=4)


def _want(rank: int, ckpt: int) -> np.ndarray:
    return np.arange(rank * N, (rank + 1) * N, dtype=np.float64) + ckpt / 4


def _rss(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def test_a_refused_checkpoints_staged_pages_are_given_back_before_the_older_one(tmp_path: Path) -> None:
    def write(t) -> None:
        ctx = Context(_config(tmp_path, 1), t)
        a, value = np.empty(N), ftidask.Value()
        ctx.protect(1, a, global_shape=(R * N,), offset=(t.rank * N,))
        ctx.protect(9, value)
        for ckpt, level, state in ((1, 4, {"k": 1}), (2, 1, 5)):
            a[...], value.value = _want(t.rank, ckpt), state
            ctx.checkpoint(ckpt, level)
        ctx._close()

    assert run_ranks(_config(tmp_path, 1), R, write, wait=240)[1] == []

    def recover(t):
        ctx = Context(_config(tmp_path, R), t)
        a = np.empty(N)
        ctx.protect(1, a, global_shape=(R * N,), offset=(t.rank * N,))
        ctx.protect(9, ftidask.State() if t.rank == 0 else ftidask.Value())  # checkpoint 2 holds 5: not a dict
        fresh = pagemove.movable(a)
        ctx.recover()
        ctx._close()
        return fresh, ctx.recovered_from, a  # compared once the peak is read

    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    results, errors = run_ranks(_config(tmp_path, R), R, recover, wait=240)
    peak = _rss("VmHWM") - before
    assert errors == [] and [r[:2] for r in results] == [(True, (1, 4))] * R, (errors, results)
    assert all(a.tobytes() == _want(rank, 1).tobytes() for rank, (_f, _c, a) in enumerate(results))
    assert peak < 1.5 * R * N * 8, f"peak {peak / MIB:.0f} MiB for {R * N * 8 / MIB:.0f} MiB of arrays"
