"""Heads (head = 1, inline_lN = 0) under faults, on real mpiexec: a head or an application rank SIGKILLed while the
head raises a checkpoint (tests/crashpoints.py), finalize while the head works, restarts with and without heads,
``post_processing_done`` with asynchronous checkpoints. Jobs: ``mpi_scripts/heads_fault_job.py``.

8 processes = 4 simulated nodes of a head and an application rank, one group of 4 (as test_mpi_heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()

HEADS = {"local_test": 1, "node_size": 2, "group_size": 4, "head": 1, "inline_l2": 0, "inline_l3": 0, "inline_l4": 0}
NO_HEADS = {"local_test": 1, "node_size": 1, "group_size": 4}
NAPP = 4


def _write(base: Path, cfg: dict, levels: str, kill: str = "", nprocs: int = 8) -> str:
    """The write job; a kill tears the job down (mpiexec ends it: the test fails at the timeout on a hang)."""
    proc = run(nprocs, "heads_fault_job.py", "write", json.dumps(cfg), str(base), levels, kill, timeout=120,
               check=not kill)
    if kill:
        assert proc.returncode != 0, proc.stdout  # the crash point was reached: the job was torn down
    return proc.stdout


def _recover(base: Path, cfg: dict, nprocs: int = 8) -> list[dict]:
    run(nprocs, "heads_fault_job.py", "recover", json.dumps(cfg), str(base), timeout=120)
    results = [json.loads(p.read_text()) for p in sorted(base.glob("result-*.json"))]
    assert len(results) == NAPP, results
    return results


def _assert_recovered(results: list[dict], source: list[int]) -> None:
    assert all(r["status"] == "ok" and r["same"] for r in results), results
    assert {tuple(r["source"]) for r in results} == {tuple(source)}, results


def test_post_processing_done_waits_for_an_async_checkpoint(tmp_path: Path) -> None:
    """``post_processing_done`` right after ``checkpoint(wait=False)`` must not say True before the checkpoint
    is even committed: when it says True, the commit records show the checkpoint at its target level."""
    stdout = _write(tmp_path / "run", {**HEADS, "wait": False, "poll": True}, "3,2,4")
    polls = [line.split()[1:] for line in stdout.splitlines() if line.startswith("POLL ")]
    assert len(polls) == 3 * NAPP, stdout
    for _rank, ckpt, level, first in polls:
        assert first == "False", polls  # asked at once: the background is still writing it
        assert level == {"1": "3", "2": "2", "3": "4"}[ckpt], polls
