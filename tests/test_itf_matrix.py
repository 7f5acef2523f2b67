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
* recoverVar: each variable protected and recovered alone, in a random order on each rank;
* dCP's corrupt_check: differential checkpoints (levels 5-8), a random rank's newest file truncated by a
  random tail between runs.

Their head = 1 variants (8 processes: 4 nodes of a head and a rank, inline_l2/3/4 = 0: the heads raise each
checkpoint), and 16 ranks of 4 nodes (node_size 4, group_size 4; slow), in the same scenarios: the
``layout`` parameter (:class:`Layout`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

import ftidask
from ftidask.storage.files import TRASH_PREFIX

pytestmark = need_mpi()

@dataclass(frozen=True)
class Layout:
    """The shape of a job: its processes, the application's ranks among them, their configuration."""

    name: str
    procs: int
    ranks: int
    config: dict


BASE = {"local_test": 1, "group_size": 4, "block_size": 64, "transfer_size": 1}
FLAT = Layout("flat", 4, 4, {**BASE, "node_size": 1})  # 4 nodes of one rank, one group of 4
# FTI's head = 1, as its ITF sets it up (fti_config_set_noinline): 4 nodes of a head and a rank, the heads
# raise each L1 checkpoint to L2-L4 (and retire the older ones) while the application runs on.
HEADS = Layout("heads", 8, 4, {**BASE, "node_size": 2, "head": 1, "inline_l2": 0, "inline_l3": 0, "inline_l4": 0})
WIDE = Layout("wide", 16, 16, {**BASE, "node_size": 4})  # 4 nodes of 4 ranks: 4 groups of 4, one rank a node
N = FLAT.ranks
RANK, PCOF, RSED = "Ckpt*-Rank*.fti", "Ckpt*-Pcof*.fti", "Ckpt*-RSed*.fti"


def job(*args: str, config: dict | None = None, dies: bool = False, timeout: float = 120,
        layout: Layout = FLAT) -> None:
    """One run of tests/mpi_scripts/itf_job.py; a run that dies may be reported as killed by mpiexec."""
    mode, base, *rest = args
    run(layout.procs, "itf_job.py", mode, json.dumps({**layout.config, **(config or {})}), base, *rest,
        timeout=timeout * layout.procs / FLAT.procs, check=not dies)


def results(base: Path, layout: Layout = FLAT) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(layout.ranks)]


def live(paths: Iterable[Path]) -> list[Path]:
    """``paths`` but those in the trash: a retired checkpoint's directory is renamed ``.trash-...`` and deleted by a
    background thread, which a process that dies at once (``os._exit``) may leave for the next start to collect."""
    return sorted(p for p in paths if not any(part.startswith(TRASH_PREFIX) for part in p.parts))


def local(base: Path, level: int, pattern: str, nodes: list[int] | None = None) -> list[Path]:
    found = live(base.glob(f"Local/node*/*/l{level}/*/{pattern}"))
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


def assert_ok(base: Path, source: list[int], layout: Layout = FLAT) -> None:
    got = results(base, layout)
    assert all(r["status"] == "ok" and r["source"] == source for r in got), got


def assert_clean_failure(base: Path, error: str = "NoCheckpointError", layout: Layout = FLAT) -> None:
    """The same ftidask error on every rank, and no array touched (the job ended, so nothing hung)."""
    got = results(base, layout)
    assert {r["status"] for r in got} == {"fail"}, got
    assert {r["error"] for r in got} == {error} and len({r["message"] for r in got}) == 1, got
    assert all(r.get("untouched", True) for r in got), got


# --- ckptHierarchy: subsequent_ckpts_restart and subsequent_checkpoints ------------------------------------

@pytest.mark.parametrize("layout", [FLAT, HEADS, pytest.param(WIDE, marks=pytest.mark.slow)], ids=lambda x: x.name)
def test_hierarchy_recovers_the_newest_checkpoint_that_survives(tmp_path: Path, layout: Layout) -> None:
    """Checkpoints 1-4 at levels 4, 3, 2, 1 and a crash; the L1 files erased: recovery from L2 (checkpoint 3);
    L2's too: from L3 (2); L3's too: from L4 (1); the global directory too: a clean failure. With heads, each
    checkpoint is written at L1 and raised by the heads; 16 ranks: 4 per node, each node's files together."""
    written = tmp_path / "written"
    job("seq", str(written), "die", "4", "3", "2", "1", dies=True, layout=layout)
    for level in (1, 2, 3):  # secure first: every checkpoint stays (each is newer than the more secure ones)
        assert len(local(written, level, RANK)) == layout.ranks
    assert len(live(written.glob("Global/*/l4/*/Ckpt1-Rank*.fti"))) == layout.ranks
    cases = [("l1", [(1, RANK)], [3, 2]), ("l1_l2", [(1, RANK), (2, RANK), (2, PCOF)], [2, 3]),
             ("l1_l2_l3", [(1, RANK), (2, RANK), (2, PCOF), (3, RANK), (3, RSED)], [1, 4])]
    for name, erased, source in cases:
        base = tmp_path / name
        shutil.copytree(written, base)
        for level, pattern in erased:
            erase(local(base, level, pattern))
        job("recover", str(base), "finalize", layout=layout)
        assert_ok(base, source, layout)
    base = tmp_path / "everything"
    shutil.copytree(written, base)
    for level, pattern in cases[-1][1]:
        erase(local(base, level, pattern))
    shutil.rmtree(base / "Global")
    job("recover", str(base), "finalize", layout=layout)
    assert_clean_failure(base, layout=layout)


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
    assert sorted(p.name for p in live(tmp_path.glob("Global/*/l4/*/*.fti"))) == [f"Ckpt4-Rank{r}.fti" for r in range(4)]


# --- corner cases: keep_last_consistency, keep_last_ckpt's global copy erased, ckpt_consistency ---------------

@pytest.mark.parametrize(("level", "layout"), [(2, FLAT), *[pytest.param(lv, FLAT, marks=pytest.mark.slow)
                                                                for lv in (1, 3, 4)],
                                               *[pytest.param(lv, HEADS, marks=pytest.mark.slow) for lv in (2, 3)]],
                         ids=lambda x: getattr(x, "name", x))
def test_keep_last_restart_crashes_and_restarts_again(tmp_path: Path, level: int, layout: Layout) -> None:
    """keep_last_ckpt: finalize flushes the checkpoint to L4; the restart has status 2 and recovers it, dies
    without a checkpoint; the next restart (status 1) recovers the same checkpoint again, bit for bit."""
    keep, base, written = {"keep_last_ckpt": 1}, tmp_path / "run", tmp_path / "written"
    job("seq", str(written), "finalize", str(level), config=keep, layout=layout)
    assert list(written.glob("Local/*/*/*/*/*.fti")) == []  # only the global copy stays
    shutil.copytree(written, base)
    job("recover", str(base), "die", config=keep, dies=True, layout=layout)
    assert_ok(base, [1, 4], layout)
    assert {r["fti_status"] for r in results(base, layout)} == {2}
    job("recover", str(base), "finalize", config=keep, layout=layout)
    assert_ok(base, [1, 4], layout)
    assert {r["fti_status"] for r in results(base, layout)} == {1}
    # FTI's standard.itf (keep_last_ckpt = 1, global directory erased): no recovery, here a clean one everywhere.
    shutil.rmtree(written / "Global")
    job("recover", str(written), "finalize", config=keep, layout=layout)
    assert_clean_failure(written, layout=layout)
    assert {r["fti_status"] for r in results(written, layout)} == {2}


@pytest.mark.parametrize("layout", [FLAT, HEADS], ids=lambda x: x.name)
def test_redundancy_erased_while_own_files_are_sound_is_rebuilt(tmp_path: Path, layout: Layout) -> None:
    """FTI's ckpt_consistency at L2: every partner copy erased, a restart recovers from the own files and dies;
    every own file erased, the next restart. As FTI does, the first restart rebuilds the erased partner copies
    (a stat finds them missing; nothing is read when they are there), so the second one recovers. With heads,
    the heads made the partner copies; the application ranks rebuild them at the restart."""
    job("seq", str(tmp_path), "die", "2", dies=True, layout=layout)
    assert local(tmp_path, 1, RANK) == []  # raised to L2 by the heads, the L1 files removed
    erase(local(tmp_path, 2, PCOF))
    job("recover", str(tmp_path), "die", dies=True, layout=layout)
    assert_ok(tmp_path, [1, 2], layout)
    assert len(local(tmp_path, 2, PCOF)) == len(local(tmp_path, 2, RANK)) == layout.ranks
    erase(local(tmp_path, 2, RANK))
    job("recover", str(tmp_path), "finalize", layout=layout)
    assert_ok(tmp_path, [1, 2], layout)


# --- keepL4Ckpt ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("keep_l4", "layout"), [(1, FLAT), (0, FLAT), (1, HEADS)], ids=lambda x: getattr(x, "name", x))
def test_keep_l4_ckpt_archives_every_level_4_checkpoint(tmp_path: Path, keep_l4: int, layout: Layout) -> None:
    """FTI's keepL4Ckpt application: checkpoints 1-8 at levels 1, 1, 4, 2, 2, 4, 3, 3 and a crash; the restart
    recovers checkpoint 8 (L3), writes 9 (L4), 10 (L1), 11 (L4) and finalizes. With keep_l4_ckpt the L4
    checkpoints 3, 6, 9 and 11 stay in {glbl_dir}/{exec_id}/l4_archive, readable; without it nothing stays.
    With heads, the heads raise every checkpoint and retire the older ones, the L4 ones kept as well."""
    cfg = {"keep_l4_ckpt": keep_l4}
    job("keepl4", str(tmp_path), config=cfg, dies=True, layout=layout)
    job("keepl4", str(tmp_path), config=cfg, layout=layout)
    got = results(tmp_path, layout)
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
                                                          for r in range(layout.ranks)]
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
    """``(level, layout) -> run directory`` of FTI's diffSizes application stopped at iteration 63 (died), once
    a level and layout."""
    done: dict[tuple[int, str], Path] = {}

    def get(level: int, layout: Layout = FLAT) -> Path:
        if (level, layout.name) not in done:
            base = tmp_path_factory.mktemp(f"diffsizes-l{level}-{layout.name}")
            job("diffsizes", str(base), "1", str(level), "recover", config={"keep_last_ckpt": 1}, dies=True,
                layout=layout)
            done[level, layout.name] = base
        return done[level, layout.name]

    return get


DISRUPT = {  # name -> (level, damage, expected); FTI's expectations, with FTI's corruption
    "l2_none": (2, lambda b: None, "ok"),
    "l3_none": (3, lambda b: None, "ok"),
    "l1_one": (1, lambda b: corrupt(local(b, 1, RANK, [0])), "fail"),
    "l4_one": (4, lambda b: erase(live(b.glob("Global/*/l4/*/Ckpt*-Rank0.fti"))), "fail"),
    "l2_adjacent": (2, lambda b: (erase(local(b, 2, RANK, [0])), corrupt(local(b, 2, PCOF, [1]))), "fail"),
    "l3_adjacent": (3, lambda b: (erase(local(b, 3, RANK, [0])), corrupt(local(b, 3, RSED, [1]))), "ok"),
    "l2_non_adjacent": (2, lambda b: (corrupt(local(b, 2, RANK, [0])), erase(local(b, 2, PCOF, [2]))), "ok"),
    "l2_all_own_files": (2, lambda b: erase(local(b, 2, RANK)), "ok"),
    "l3_all_own_files": (3, lambda b: corrupt(local(b, 3, RANK)), "ok"),
    "l3_all_parity": (3, lambda b: erase(local(b, 3, RSED)), "ok"),
}
SLOW_DISRUPT = {"l1_one", "l4_one", "l2_non_adjacent", "l3_all_parity"}
# The same disruptions with heads (the heads raised each checkpoint) and on 16 ranks (4 per node: each node's
# disruption hits 4 ranks, one of each group); the default runs keep one case with heads.
LAYOUT_DISRUPT = [("l3_adjacent", HEADS, False), ("l2_adjacent", HEADS, True), ("l2_all_own_files", HEADS, True),
                  ("l4_one", HEADS, True), ("l2_adjacent", WIDE, True), ("l3_adjacent", WIDE, True)]


@pytest.mark.parametrize(("name", "layout"),
                         [pytest.param(n, FLAT, marks=pytest.mark.slow) if n in SLOW_DISRUPT else (n, FLAT)
                          for n in DISRUPT]
                         + [pytest.param(n, lay, marks=pytest.mark.slow) if slow else (n, lay)
                            for n, lay, slow in LAYOUT_DISRUPT], ids=lambda x: getattr(x, "name", x))
def test_diff_sizes_disrupted(tmp_path: Path, diffsizes_written, name: str, layout: Layout) -> None:
    """Each rank's arrays have a size of their own and grow between checkpoints; the restart protects the
    initial size, is refused (stored size differs), reallocs, recovers checkpoint 7 (iteration 60) bit for bit
    and runs to the end; a disruption FTI cannot survive is a clean failure on every rank."""
    level, damage, expected = DISRUPT[name]
    base = tmp_path / "run"
    shutil.copytree(diffsizes_written(level, layout), base)
    damage(base)
    style = "recover_var" if level == 3 else "recover"  # FTI_RecoverVar of each variable, or FTI_Recover
    job("diffsizes", str(base), "0", str(level), style, config={"keep_last_ckpt": 1}, layout=layout)
    if expected == "ok":
        assert_ok(base, [7, level], layout)
        assert sorted(p.name for p in live(base.glob("Global/*/l4/*/*.fti"))) == sorted(
            f"Ckpt12-Rank{r}.fti" for r in range(layout.ranks))
    else:
        got = results(base, layout)
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
    assert "ranks 0, 2: recover(); ranks 1, 3: recover(ids=[1])" in got[0]["message"]


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


# --- dCP: corrupt_check (differentialCkpt/dCP.itf) ---------------------------------------------------------------

DCP = {"enable_dcp": 1, "dcp_block_size": 4096}


def truncate_newest(base: Path, level: int, rng: random.Random) -> int:
    """FTI's truncation: a random rank's file of the newest checkpoint loses a random tail (``$RANDOM`` bytes,
    1..32767 here: 0 would change nothing); the bytes cut, 0 when no checkpoint is left (a finalized run)."""
    rank = rng.randrange(N)
    found = (live(base.glob(f"Global/*/l4/*/Ckpt*-Rank{rank}.fti")) if level == 8
             else local(base, level - 4, f"Ckpt*-Rank{rank}.fti"))
    if not found:
        return 0
    (path,) = found  # a differential checkpoint retires the previous one at its commit
    cut = rng.randrange(1, 32768)
    os.truncate(path, max(0, path.stat().st_size - cut))
    return cut


@pytest.mark.parametrize("level", [7, pytest.param(6, marks=pytest.mark.slow)])
def test_dcp_truncated_file_is_rebuilt_and_the_run_goes_on(tmp_path: Path, level: int) -> None:
    """FTI's corrupt_check: checkDCPPosix (each iteration changes a fifth of A, a differential checkpoint)
    dies after checkpoint 1, then runs with crash = 1..6, a random rank's newest file truncated after each run
    but the last. FTI (POSIX dCP, layers in one file) recovers the last intact layer and the run ends
    [SUCCESSFUL]. Here, at L3_DCP (7) or L2_DCP (6), the truncated file fails its checks and is rebuilt from
    the parity or the partner copy: every restart recovers the newest checkpoint, bit for bit."""
    rng, base = random.Random(2612 + level), tmp_path / "run"
    job("dcp", str(base), str(level), "1", config=DCP, dies=True)
    cut = truncate_newest(base, level, rng)
    done = 1
    for crash in range(1, 7):
        job("dcp", str(base), str(level), str(crash), config=DCP, dies=crash > done and crash <= 5)
        got = results(base)
        assert {r["status"] for r in got} == ({"died"} if crash > done and crash <= 5 else {"ok"}), got
        if done:  # a restart: the newest checkpoint, whatever the truncation cut
            assert all(r["recovered"] == [done, True] for r in got), (cut, got)
        done = crash if crash > done and crash <= 5 else 0  # a finalized run leaves nothing: the next is fresh
        if crash < 6:
            cut = truncate_newest(base, level, rng)


@pytest.mark.parametrize("level", [8, pytest.param(5, marks=pytest.mark.slow)])
def test_dcp_truncated_file_without_redundancy_goes_back_one_checkpoint(tmp_path: Path, level: int) -> None:
    """The same sequence at L4_DCP (8) or L1_DCP (5), without redundancy, as FTI's corrupt_check runs it: the
    truncated file fails its checks, and the restart recovers the checkpoint before it, whose file is still
    whole as the spare (FTI's POSIX dCP recovers the previous layer of its file), bit for bit; the run goes on
    from there (dying again after checkpoint ``crash``) and the last one ends with the right data."""
    rng, base = random.Random(2612 + level), tmp_path / "run"
    job("dcp", str(base), str(level), "1", config=DCP, dies=True)
    newest = 1  # the iteration the newest checkpoint holds
    for crash in range(1, 7):
        assert truncate_newest(base, level, rng) > 0
        job("dcp", str(base), str(level), str(crash), config=DCP, dies=crash <= 5)
        got = results(base)
        assert {r["status"] for r in got} == ({"died"} if crash <= 5 else {"ok"}), got
        assert all(r["recovered"] == [newest - 1, True] for r in got), got
        newest = crash


@pytest.mark.parametrize("level", [8, pytest.param(5, marks=pytest.mark.slow)])
def test_dcp_truncated_file_and_spare_is_a_clean_failure(tmp_path: Path, level: int) -> None:
    """The newest file and the spare of the checkpoint before it both cut on one rank: nothing is whole, so the
    same NoCheckpointError on every rank, no array touched."""
    base = tmp_path / "run"
    job("dcp", str(base), str(level), "2", config=DCP, dies=True)
    rng = random.Random(2612)
    assert truncate_newest(base, level, rng) > 0
    spares = (live(base.glob("Global/*/l4/dcp/Spare-Rank*.fti")) if level == 8
              else local(base, level - 4, "Spare-Rank*.fti"))
    assert len(spares) == N
    os.truncate(spares[0], spares[0].stat().st_size - 100)
    job("dcp", str(base), str(level), "6", config=DCP)
    assert_clean_failure(base)
