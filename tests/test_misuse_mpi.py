"""Misuse over MPI: ranks that ask for different checkpoints or recoveries, or one rank whose arguments are
refused, get the same ftidask error on every rank (no hang, no checkpoint committed with another id or level
on each rank), and the previous checkpoint stays the newest recoverable one (tests/mpi_scripts/misuse_job.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()


def _results(base: Path) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize(("scenario", "error", "match"), [
    # Before: each rank committed "its" checkpoint, and none could be recovered (or a hang).
    ("ckpt_id_differs", "CheckpointError", "rank 0: checkpoint(id=2, level=1, wait=True); rank 1: checkpoint(id=3"),
    ("level_differs", "CheckpointError", "rank 1: checkpoint(id=2, level=4"),
    ("dcp_level_differs", "CheckpointError", "rank 1: checkpoint(id=2, level=8"),
    ("async_on_one_rank", "CheckpointError", "rank 1: checkpoint(id=2, level=1, wait=False)"),
    ("icp_id_differs", "CheckpointError", "rank 1: init_icp(id=3, level=1, activate=True)"),
    # Before: the refusing rank raised alone; the others waited in the checkpoint's collectives.
    ("level_refused_on_one_rank", "LevelError", "rank 1: unknown checkpoint level 9"),
    ("ckpt_id_refused_on_one_rank", "CheckpointError", "rank 1: checkpoint id 0 is reserved"),
    ("icp_level_refused_on_one_rank", "LevelError", "rank 1: unknown checkpoint level 9"),
    ("realloc_refused_on_one_rank", "ProtectError", "rank 1: variable id must be an int, got 'x'"),
    # Before: a raw TypeError from the paired collectives, then a hang.
    # (one class on every rank, FTIError: each rank's own call's class would differ from rank to rank)
    ("checkpoint_beside_recover", "FTIError", "rank 0: checkpoint(id=2, level=1, wait=True); ranks 1-3: recover("),
    # Before: rank 0 removed the run's files while the others wrote checkpoint 2 (a raw error or a hang).
    ("finalize_beside_checkpoint", "FTIError", "rank 0: finalize(); ranks 1-3: checkpoint(id=2, level=1, wait=True)"),
    # Before: rank 1 looked for a checkpoint "1", found none, and the ranks' recoveries diverged.
    ("recover_ckpt_id_str_on_one_rank", "RecoveryError",
     "rank 1: recover(ckpt_id=...): a checkpoint id must be an int"),
    # Before: finalize_icp met recover's collective (a raw TypeError), then a hang.
    ("finalize_icp_beside_recover", "FTIError", "rank 0: finalize_icp(active=True); ranks 1-3: recover()"),
    # Before: rank 1 raised a raw MemoryError alone; the others' checkpoints waited for it forever.
    ("async_snapshot_fails_on_one_rank", "CheckpointError", "rank 1: the snapshot failed: MemoryError: snapshot copy"),
    # Before: the refusing rank raised alone (a hang, or errors naming the calls made after).
    ("recover_var_refused_on_one_rank", "RecoveryError", "rank 1: recover_var(...): variable id must be an int"),
    ("icp_activate_refused_on_one_rank", "CheckpointError", "rank 1: init_icp(activate=...) takes True or False"),
    ("icp_activate_false_on_one_rank", "CheckpointError", "rank 1: init_icp(id=2, level=1, activate=False)"),
])
def test_ranks_that_disagree_get_the_same_error(tmp_path: Path, scenario: str, error: str | None,
                                                match: str) -> None:
    run(4, "misuse_job.py", scenario, str(tmp_path), timeout=120)
    results = _results(tmp_path)
    errors = [r["error"] for r in results]
    assert all(e is not None and e["fti"] for e in errors), errors
    assert len({e["message"] for e in errors}) == 1, errors  # the same sentence everywhere
    assert match in errors[0]["message"], errors[0]
    if error is not None:
        assert {e["type"] for e in errors} == {error}, errors
    for rank, r in enumerate(results):  # the previous checkpoint is still the newest recoverable one
        assert r["recover"] is None and r["from"] == [1, 1] and r["a"] == [1.0 + rank] * 5, r


@pytest.mark.parametrize("scenario", ["snapshot_beside_checkpoint", "restart_stored_size_beside_recover",
                                      "restart_stored_size_beside_checkpoint"])
def test_a_call_that_meets_another_calls_collective_raises_an_ftidask_error(tmp_path: Path, scenario: str) -> None:
    """A rank whose snapshot() (or a restart's stored_size(), which reads the checkpoint's sizes with the others)
    meets another rank's checkpoint or recover: before, a raw TypeError or ValueError from the collective's
    unpacking; now each rank an ftidask error saying the ranks made different collective calls."""
    run(4, "misuse_job.py", scenario, str(tmp_path), timeout=120)
    results = _results(tmp_path)
    errors = [r["error"] for r in results]
    assert all(e is not None and e["fti"] and "different collective calls" in e["message"] for e in errors), errors
    for rank, r in enumerate(results):
        assert r["recover"] is None and r["from"] == [1, 1] and r["a"] == [1.0 + rank] * 5, r


def test_realloc_of_a_variable_some_ranks_keep_as_a_python_state_keeps_the_ranks_in_step(tmp_path: Path) -> None:
    run(4, "misuse_job.py", "restart_realloc_state_on_one_rank", str(tmp_path), timeout=120)
    for rank, r in enumerate(_results(tmp_path)):
        assert r["error"] is None and r["recover"] is None and r["a"] == [1.0 + rank] * 5, r


def test_an_exception_in_an_incremental_checkpoint_on_one_rank_drops_it_on_every_rank(tmp_path: Path) -> None:
    """``with ctx.incremental(...)`` left by an exception on rank 1: before, rank 1 dropped its checkpoint alone
    and the others' finalize_icp waited for it; now they drop theirs too and say why."""
    run(4, "misuse_job.py", "icp_exception_on_one_rank", str(tmp_path), timeout=120)
    results = _results(tmp_path)
    assert results[1]["error"]["type"] == "ValueError", results[1]  # the application's own, on its rank
    for rank in (0, 2, 3):
        error = results[rank]["error"]
        assert error["type"] == "CheckpointError" and "incremental checkpoint 2 dropped on an exception (" \
            "ValueError: the application failed on rank 1)" in error["message"], error
    for rank, r in enumerate(results):
        assert r["recover"] is None and r["from"] == [1, 1] and r["a"] == [1.0 + rank] * 5, r


def test_config_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    run(4, "misuse_job.py", "init_refused_on_one_rank", str(tmp_path), timeout=120)  # before: 3 ranks hung
    errors = [r["error"] for r in _results(tmp_path)]
    assert {e["type"] for e in errors} == {"ConfigError"} and len({e["message"] for e in errors}) == 1, errors
    assert "rank 1: config key '[basic] ckpt_l1': expected an integer, got 'x'" in errors[0]["message"]


def test_a_working_directory_removed_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Relative directories on a rank whose working directory was removed: before, a raw FileNotFoundError there
    and the other ranks waiting in init's first collective forever."""
    run(4, "misuse_job.py", "init_cwd_removed_on_one_rank", str(tmp_path), timeout=120)
    errors = [r["error"] for r in _results(tmp_path)]
    assert {e["type"] for e in errors} == {"ConfigError"} and len({e["message"] for e in errors}) == 1, errors
    assert "rank 1: the run's directories cannot be resolved" in errors[0]["message"], errors[0]


NULL_COMM = r"""
import sys
from mpi4py import MPI
import ftidask

base = sys.argv[1]
dirs = dict(ckpt_dir=base + "/L", glbl_dir=base + "/G", meta_dir=base + "/M", local_test=1)
with ftidask.init(comm=MPI.COMM_WORLD, **dirs) as ctx:
    freed = ctx.comm                          # FTI_COMM_WORLD: freed by finalize
for comm in (MPI.COMM_NULL, freed):
    try:
        ftidask.init(comm=comm, **dirs)
    except ftidask.FTIError as exc:
        with open(f"{base}/null-{MPI.COMM_WORLD.rank}.txt", "a") as out:  # the ranks' stdout lines interleave
            out.write(f"{type(exc).__name__} {exc}\n")
"""


def test_init_with_a_null_communicator_says_so(tmp_path: Path) -> None:
    """MPI.COMM_NULL (or ctx.comm of a finalized context) as comm: an FTIError saying what to pass (before: a raw
    mpi4py 'Invalid communicator' traceback from deep inside init)."""
    import subprocess
    import sys

    from mpi_util import env, mpiexec

    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", NULL_COMM, str(tmp_path)], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = [line for r in range(2) for line in (tmp_path / f"null-{r}.txt").read_text().splitlines()]
    assert len(lines) == 4 and all(line.startswith("FTIError comm is MPI.COMM_NULL") for line in lines), lines
    assert all("MPI.COMM_WORLD" in line for line in lines), lines
