"""A restart on another number of ranks with thousands of declared variables: each piece of each variable was
read after a pass over every container of its old file (3,000 variables, 2 ranks to 1: 25 s). Every byte must
still land where its declaration puts it. The ranks are threads over the real engine (``run_ranks``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

N, OLD, NEW = 1500, 2, 3


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=OLD, verbosity=4)


def _global(i: int) -> np.ndarray:  # variable i: a global array of a size of its own
    return np.random.default_rng(i).integers(-(2**62), 2**62, 5 + i % 23, dtype=np.int64)


def _block(i: int, rank: int, size: int) -> slice:
    n = _global(i).size
    return slice(n * rank // size, n * (rank + 1) // size)


def test_thousands_of_blocks_redistributed_bit_for_bit(tmp_path):
    def write(t) -> None:
        ctx = Context(_config(tmp_path), t)
        for i in range(N):
            mine = _block(i, t.rank, OLD)
            ctx.protect(i, _global(i)[mine].copy(), global_shape=(_global(i).size,), offset=(mine.start,))
        ctx.checkpoint(1, 4)
        ctx._close()

    assert run_ranks(_config(tmp_path), OLD, write, wait=120)[1] == []

    def read(t) -> bool:
        ctx = Context(_config(tmp_path), t)
        out = {}
        for i in range(N):
            mine = _block(i, t.rank, NEW)
            out[i] = np.full(mine.stop - mine.start, -1, np.int64)
            ctx.protect(i, out[i], global_shape=(_global(i).size,), offset=(mine.start,))
        ctx.recover()
        ctx._close()
        return all(out[i].tobytes() == _global(i)[_block(i, t.rank, NEW)].tobytes() for i in range(N))

    results, errors = run_ranks(_config(tmp_path), NEW, read, wait=120)
    assert errors == [] and results == [True] * NEW
