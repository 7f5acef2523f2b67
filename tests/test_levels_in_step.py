"""A bug in one rank's L2/L3 step (an exception escaping ``levels.multilevel.protect``) must not leave its group
waiting: 4 ranks as threads over the real engine and levels (``run_ranks``), as over MPI."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import crashpoints  # noqa: E402
from test_commit_durability import NRANKS, _config, _values  # noqa: E402 - the same 4-rank run

import ftidask  # noqa: E402
from ftidask.api.context import Context  # noqa: E402
from ftidask.engine.grouplevels import run_ranks  # noqa: E402
from ftidask.levels import multilevel  # noqa: E402


@pytest.mark.parametrize("level", [2, 3])
def test_a_bug_in_one_ranks_level_step_fails_the_checkpoint_on_every_rank(tmp_path, monkeypatch, level):
    """The first rank to protect checkpoint 2 raises inside ``multilevel.protect``: every rank gets the same
    ``CheckpointError`` naming it (before, the others waited in the group's exchanges: the threads' wait, the job's
    walltime over MPI), and checkpoint 1 is recovered exactly."""
    # Call NRANKS + 1: the first call of checkpoint 2, on whichever rank comes first.
    monkeypatch.setattr(multilevel, "protect", crashpoints._counted(multilevel.protect, NRANKS + 1, False, True))

    def program(ctx: Context, rank: int) -> tuple[str, bool]:
        a = _values(rank, 1)
        ctx.protect(1, a)
        ctx.checkpoint(1, level)
        a[:] = _values(rank, 2)
        with pytest.raises(ftidask.CheckpointError) as failed:
            ctx.checkpoint(2, level)
        ctx.recover()
        same = ctx.recovered_from == (1, level) and np.array_equal(a, _values(rank, 1))
        ctx._close()
        return str(failed.value), same

    results, errors = run_ranks(_config(tmp_path), NRANKS, lambda t: program(Context(_config(tmp_path), t), t.rank),
                                wait=20)
    assert errors == [], errors
    assert len({why for why, _same in results}) == 1 and "injected failure" in results[0][0], results
    assert all(same for _why, same in results), results
