"""The newest checkpoint holds per-rank Python states (``ftidask.State``/``Value``) and the restart has another number
of ranks: the policy (docs/mpi.md, "Restarting on another number of ranks").

The states cannot be redistributed, and a sound newer checkpoint is never silently replaced by an older one (the
application would go back in time while a restart on the checkpoint's ranks recovers the newest): every rank raises
the same RecoveryError, nothing touched, which names both ways on, restarting on the checkpoint's number of ranks or
``recover(ckpt_id=...)`` with the older checkpoints of the run listed, and the latter recovers the older one exactly.
The ranks are threads over the real engine (``run_ranks``), as in tests/test_commit_durability.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config

G = 600


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, verbosity=4)


def _want(ckpt: int) -> np.ndarray:
    return np.arange(G, dtype=np.float64) + 1000 * ckpt


def _stage(base: Path, size: int, action) -> list:
    """``size`` ranks protect their block of the global array (declared) and a State; ``action(ctx, a, state, lo,
    hi)`` runs; what it returns, per rank."""
    def program(t):
        ctx = Context(_config(base), t)
        lo, hi = G * t.rank // size, G * (t.rank + 1) // size
        a = np.full(hi - lo, -1.0)
        state = ftidask.State(step=-1)
        ctx.protect(1, a, global_shape=(G,), offset=(lo,))
        ctx.protect(2, state)
        try:
            return action(ctx, a, state, lo, hi, t.rank)
        finally:
            ctx._close()  # the job ends without finalize: its checkpoints stay

    results, errors = run_ranks(_config(base), size, program, wait=60)
    assert errors == [], errors
    return results


def _write(ckpt: int, level: int, refused: bool = False):
    def action(ctx, a, state, lo, hi, rank):
        error = ""
        if refused:  # the newest checkpoint has states of another number of ranks: this job starts afresh
            try:
                ctx.recover()
            except ftidask.RecoveryError as exc:
                error = str(exc)
        a[:] = _want(ckpt)[lo:hi]
        state["step"] = 10 * ckpt + rank
        ctx.checkpoint(ckpt, level)
        return error
    return action


def _recover(ckpt_id=None):
    def action(ctx, a, state, lo, hi, rank):
        try:
            ctx.recover(ckpt_id=ckpt_id)
        except ftidask.FTIError as exc:
            return type(exc).__name__, str(exc), bool((a == -1).all()) and dict(state) == {"step": -1}
        return ctx.recovered_from, a.tobytes() == _want(ctx.recovered_from[0])[lo:hi].tobytes(), dict(state)
    return action


def test_states_of_another_number_of_ranks_refuse_and_name_the_older_checkpoints(tmp_path):
    """Checkpoint 1 (L4) on 2 ranks; a job on 4 ranks cannot recover it (its states) and writes checkpoint 2 (L1).
    A restart on 2 ranks: checkpoint 2 refused, the error naming a restart on 4 ranks and recover(ckpt_id=...) with
    checkpoint 1; recover(ckpt_id=1) then recovers checkpoint 1 exactly, states included. Before, the error said
    "restart on 4 ranks" and to declare where each variable sits (which a Python state cannot), and never that an
    older checkpoint exists."""
    _stage(tmp_path, 2, _write(1, 4))
    refused = _stage(tmp_path, 4, _write(2, 1, refused=True))
    assert all("written by 2 ranks, this run recovers on 4" in e and "(this run has no older checkpoint)" in e
               for e in refused), refused
    got = _stage(tmp_path, 2, _recover())
    assert {(kind, untouched) for kind, _m, untouched in got} == {("RecoveryError", True)}, got
    assert len({m for _k, m, _u in got}) == 1
    message = got[0][1]
    assert "checkpoint 2 (level 1) was written by 4 ranks, this run recovers on 2" in message
    assert "variable 2 is a Python state" in message and "restart on 4 ranks to recover checkpoint 2" in message
    assert "ctx.recover(ckpt_id=...) (older checkpoints of this run: 1 (level 4, 2 ranks))" in message
    assert "global_shape" not in message  # no declaration makes a Python state fit
    # One process (the whole array, undeclared) is refused the same way, nothing touched.
    ctx = ftidask.init(_config(tmp_path))
    whole, state = np.full(G, -1.0), ftidask.State(step=-1)
    ctx.protect(1, whole)
    ctx.protect(2, state)
    with pytest.raises(ftidask.RecoveryError, match="restart on 4 ranks to recover checkpoint 2") as err:
        ctx.recover()
    assert "older checkpoints of this run: 1 (level 4, 2 ranks)" in str(err.value)
    assert (whole == -1).all() and dict(state) == {"step": -1}
    ctx._close()
    got = _stage(tmp_path, 2, _recover(ckpt_id=1))
    assert got == [((1, 4), True, {"step": 10 + r}) for r in range(2)], got


@pytest.mark.parametrize("level", [1, 3, 4])
@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_a_replicated_state_is_recovered_on_any_number_of_ranks(tmp_path, level, size):
    """A Python state every rank holds alike, protected with replicated=True, comes back on another number of ranks
    (read from one old file, decoded and checked on every rank), with the declared blocks of an array."""
    def write(t):
        ctx = Context(_config(tmp_path), t)
        lo, hi = G * t.rank // 4, G * (t.rank + 1) // 4
        ctx.protect(1, _want(1)[lo:hi].copy(), global_shape=(G,), offset=(lo,))
        ctx.protect(2, ftidask.Value({"step": 41, "name": "run"}), replicated=True)
        ctx.checkpoint(1, level)
        ctx._close()

    assert run_ranks(_config(tmp_path), 4, write, wait=60) == ([None] * 4, [])

    def restart(t):
        ctx = Context(_config(tmp_path), t)
        lo, hi = G * t.rank // size, G * (t.rank + 1) // size
        a, value = np.zeros(hi - lo), ftidask.Value(None)
        ctx.protect(1, a, global_shape=(G,), offset=(lo,))
        ctx.protect(2, value, replicated=True)
        ctx.recover()
        ctx._close()
        return a.tobytes() == _want(1)[lo:hi].tobytes(), value.value

    assert run_ranks(_config(tmp_path), size, restart, wait=60) == ([(True, {"step": 41, "name": "run"})] * size, [])


def test_a_state_takes_no_block(tmp_path):
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"))
    with pytest.raises(ftidask.ProtectError, match="a Python state takes no global_shape or offset"):
        ctx.protect(2, ftidask.Value(1), global_shape=(4,), offset=(0,))
    ctx.finalize()
