"""Ranks that declare one variable as different global arrays (another global shape, replicated on some, another
dtype) at a checkpoint: every rank raises the same CheckpointError before anything is written, and the previous
checkpoint stays the one a restart (here on 2 ranks: redistributed) recovers. Before (found by a review), the
checkpoint committed on every rank and retired the good one; no restart on another layout, nor on this one, could
load it. The ranks are threads over the real engine (``run_ranks``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.model.errors import CheckpointError

G, RANKS = 24, 4


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, verbosity=4)


def _block(rank: int, size: int) -> slice:
    return slice(G * rank // size, G * (rank + 1) // size)


@pytest.mark.parametrize("odd", ["global_shape", "dtype", "replicated"])
def test_ranks_declaring_different_global_arrays_are_refused_everywhere(tmp_path, odd):
    def program(t) -> str:
        ctx = Context(_config(tmp_path), t)
        mine = _block(t.rank, RANKS)
        a = np.arange(mine.start, mine.stop, dtype=np.float64)
        ctx.protect(1, a, global_shape=(G,), offset=(mine.start,))
        ctx.checkpoint(1, 4)
        if t.rank == 1:
            if odd == "global_shape":
                ctx.protect(1, a, global_shape=(G + 4,), offset=(mine.start,))
            elif odd == "dtype":
                ctx.protect(1, a.astype(np.float32), global_shape=(G,), offset=(mine.start,))
            else:
                ctx.protect(1, np.arange(G, dtype=np.float64), replicated=True)
        try:
            ctx.checkpoint(2, 4)
            said = "committed"
        except CheckpointError as exc:
            said = str(exc)
        ctx._close()  # the job ends without finalize: its checkpoints stay
        return said

    said, errors = run_ranks(_config(tmp_path), RANKS, program, wait=60)
    assert errors == []
    assert len(set(said)) == 1 and "variable 1 is declared as different global arrays" in said[0], said
    assert "the previous checkpoint is kept" in said[0]

    def restart(t) -> tuple:
        ctx = Context(_config(tmp_path), t)
        mine = _block(t.rank, 2)
        a = np.zeros(mine.stop - mine.start)
        ctx.protect(1, a, global_shape=(G,), offset=(mine.start,))
        ctx.recover()
        got = (ctx.recovered_from, a.tobytes() == np.arange(mine.start, mine.stop, dtype=np.float64).tobytes())
        ctx._close()
        return got

    got, errors = run_ranks(_config(tmp_path), 2, restart, wait=60)
    assert errors == [] and got == [((1, 4), True)] * 2, (got, errors)
