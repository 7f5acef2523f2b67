"""FTI's fault-injection suites (ITF, testing/suites of FTI's repository), the scenarios not already covered.

Already covered elsewhere: the multiLevelCkpt disruption matrix (tests/test_mpi_levels.py: rank, partner and
parity files erased or corrupted, consecutive and non-consecutive nodes, the global directory; heads in
tests/test_mpi_heads.py), keep_last_ckpt with every local file lost (tests/test_mpi_misc.py), a restart on
another number of ranks (FTI's variateProcessorRestart: tests/test_mpi_reshard.py), staging
(tests/test_staging_mpi.py), differential checkpoints (tests/test_dcp*.py).

Here, over real ``mpiexec`` jobs of 4 ranks (4 simulated nodes of one rank, one group of 4), whose first run
dies with ``os._exit`` (no finalize: FTI's applications' crash) before the files are erased or corrupted:

* ckptHierarchy: checkpoints at levels 4, 3, 2, 1; the newest that survives is recovered, bit for bit;
  the files each order leaves; keep_last_ckpt leaves only the global copy;
* corner cases: keep_last_ckpt's restart (status 2), crashed again, restarts again; its global copy erased,
  a clean failure; the consistency scenario (erased redundancy rebuilt at restart);
* keepL4Ckpt: keep_l4_ckpt leaves every level-4 checkpoint in ``l4_archive`` after finalize;
* ckptDiffSizes: arrays of a size of each rank's, growing between checkpoints, recovered after realloc,
  disrupted on one node, on adjacent nodes, on every node;
* recoverVar: each variable protected and recovered alone, in a random order on each rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

import ftidask

pytestmark = need_mpi()

N = 4
CONFIG = {"local_test": 1, "node_size": 1, "group_size": 4, "block_size": 64, "transfer_size": 1}
RANK, PCOF, RSED = "Ckpt*-Rank*.fti", "Ckpt*-Pcof*.fti", "Ckpt*-RSed*.fti"


def job(*args: str, config: dict | None = None, dies: bool = False, timeout: float = 120) -> None:
    """One run of tests/mpi_scripts/itf_job.py; a run that dies may be reported as killed by mpiexec."""
    mode, base, *rest = args
    run(N, "itf_job.py", mode, json.dumps({**CONFIG, **(config or {})}), base, *rest, timeout=timeout,
        check=not dies)


def results(base: Path) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(N)]


def local(base: Path, level: int, pattern: str, nodes: list[int] | None = None) -> list[Path]:
    found = sorted(base.glob(f"Local/node*/*/l{level}/*/{pattern}"))
    return [p for p in found if nodes is None or int(p.parts[len(base.parts) + 1][4:]) in nodes]


def erase(paths: list[Path]) -> None:
    assert paths, "nothing to erase"
    for path in paths:
        path.unlink()


def corrupt(paths: list[Path]) -> None:
    """FTI's corruption: a short text written over the first bytes, the size kept."""
    assert paths, "nothing to corrupt"
    for path in paths:
        with open(path, "r+b") as fh:
            fh.write(b"TextForCorruption\n")


def assert_ok(base: Path, source: list[int]) -> None:
    got = results(base)
    assert all(r["status"] == "ok" and r["source"] == source for r in got), got


def assert_clean_failure(base: Path, error: str = "NoCheckpointError") -> None:
    """The same ftidask error on every rank, and no array touched (the job ended, so nothing hung)."""
    got = results(base)
    assert {r["status"] for r in got} == {"fail"}, got
    assert {r["error"] for r in got} == {error} and len({r["message"] for r in got}) == 1, got
    assert all(r.get("untouched", True) for r in got), got


# --- ckptHierarchy: subsequent_ckpts_restart and subsequent_checkpoints ------------------------------------

def test_hierarchy_recovers_the_newest_checkpoint_that_survives(tmp_path: Path) -> None:
    """Checkpoints 1-4 at levels 4, 3, 2, 1 and a crash; the L1 files erased: recovery from L2 (checkpoint 3);
    L2's too: from L3 (2); L3's too: from L4 (1); the global directory too: a clean failure."""
    written = tmp_path / "written"
    job("seq", str(written), "die", "4", "3", "2", "1", dies=True)
    for level in (1, 2, 3):  # secure first: every checkpoint stays (each is newer than the more secure ones)
        assert len(local(written, level, RANK)) == N
    cases = [("l1", [(1, RANK)], [3, 2]), ("l1_l2", [(1, RANK), (2, RANK), (2, PCOF)], [2, 3]),
             ("l1_l2_l3", [(1, RANK), (2, RANK), (2, PCOF), (3, RANK), (3, RSED)], [1, 4])]
    for name, erased, source in cases:
        base = tmp_path / name
        shutil.copytree(written, base)
        for level, pattern in erased:
            erase(local(base, level, pattern))
        job("recover", str(base), "finalize")
        assert_ok(base, source)
    base = tmp_path / "everything"
    shutil.copytree(written, base)
    for level, pattern in cases[-1][1]:
        erase(local(base, level, pattern))
    shutil.rmtree(base / "Global")
    job("recover", str(base), "finalize")
    assert_clean_failure(base)


@pytest.mark.parametrize("order", ["local-first", "all-l2", pytest.param("all-l1", marks=pytest.mark.slow),
                                   pytest.param("all-l3", marks=pytest.mark.slow)])
def test_files_each_checkpoint_order_leaves(tmp_path: Path, order: str) -> None:
    """local-first (1, 2, 3, 4, crash): the L4 checkpoint retires every local one. all-lN (4 checkpoints at
    level N, finalize with keep_last_ckpt): only the global copy of the last one stays, nothing on the nodes."""
    if order == "local-first":
        job("seq", str(tmp_path), "die", "1", "2", "3", "4", dies=True)
    else:
        level = order[-1]
        job("seq", str(tmp_path), "finalize", level, level, level, level, config={"keep_last_ckpt": 1})
    for level in (1, 2, 3):
        assert local(tmp_path, level, "*.fti") == []
    assert sorted(p.name for p in tmp_path.glob("Global/*/l4/*/*.fti")) == [f"Ckpt4-Rank{r}.fti" for r in range(N)]


# --- corner cases: keep_last_consistency, keep_last_ckpt's global copy erased, ckpt_consistency ---------------

@pytest.mark.parametrize("level", [2, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_keep_last_restart_crashes_and_restarts_again(tmp_path: Path, level: int) -> None:
    """keep_last_ckpt: finalize flushes the checkpoint to L4; the restart has status 2 and recovers it, dies
    without a checkpoint; the next restart (status 1) recovers the same checkpoint again, bit for bit."""
    keep, base, written = {"keep_last_ckpt": 1}, tmp_path / "run", tmp_path / "written"
    job("seq", str(written), "finalize", str(level), config=keep)
    shutil.copytree(written, base)
    job("recover", str(base), "die", config=keep, dies=True)
    assert_ok(base, [1, 4])
    assert {r["fti_status"] for r in results(base)} == {2}
    job("recover", str(base), "finalize", config=keep)
    assert_ok(base, [1, 4])
    assert {r["fti_status"] for r in results(base)} == {1}
    # FTI's standard.itf (keep_last_ckpt = 1, global directory erased): no recovery, here a clean one everywhere.
    shutil.rmtree(written / "Global")
    job("recover", str(written), "finalize", config=keep)
    assert_clean_failure(written)
    assert {r["fti_status"] for r in results(written)} == {2}


def test_redundancy_erased_while_own_files_are_sound_is_rebuilt(tmp_path: Path) -> None:
    """FTI's ckpt_consistency at L2: every partner copy erased, a restart recovers from the own files and dies;
    every own file erased, the next restart. As FTI does, the first restart rebuilds the erased partner copies
    (a stat finds them missing; nothing is read when they are there), so the second one recovers."""
    job("seq", str(tmp_path), "die", "2", dies=True)
    erase(local(tmp_path, 2, PCOF))
    job("recover", str(tmp_path), "die", dies=True)
    assert_ok(tmp_path, [1, 2])
    assert len(local(tmp_path, 2, PCOF)) == len(local(tmp_path, 2, RANK)) > 0
    erase(local(tmp_path, 2, RANK))
    job("recover", str(tmp_path), "finalize")
    assert_ok(tmp_path, [1, 2])


# --- keepL4Ckpt ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_l4", [1, 0])
def test_keep_l4_ckpt_archives_every_level_4_checkpoint(tmp_path: Path, keep_l4: int) -> None:
    """FTI's keepL4Ckpt application: checkpoints 1-8 at levels 1, 1, 4, 2, 2, 4, 3, 3 and a crash; the restart
    recovers checkpoint 8 (L3), writes 9 (L4), 10 (L1), 11 (L4) and finalizes. With keep_l4_ckpt the L4
    checkpoints 3, 6, 9 and 11 stay in {glbl_dir}/{exec_id}/l4_archive, readable; without it nothing stays."""
    cfg = {"keep_l4_ckpt": keep_l4}
    job("keepl4", str(tmp_path), config=cfg, dies=True)
    job("keepl4", str(tmp_path), config=cfg)
    got = results(tmp_path)
    assert all(r["status"] == "ok" and r["source"] == [8, 3] and r["counter"] == 9 for r in got), got
    assert list(tmp_path.glob("Local/*/*/*/*/*.fti")) == []
    assert list(tmp_path.glob("Global/*/l4/*/*")) == []
    assert list(tmp_path.glob("Meta/*/commits/*.json")) == []  # finalized: nothing left to recover by itself
    archived = sorted(tmp_path.glob("Global/*/l4_archive/*"))
    if not keep_l4:
        assert archived == [] and list(tmp_path.glob("Global/*/*")) == []
        return
    assert sorted(p.name.split(".")[0] for p in archived) == ["ckpt11", "ckpt3", "ckpt6", "ckpt9"]
    for path in archived:
        assert sorted(f.name for f in path.iterdir()) == [f"{path.name.split('.')[0].capitalize()}-Rank{r}.fti"
                                                          for r in range(N)]
    # An archived file is a whole checkpoint: recover_file reads it back, verified.
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "x/Local"), glbl_dir=str(tmp_path / "x/Global"),
                       meta_dir=str(tmp_path / "x/Meta"))
    buffer, counter = np.zeros(1024, dtype=np.uint32), ftidask.Value(0)
    ctx.protect(0, buffer)
    ctx.protect(1, counter)
    ctx.recover_file(next(p for p in archived if p.name.startswith("ckpt11.")) / "Ckpt11-Rank2.fti")
    assert counter.value == 12
    assert buffer.tobytes() == np.random.default_rng(42).integers(0, 2**32, 1024, dtype=np.uint32).tobytes()
    ctx.finalize()


# --- ckptDiffSizes: verify_log and verify_log_disrupt ------------------------------------------------------------

@pytest.fixture(scope="module")
def diffsizes_written(tmp_path_factory: pytest.TempPathFactory):
    """``level -> run directory`` of FTI's diffSizes application stopped at iteration 63 (died), once a level."""
    done: dict[int, Path] = {}

    def get(level: int) -> Path:
        if level not in done:
            base = tmp_path_factory.mktemp(f"diffsizes-l{level}")
            job("diffsizes", str(base), "1", str(level), "recover", config={"keep_last_ckpt": 1}, dies=True)
            done[level] = base
        return done[level]

    return get


DISRUPT = {  # name -> (level, damage, expected); FTI's expectations, with FTI's corruption
    "l2_none": (2, lambda b: None, "ok"),
    "l3_none": (3, lambda b: None, "ok"),
    "l1_one": (1, lambda b: corrupt(local(b, 1, RANK, [0])), "fail"),
    "l4_one": (4, lambda b: erase(sorted(b.glob("Global/*/l4/*/Ckpt*-Rank0.fti"))), "fail"),
    "l2_adjacent": (2, lambda b: (erase(local(b, 2, RANK, [0])), corrupt(local(b, 2, PCOF, [1]))), "fail"),
    "l3_adjacent": (3, lambda b: (erase(local(b, 3, RANK, [0])), corrupt(local(b, 3, RSED, [1]))), "ok"),
    "l2_non_adjacent": (2, lambda b: (corrupt(local(b, 2, RANK, [0])), erase(local(b, 2, PCOF, [2]))), "ok"),
    "l2_all_own_files": (2, lambda b: erase(local(b, 2, RANK)), "ok"),
    "l3_all_own_files": (3, lambda b: corrupt(local(b, 3, RANK)), "ok"),
    "l3_all_parity": (3, lambda b: erase(local(b, 3, RSED)), "ok"),
}
SLOW_DISRUPT = {"l1_one", "l4_one", "l2_non_adjacent", "l3_all_parity"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_DISRUPT else n
                                  for n in DISRUPT])
def test_diff_sizes_disrupted(tmp_path: Path, diffsizes_written, name: str) -> None:
    """Each rank's arrays have a size of their own and grow between checkpoints; the restart protects the
    initial size, is refused (stored size differs), reallocs, recovers checkpoint 7 (iteration 60) bit for bit
    and runs to the end; a disruption FTI cannot survive is a clean failure on every rank."""
    level, damage, expected = DISRUPT[name]
    base = tmp_path / "run"
    shutil.copytree(diffsizes_written(level), base)
    damage(base)
    style = "recover_var" if level == 3 else "recover"  # FTI_RecoverVar of each variable, or FTI_Recover
    job("diffsizes", str(base), "0", str(level), style, config={"keep_last_ckpt": 1})
    if expected == "ok":
        assert_ok(base, [7, level])
        assert sorted(p.name for p in base.glob("Global/*/l4/*/*.fti")) == [f"Ckpt12-Rank{r}.fti" for r in range(N)]
    else:
        got = results(base)
        assert {r["status"] for r in got} == {"fail"} and {r["error"] for r in got} == {"NoCheckpointError"}, got


def test_diff_sizes_mixed_recover_and_recover_var_is_a_clean_error(tmp_path: Path, diffsizes_written) -> None:
    """FTI's application recovers with FTI_Recover on even ranks and FTI_RecoverVar on odd ones (local reads in
    FTI). Recovery is collective in ftidask: the mixed calls are the same RecoveryError on every rank, naming
    each rank's call, not a hang (they used to pair unrelated collectives and spin until the job's walltime)."""
    base = tmp_path / "run"
    shutil.copytree(diffsizes_written(2), base)
    job("diffsizes", str(base), "0", "2", "mixed", config={"keep_last_ckpt": 1}, timeout=60)
    got = results(base)
    assert {r["error"] for r in got} == {"RecoveryError"} and len({r["message"] for r in got}) == 1, got
    assert "rank 0: recover(); rank 1: recover(ids=[1])" in got[0]["message"]


# --- recoverVar ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_recover_var_one_variable_at_a_time(tmp_path: Path, level: int) -> None:
    """FTI's recoverVar application: 10 variables of FTI's sizes checkpointed, a crash; the restart protects
    and recovers each one alone, in a random order (the same on every rank: recover_var is collective here),
    the others not protected yet."""
    job("recovervar", str(tmp_path), str(level), dies=True)
    job("recovervar", str(tmp_path), str(level))
    assert_ok(tmp_path, [1, level])
