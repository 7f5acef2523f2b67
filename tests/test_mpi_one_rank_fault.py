"""MPI: an exception on one rank, in any collective step, gives every rank the same ftidask error (no hang).

Each scenario plants a fault on one rank only (a monkeypatched function in that rank's process,
see ``mpi_scripts/one_rank_fault_job.py``), runs the step, then restarts on the same directories:
the previous checkpoint is recovered (or the new one, when the fault struck after its commit).
Several scenarios share one ``mpiexec`` launch; a hang fails the test at the timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

from mpi_util import need_mpi, run

pytestmark = need_mpi()
NRANKS = 3

# scenario -> (error class on every rank, what the message says, the failing rank it names)
CHECKPOINT = {
    "plan": ("CheckpointError", "I/O error", 0),
    "write": ("CheckpointError", "MemoryError", 1),
    "write-unexpected": ("CheckpointError", "TypeError: masked", 2),
    "l2": ("CheckpointError", "MemoryError", 1),
    "l3": ("CheckpointError", "MemoryError", 2),
    "l6": ("CheckpointError", "MemoryError", 1),
    "l7": ("CheckpointError", "MemoryError", 1),
    "commit-enospc": ("CheckpointError", "No space left on device", 0),
    "commit-edquot": ("CheckpointError", "quota exceeded", 0),
    "retire": ("CheckpointError", "denied", 0),
    "retire-dcp": ("CheckpointError", "MemoryError", 2),
    "icp": ("CheckpointError", "MemoryError", 1),
}
OTHERS = {
    "init-resolve": ("FTIError", "No space left on device", 0),
    "init-gc": ("FTIError", "MemoryError", 1),
    "recover-check": ("NoCheckpointError", "MemoryError", 1),
    "recover-rebuild": ("NoCheckpointError", "", 1),
    "recover-load": ("RecoveryError", "MemoryError", 2),
    "finalize-flush": ("CheckpointError", "MemoryError", 1),
    "finalize-clean": ("FTIError", "MemoryError", 1),
}


def _check(root: Path, cases: dict[str, tuple[str, str, int]]) -> None:
    for name, (error, words, rank) in cases.items():
        results = [json.loads((root / f"{name}-{r}.json").read_text()) for r in range(NRANKS)]
        assert {r["error"] for r in results} == {error}, (name, results)
        assert len({r["message"] for r in results}) == 1, (name, results)  # the same error on every rank
        message = results[0]["message"]
        assert words in message and f"rank {rank}" in message, (name, message)
        expected = results[0]["expected"]
        if expected is None:
            continue
        # The restart recovers the previous checkpoint, or (fault after the commit) the new one, intact.
        assert all(r["same"] for r in results), (name, results)
        if expected != 99:
            assert {tuple(r["recovered"])[0] for r in results} == {expected}, (name, results)


def test_one_rank_fault_in_checkpoint(tmp_path: Path) -> None:
    run(NRANKS, "one_rank_fault_job.py", str(tmp_path), *CHECKPOINT, timeout=300)
    _check(tmp_path, CHECKPOINT)


def test_one_rank_fault_in_init_recover_finalize(tmp_path: Path) -> None:
    run(NRANKS, "one_rank_fault_job.py", str(tmp_path), *OTHERS, timeout=300)
    _check(tmp_path, OTHERS)



def test_one_rank_fault_in_a_head(tmp_path: Path) -> None:
    """Heads raising L1 to L2: a fault in one head gives every application rank the same failed reply,
    and checkpoint 2 stays a valid L1 checkpoint."""
    names = {"heads-place": "node 1: MemoryError", "heads-commit": "No space left on device"}
    run(4, "one_rank_fault_job.py", str(tmp_path), *names, timeout=300)
    for name, words in names.items():
        results = [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in (1, 3)]  # the application ranks
        assert all(r["reply"] == results[0]["reply"] for r in results), (name, results)
        assert results[0]["reply"]["ok"] is False and words in results[0]["reply"]["error"], (name, results)
        assert all(r["recovered"] == [2, 1] and r["same"] for r in results), (name, results)
