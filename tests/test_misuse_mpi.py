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
    ("icp_id_differs", "CheckpointError", "rank 1: init_icp(id=3, level=1)"),
    # Before: the refusing rank raised alone; the others waited in the checkpoint's collectives.
    ("level_refused_on_one_rank", "LevelError", "rank 1: unknown checkpoint level 9"),
    ("ckpt_id_refused_on_one_rank", "CheckpointError", "rank 1: checkpoint id 0 is reserved"),
    ("icp_level_refused_on_one_rank", "LevelError", "rank 1: unknown checkpoint level 9"),
    ("realloc_refused_on_one_rank", "ProtectError", "rank 1: variable id must be an int, got 'x'"),
    # Before: a raw TypeError from the paired collectives, then a hang.
    ("checkpoint_beside_recover", None, "rank 0: checkpoint(id=2, level=1, wait=True); ranks 1-3: recover("),
    # Before: rank 0 removed the run's files while the others wrote checkpoint 2 (a raw error or a hang).
    ("finalize_beside_checkpoint", None, "rank 0: finalize(); ranks 1-3: checkpoint(id=2, level=1, wait=True)"),
    # Before: rank 1 looked for a checkpoint "1", found none, and the ranks' recoveries diverged.
    ("recover_ckpt_id_str_on_one_rank", "RecoveryError",
     "rank 1: recover(ckpt_id=...): a checkpoint id must be an int"),
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


def test_config_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    run(4, "misuse_job.py", "init_refused_on_one_rank", str(tmp_path), timeout=120)  # before: 3 ranks hung
    errors = [r["error"] for r in _results(tmp_path)]
    assert {e["type"] for e in errors} == {"ConfigError"} and len({e["message"] for e in errors}) == 1, errors
    assert "rank 1: config key '[basic] ckpt_l1': expected an integer, got 'x'" in errors[0]["message"]
