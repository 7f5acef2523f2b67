"""A restart on another number of ranks of a checkpoint whose old ranks protected different variables: a declared
global array that only some old ranks held (whole between them), or a replicated array some held, was refused ("not
in the checkpoint file(s) of old rank(s) ..."), though those ranks' blocks make it whole (`ftidask export` stitched
it). Recovered now; blocks that do not make it whole are still refused, the arrays untouched. Found by a review.

The ranks are threads over the real engine (``run_ranks``), as in tests/test_reshard_forged_blocks.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

OLD = 4
WHOLE = np.arange(8.0) + 100  # variable 3: global (8,), held by old ranks 0 and 1 (4 elements each)
REPLICATED = np.arange(5, dtype=np.int32)  # variable 5: replicated, held by old ranks 1 and 3
HALF = np.arange(6.0)  # variable 7: global (12,), old ranks 0 and 1 hold 6 elements of it: half is nowhere


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, verbosity=4)


def _write(base: Path, level: int, half: bool) -> None:
    def program(t) -> None:
        ctx = Context(_config(base), t)
        ctx.protect(1, np.full(2, float(t.rank)), global_shape=(8,), offset=(2 * t.rank,))  # every rank
        if t.rank in (0, 1):
            ctx.protect(3, WHOLE[4 * t.rank:4 * t.rank + 4].copy(), global_shape=(8,), offset=(4 * t.rank,))
        if t.rank in (1, 3):
            ctx.protect(5, REPLICATED.copy(), replicated=True)
        if half and t.rank in (0, 1):
            ctx.protect(7, HALF[3 * t.rank:3 * t.rank + 3].copy(), global_shape=(12,), offset=(3 * t.rank,))
        ctx.checkpoint(1, level)
        ctx._close()

    assert run_ranks(_config(base), OLD, program, wait=60)[1] == []


def _recover(base: Path, size: int, half: bool) -> list:
    def program(t):
        ctx = Context(_config(base), t)
        lo, hi = 8 * t.rank // size, 8 * (t.rank + 1) // size
        whole, rep, part = np.full(hi - lo, -1.0), np.full(5, -1, np.int32), np.full(12 // size, -1.0)
        ctx.protect(3, whole, global_shape=(8,), offset=(lo,))
        ctx.protect(5, rep, replicated=True)
        if half:
            ctx.protect(7, part, global_shape=(12,), offset=(12 // size * t.rank,))
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            return f"{type(exc).__name__}: {exc}", bool((whole == -1).all() and (rep == -1).all())
        finally:
            ctx._close()
        return whole.tobytes() == WHOLE[lo:hi].tobytes() and rep.tobytes() == REPLICATED.tobytes()

    results, errors = run_ranks(_config(base), size, program, wait=60)
    assert errors == [], errors
    return results


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_variables_some_old_ranks_held_whole_come_back(tmp_path, level, size):
    _write(tmp_path, level, half=False)
    assert _recover(tmp_path, size, half=False) == [True] * size


def test_blocks_that_do_not_make_the_array_whole_are_refused_untouched(tmp_path):
    _write(tmp_path, 4, half=True)
    got = _recover(tmp_path, 2, half=True)
    assert all(untouched for _message, untouched in got), got
    assert all("variable 7 is not in the checkpoint file(s) of old rank(s) [2, 3], and those of the others do not "
               "make it whole" in message for message, _u in got), got
