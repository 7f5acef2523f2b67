"""Ranks that disagree, or one rank whose arguments are refused: ``misuse_job.py SCENARIO BASE`` on 4 ranks.

Each rank writes ``BASE/result-{rank}.json``: the error each step raised (type and message, or None), the
arrays after a final recovery of checkpoint 1 (written first, by every rank alike), and the checkpoint that
recovery came from. tests/test_misuse_mpi.py checks that every rank raised the same ftidask error, that
nothing hung, and that checkpoint 1 stayed the newest recoverable one.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ftidask

RANK = MPI.COMM_WORLD.rank


def dirs(base: str) -> dict[str, Any]:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta",
            "local_test": 1, "node_size": 1, "group_size": 4, "verbosity": 4}


def outcome(step: Callable[[], Any]) -> dict[str, str] | None:
    """None when ``step`` returned; else the error it raised (what every rank must agree on)."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to compare between ranks
        return {"type": type(exc).__name__, "message": str(exc), "fti": isinstance(exc, ftidask.FTIError)}
    return None


def mine(value: Any, other: Any, on: int = 1) -> Any:
    """``value`` on every rank but rank ``on``, which gets ``other``."""
    return other if RANK == on else value


def finalize_icp_beside_recover(ctx: Any) -> None:
    ctx.init_icp(2, 1)
    ctx.add_var_icp(1)
    try:
        ctx.finalize_icp() if RANK == 0 else ctx.recover()
    finally:
        ctx._abort_icp()  # left open on every rank by the refusal: dropped here, the run goes on from checkpoint 1


def async_snapshot_fails_on_one_rank(ctx: Any) -> None:
    from ftidask.engine import snapshot

    take = snapshot.take
    if RANK == 1:  # a test seam: rank 1's snapshot (its copy-on-write set-up, a copy) fails at the call
        snapshot.take = lambda *args, **kw: (_ for _ in ()).throw(MemoryError("snapshot copy"))
    try:
        ctx.checkpoint(2, 1, wait=False).result()
    finally:
        snapshot.take = take


def icp_exception_on_one_rank(ctx: Any) -> None:
    with ctx.incremental(2, 1) as inc:
        inc.add(1)
        if RANK == 1:
            raise ValueError("the application failed on rank 1")


def icp(activate: Any) -> Callable[[Any], Any]:
    return lambda ctx: (ctx.init_icp(2, 1, activate=activate), ctx.add_var_icp(1), ctx.finalize_icp())


# Each scenario: what the ranks do after checkpoint 1 of array ``a`` (a[:] = 1 + rank, then changed to -1).
SCENARIOS: dict[str, Callable[[Any], Any]] = {
    "ckpt_id_differs": lambda ctx: ctx.checkpoint(2 + RANK, 1),
    "level_differs": lambda ctx: ctx.checkpoint(2, mine(1, 4)),
    "dcp_level_differs": lambda ctx: ctx.checkpoint(2, mine(4, 8)),
    "level_refused_on_one_rank": lambda ctx: ctx.checkpoint(2, mine(1, 9)),
    "ckpt_id_refused_on_one_rank": lambda ctx: ctx.checkpoint(mine(2, 0), 1),
    "async_on_one_rank": lambda ctx: ctx.checkpoint(2, 1, wait=mine(True, False)),
    "icp_id_differs": lambda ctx: (ctx.init_icp(mine(2, 3), 1), ctx.add_var_icp(1), ctx.finalize_icp()),
    "icp_level_refused_on_one_rank": lambda ctx: ctx.init_icp(2, mine(1, 9)),
    "checkpoint_beside_recover": lambda ctx: ctx.checkpoint(2, 1) if RANK == 0 else ctx.recover(),
    "finalize_beside_checkpoint": lambda ctx: ctx.finalize() if RANK == 0 else ctx.checkpoint(2, 1),
    "recover_ckpt_id_str_on_one_rank": lambda ctx: ctx.recover(ckpt_id=mine(1, "1")),
    "realloc_refused_on_one_rank": lambda ctx: ctx.realloc(mine(1, "x")),
    "finalize_icp_beside_recover": finalize_icp_beside_recover,
    "async_snapshot_fails_on_one_rank": async_snapshot_fails_on_one_rank,
    "recover_var_refused_on_one_rank": lambda ctx: ctx.recover_var(mine(1, "x")),
    "icp_activate_refused_on_one_rank": icp(mine(True, "yes")),
    "icp_activate_false_on_one_rank": icp(mine(True, False)),
    "icp_exception_on_one_rank": icp_exception_on_one_rank,
    # Their ranks raise errors of their own (each met another call's collective): ftidask errors, never a raw one
    "snapshot_beside_checkpoint": lambda ctx: (ctx.snapshot(), ctx.snapshot() if RANK == 0 else ctx.checkpoint(2, 1)),
    "restart_stored_size_beside_recover": lambda ctx: ctx.stored_size(1) if RANK == 1 else ctx.recover(),
    "restart_stored_size_beside_checkpoint": lambda ctx: ctx.stored_size(1) if RANK == 1 else ctx.checkpoint(2, 1),
    # Not misuse: every rank in step (before, rank 1 skipped the collective read of the sizes, and fell out of step)
    "restart_realloc_state_on_one_rank": lambda ctx: (ctx.realloc(2), ctx.stored_size(1, total=True)),
}


def main() -> None:
    scenario, base = sys.argv[1], sys.argv[2]
    result: dict[str, Any] = {}
    if scenario == "init_refused_on_one_rank":
        result["error"] = outcome(lambda: ftidask.init(comm=MPI.COMM_WORLD, **dirs(base), ckpt_l1=mine(1, "x")))
    elif scenario == "init_cwd_removed_on_one_rank":  # relative directories, rank 1's working directory removed
        os.chdir(base)
        if RANK == 1:
            Path("gone").mkdir()
            os.chdir("gone")
            os.rmdir(Path(base, "gone"))
        relative = {**dirs(base), "ckpt_dir": "Local", "glbl_dir": "Global", "meta_dir": "Meta"}
        result["error"] = outcome(lambda: ftidask.init(comm=MPI.COMM_WORLD, **relative))
    else:
        every = {"ckpt_l1": 1} if scenario.startswith("snapshot") else {}
        ctx = ftidask.init(comm=MPI.COMM_WORLD, enable_dcp=1, **dirs(base), **every)
        a = np.full(5, 1.0 + RANK)
        ctx.protect(1, a)
        mixed = scenario == "restart_realloc_state_on_one_rank"  # variable 2: a Python state on rank 1 only
        if mixed:
            ctx.protect(2, mine(np.zeros(3), ftidask.State({"x": 1})))
        ctx.checkpoint(1, 1)
        if scenario.startswith("restart"):  # the program dies; a new one starts and reads the checkpoint's sizes
            ctx._close()
            ctx = ftidask.init(comm=MPI.COMM_WORLD, enable_dcp=1, **dirs(base))
            ctx.protect(1, a)
            if mixed:
                ctx.protect(2, mine(np.zeros(3), ftidask.State({"x": 0})))
        a[:] = -1
        result["error"] = outcome(lambda: SCENARIOS[scenario](ctx))
        a[:] = -1
        result["recover"] = outcome(ctx.recover)  # the ranks are in step again: checkpoint 1 comes back
        result["a"], result["from"] = a.tolist(), ctx.recovered_from
        ctx.finalize()
    Path(base, f"result-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
