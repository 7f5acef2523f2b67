"""Rank script of the one-rank-failure tests: a fault on one rank must give every rank the same error.

usage: one_rank_fault_job.py DIR SCENARIO [SCENARIO ...]
       one_rank_fault_job.py DIR heads-SCENARIO      (4 processes: 2 nodes of a head and an application rank)

For each scenario, in ``DIR/<scenario>``: a first run writes checkpoint 1 (and more for the
differential levels); then a fault is planted on one rank only, by monkeypatching a function of
ftidask in that rank's process (the test seam), and the collective step under test runs; then a
restart (a new ``init`` on the same directories, in the same processes) recovers. Each rank writes
``DIR/<scenario>-<rank>.json``: {"error": class name or null, "message", "recovered": [ckpt_id, level]
or null, "same": whether the recovered arrays are the expected ones, "expected": ckpt id}.
With heads, the fault is planted in one head; each application rank reports the head's reply
("reply") to its checkpoint 2 at level 2, and what the restart recovers (the L1 checkpoint 2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.backends.mpi import heads
from ftidask.engine import claim as run_claim
from ftidask.engine import dcpstore, grouplevels, pending, runstate
from ftidask.engine import recovering as context_recovery
from ftidask.engine import writing as context_writing
from ftidask.levels import erasure, partner, partner_delta, rs_delta
from ftidask.storage import files as storage

RANK = MPI.COMM_WORLD.rank
BASE = {"local_test": 1, "node_size": 1, "group_size": MPI.COMM_WORLD.size, "verbosity": 4}


def data(step: int) -> np.ndarray:
    """The protected array after ``step`` steps (different on every rank and step)."""
    return np.arange(20000, dtype=np.float64) * (RANK + 1) + step


def dirs(base: Path) -> dict[str, str]:
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta")}


@contextlib.contextmanager
def fault(victim: int, owner: Any, name: str, exc: BaseException) -> Iterator[None]:
    """``owner.name`` raises ``exc`` on rank ``victim`` only, inside the block."""
    if RANK != victim:
        yield
        return
    original = getattr(owner, name)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    setattr(owner, name, broken)
    try:
        yield
    finally:
        setattr(owner, name, original)


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def start(base: Path, cfg: dict[str, Any]) -> ftidask.Context:
    return ftidask.init(comm=MPI.COMM_WORLD, **BASE, **cfg, **dirs(base))


def first_run(base: Path, cfg: dict[str, Any], levels: list[int]) -> tuple[ftidask.Context, np.ndarray]:
    ctx = start(base, cfg)
    array = data(0)
    ctx.protect(1, array)
    for step, level in enumerate(levels, 1):
        array[:] = data(step)
        ctx.checkpoint(step, level)
    return ctx, array


def restart(base: Path, cfg: dict[str, Any]) -> tuple[list[int] | None, np.ndarray | None]:
    ctx = start(base, cfg)
    array = np.zeros(20000)
    ctx.protect(1, array)
    try:
        ctx.recover()
    finally:
        ctx._close()
    return list(ctx.recovered_from or ()), array


# Each scenario: (config, levels of the first run, the failing action, the checkpoint that a restart recovers).
# The action gets (base, ctx of the first run, its array) and runs the step under test with the fault planted.

def ckpt_fault(level: int, victim: int, owner: Any, name: str, exc: BaseException) -> Callable[..., None]:
    def action(base: Path, ctx: ftidask.Context, array: np.ndarray) -> None:
        array[:] = data(99)
        with fault(victim, owner, name, exc):
            ctx.checkpoint(ctx.progress.next_ckpt_id, level)
    return action


def icp_fault(base: Path, ctx: ftidask.Context, array: np.ndarray) -> None:
    array[:] = data(99)
    with fault(1, pending.RankFileWriter, "write_var", MemoryError()):
        ctx.init_icp(2, 1)
        ctx.add_var_icp(1)
        ctx.finalize_icp()


def init_fault(victim: int, owner: Any, name: str, exc: BaseException) -> Callable[..., None]:
    def action(base: Path, ctx: ftidask.Context, array: np.ndarray) -> None:
        ctx._close()
        with fault(victim, owner, name, exc):
            start(base, {})._close()
    return action


def recover_fault(victim: int, owner: Any, name: str, exc: BaseException, lose: str = "") -> Callable[..., None]:
    def action(base: Path, ctx: ftidask.Context, array: np.ndarray) -> None:
        ctx._close()
        MPI.COMM_WORLD.Barrier()
        if lose and RANK == 1:  # rank 1's node loses its file: L2 rebuilds it from the partner copy
            for path in (base / "Local").rglob(lose):
                path.unlink()
        MPI.COMM_WORLD.Barrier()
        with fault(victim, owner, name, exc):
            restart(base, {})
    return action


def finalize_fault(victim: int, owner: Any, name: str, exc: BaseException) -> Callable[..., None]:
    def action(base: Path, ctx: ftidask.Context, array: np.ndarray) -> None:
        with fault(victim, owner, name, exc):
            ctx.finalize()
    return action


SCENARIOS: dict[str, tuple[dict[str, Any], list[int], Callable[..., None], int | None]] = {
    # checkpoint: the plan (rank 0 picks the sequence number), the write, the levels, the commit, retirement
    "plan": ({}, [1], ckpt_fault(1, 0, runstate.RunState, "next_seq", OSError(errno.EIO, "I/O error")), 1),
    "write": ({}, [1], ckpt_fault(1, 1, context_writing, "write_rank_file", MemoryError()), 1),
    "write-unexpected": ({}, [1], ckpt_fault(1, 2, context_writing, "write_rank_file", TypeError("masked")), 1),
    "l2": ({}, [2], ckpt_fault(2, 1, partner, "read_block", MemoryError()), 1),
    "l3": ({}, [3], ckpt_fault(3, 2, erasure.ReedSolomon, "encode", MemoryError()), 1),
    "l6": ({"enable_dcp": 1}, [6, 6], ckpt_fault(6, 1, partner_delta, "file_fb_hash", MemoryError()), 2),
    "l7": ({"enable_dcp": 1}, [7, 7], ckpt_fault(7, 1, rs_delta, "patch_parity", MemoryError()), 2),
    "commit-enospc": ({}, [1], ckpt_fault(1, 0, storage, "write_json_atomic", no_space()), 1),
    "commit-edquot": ({}, [2], ckpt_fault(2, 0, storage, "write_json_atomic",
                                          OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))), 1),
    "retire": ({}, [1], ckpt_fault(1, 0, runstate.RunState, "delete_record", OSError(errno.EACCES, "denied")), 99),
    "retire-dcp": ({"enable_dcp": 1}, [5], ckpt_fault(5, 2, dcpstore.DcpStore, "retire", MemoryError()), 99),
    "icp": ({}, [1], icp_fault, 1),
    # init: rank 0 resolves the run; every rank collects garbage
    "init-resolve": ({}, [1], init_fault(0, run_claim, "claim_run", no_space()), 1),
    "init-gc": ({}, [1], init_fault(1, storage, "collect_level_garbage", MemoryError()), 1),
    # recover: choosing the record, the rebuild, the load
    "recover-check": ({}, [1], recover_fault(1, context_recovery, "check_file", MemoryError()), 1),
    "recover-rebuild": ({}, [2], recover_fault(1, grouplevels, "check_file", MemoryError(), "Ckpt1-Rank1.fti"), 1),
    "recover-load": ({}, [1], recover_fault(2, context_recovery, "load_file", MemoryError()), 1),
    # finalize: the flush of keep_last_ckpt, the clean-up
    "finalize-flush": ({"keep_last_ckpt": 1}, [1], finalize_fault(1, storage, "copy_file_atomic", MemoryError()), 1),
    "finalize-clean": ({}, [1], finalize_fault(1, storage, "discard", MemoryError()), None),
}


def run_scenario(root: Path, name: str) -> None:
    cfg, levels, action, expected = SCENARIOS[name]
    base = root / name
    if RANK == 0:
        shutil.rmtree(base, ignore_errors=True)
    MPI.COMM_WORLD.Barrier()
    ctx, array = first_run(base, cfg, levels)
    result: dict[str, Any] = {"error": None, "message": "", "recovered": None, "same": None, "expected": expected}
    try:
        action(base, ctx, array)
    except ftidask.FTIError as exc:
        result.update(error=type(exc).__name__, message=str(exc))
    except Exception as exc:  # noqa: BLE001 - a raw exception is what the test must not see
        result.update(error=f"raw {type(exc).__name__}", message=str(exc))
    if not ctx._closed:
        ctx._close()  # the job "dies" here; the restart below is a new run on the same directories
    if expected is not None:
        # "step" of the checkpoint to recover: 99 when the failed step's checkpoint was committed
        step = 99 if expected == 99 else len(levels)
        source, got = restart(base, {key: value for key, value in cfg.items() if key != "keep_last_ckpt"})
        result.update(recovered=source, same=got is not None and bool((got == data(step)).all()))
    (root / f"{name}-{RANK}.json").write_text(json.dumps(result))


# Heads (world ranks 0 and 2 are the heads of nodes 0 and 1): the victim is a head's world rank.
HEADS: dict[str, tuple[int, Any, str, BaseException]] = {
    "heads-place": (2, heads, "_link_or_copy", MemoryError()),
    "heads-commit": (0, storage, "write_json_atomic", no_space()),
}


def run_heads(root: Path, name: str) -> None:
    victim, owner, attr, exc = HEADS[name]
    base = root / name
    cfg = {"head": 1, "inline_l2": 0, "node_size": 2, "group_size": 2, "verbosity": 4}
    for restart_run in (False, True):  # a head serves inside init until the application ranks end
        try:
            # A new communicator for the restart: the first run's close marked the one its heads served as ended
            # (a head's process exits there; this one catches SystemExit and serves the restart). Dup is collective.
            comm = MPI.COMM_WORLD.Dup()
            with fault(victim if not restart_run else -1, owner, attr, exc):
                ctx = ftidask.init(comm=comm, local_test=1, **cfg, **dirs(base))
        except SystemExit:
            continue  # a head: its application ranks have ended
        array = np.zeros(20000) if restart_run else data(1)
        ctx.protect(1, array)
        if not restart_run:
            ctx.checkpoint(1, 1)
            array[:] = data(2)
            ctx.checkpoint(2, 2)  # written at L1, raised to L2 by the heads
            reply = ctx.wait_post_processing()
        else:
            ctx.recover()
            result = {"reply": reply, "recovered": list(ctx.recovered_from or ()),
                      "same": bool((array == data(2)).all())}
            (root / f"{name}-{RANK}.json").write_text(json.dumps(result))
        ctx._close()


def main() -> None:
    root = Path(sys.argv[1])
    for name in sys.argv[2:]:
        if name.startswith("heads-"):
            run_heads(root, name)
        else:
            run_scenario(root, name)


if __name__ == "__main__":
    main()
