"""A restart on another layout keeps every byte of a structured item: NumPy assigns a structured array of more than
a few items field by field, and the bytes no field covers (padding, itemsize beyond the fields) were left as the
destination's old bytes when a piece was not a run of both streams (2x2 blocks read back as row halves). A variable
of itemsize 0 (``np.dtype([])``) made every such restart refuse the whole checkpoint. Found by a review.

The ranks are threads over the real engine (``run_ranks``), as in tests/test_reshard_partial_vars.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

PADDED = {"partial16": np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [0], "itemsize": 16}),
          "aligned": np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<u2")], align=True)}
GLOBAL = (80, 100)


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, verbosity=4)


def _random(dtype: np.dtype, shape: tuple, seed: int) -> np.ndarray:
    """Writable, over random bytes (a structured array is never ``.copy()``-ed here: its padding would not be)."""
    n = dtype.itemsize * int(np.prod(shape))
    return np.frombuffer(bytearray(np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes()),
                         dtype).reshape(shape)


def _items(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array.view(np.dtype((np.void, array.dtype.itemsize)))).tobytes()


def _write(base: Path, dtype: np.dtype, level: int, whole: np.ndarray) -> None:
    """4 ranks, 2x2 blocks of 40x50 items of ``whole``; variable 2 of itemsize 0 beside it."""
    def program(t) -> None:
        i, j = divmod(t.rank, 2)
        block = _random(dtype, (40, 50), 100 + t.rank)
        np.copyto(block.view(np.dtype((np.void, dtype.itemsize))),
                  whole[40 * i:40 * i + 40, 50 * j:50 * j + 50].view(np.dtype((np.void, dtype.itemsize))))
        ctx = Context(_config(base), t)
        ctx.protect(1, block, global_shape=GLOBAL, offset=(40 * i, 50 * j))
        ctx.protect(2, np.zeros((40, 50), np.dtype([])), global_shape=GLOBAL, offset=(40 * i, 50 * j))
        ctx.checkpoint(1, level)
        ctx._close()

    assert run_ranks(_config(base), 4, program, wait=60)[1] == []


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("name", sorted(PADDED))
def test_blocks_read_back_as_row_halves_keep_every_byte(tmp_path, name, level):
    dtype = PADDED[name]
    whole = _random(dtype, GLOBAL, 7)
    _write(tmp_path, dtype, level, whole)

    def program(t):
        rows = GLOBAL[0] // 2
        got = _random(dtype, (rows, GLOBAL[1]), 999 + t.rank)  # other bytes than those to come back
        ctx = Context(_config(tmp_path), t)
        ctx.protect(1, got, global_shape=GLOBAL, offset=(rows * t.rank, 0))
        ctx.protect(2, np.zeros((rows, GLOBAL[1]), np.dtype([])), global_shape=GLOBAL, offset=(rows * t.rank, 0))
        ctx.recover()
        ctx._close()
        return _items(got) == _items(whole[rows * t.rank:rows * (t.rank + 1)])

    results, errors = run_ranks(_config(tmp_path), 2, program, wait=60)
    assert errors == [] and results == [True, True], (errors, results)


def test_one_process_restart_of_the_blocks_keeps_every_byte(tmp_path):
    dtype = PADDED["partial16"]
    whole = _random(dtype, GLOBAL, 7)
    _write(tmp_path, dtype, 4, whole)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), local_test=1, node_size=1, group_size=2, verbosity=4)
    got = _random(dtype, GLOBAL, 5)
    ctx.protect(1, got, global_shape=GLOBAL, offset=(0, 0))
    ctx.protect(2, np.zeros(GLOBAL, np.dtype([])), global_shape=GLOBAL, offset=(0, 0))
    ctx.recover()
    assert _items(got) == _items(whole)
    ctx.finalize()
