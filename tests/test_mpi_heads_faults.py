"""Heads (head = 1, inline_lN = 0) under faults, on real mpiexec: a head or an application rank SIGKILLed while the
head raises a checkpoint (tests/crashpoints.py), finalize while the head works, restarts with and without heads,
``post_processing_done`` with asynchronous checkpoints. Jobs: ``mpi_scripts/heads_fault_job.py``.

8 processes = 4 simulated nodes of a head and an application rank, one group of 4 (as test_mpi_heads).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import env, need_mpi, run

pytestmark = need_mpi()

HEADS = {"local_test": 1, "node_size": 2, "group_size": 4, "head": 1, "inline_l2": 0, "inline_l3": 0, "inline_l4": 0}
NO_HEADS = {"local_test": 1, "node_size": 1, "group_size": 4}
NAPP = 4


def _write(base: Path, cfg: dict, levels: str, kill: str = "", nprocs: int = 8) -> str:
    """The write job; a kill tears the job down (mpiexec ends it: the test fails at the timeout on a hang)."""
    dies = bool(kill) and not kill.endswith(":raise") and ":raise@" not in kill  # ":raise": the process lives on
    proc = run(nprocs, "heads_fault_job.py", "write", json.dumps(cfg), str(base), levels, kill, timeout=120,
               check=not dies)
    if dies:
        assert proc.returncode != 0, proc.stdout  # the crash point was reached: the job was torn down
    return proc.stdout


def _replies(stdout: str, ckpt: int) -> list[dict]:
    """The heads' replies to checkpoint ``ckpt``, one per application rank."""
    lines = re.findall(r"WROTE (\d+) (\d+) (\d+) (null|\{[^}]*\})", stdout)  # the ranks' lines may interleave
    replies = [json.loads(reply) for _rank, c, _level, reply in lines if int(c) == ckpt]
    assert len(replies) == NAPP, stdout
    return replies


def _recover(base: Path, cfg: dict, nprocs: int = 8) -> list[dict]:
    run(nprocs, "heads_fault_job.py", "recover", json.dumps(cfg), str(base), timeout=120)
    results = [json.loads(p.read_text()) for p in sorted(base.glob("result-*.json"))]
    assert len(results) == NAPP, results
    return results


def _assert_recovered(results: list[dict], source: list) -> None:
    """Every rank recovered exactly, all from ``source`` ([id, level]), or all from one of ``source``'s pairs."""
    assert all(r["status"] == "ok" and r["same"] for r in results), results
    allowed = [tuple(s) for s in source] if isinstance(source[0], list) else [tuple(source)]
    assert len({tuple(r["source"]) for r in results}) == 1 and tuple(results[0]["source"]) in allowed, results


def test_post_processing_done_waits_for_an_async_checkpoint(tmp_path: Path) -> None:
    """``post_processing_done`` right after ``checkpoint(wait=False)`` must not say True before the checkpoint
    is even committed: when it says True, the commit records show the checkpoint at its target level."""
    stdout = _write(tmp_path / "run", {**HEADS, "wait": False, "poll": True}, "3,2,4")
    polls = re.findall(r"POLL (\d+) (\d+) (None|\d+) (True|False)", stdout)
    assert len(polls) == 3 * NAPP, stdout
    for _rank, ckpt, level, first in polls:
        assert first == "False", polls  # asked while the background holds the checkpoint (the job's seam)
        assert level == {"1": "3", "2": "2", "3": "4"}[ckpt], polls


def _l1_files(base: Path) -> list[Path]:
    return [p for p in base.glob("Local/node*/*/l1/ckpt*/*.fti")]


# name -> (levels, crash point, nodes lost before the restart, the checkpoint recovered)
KILLS = {
    # a head dies while it encodes checkpoint 2 (L3 parity): checkpoint 2 stays a valid L1 checkpoint
    "head-in-parity": ("3,3", "2:ftidask.levels.multilevel:protect@2", [], [2, 1]),
    # ... and with a node lost too: checkpoint 1, raised to L3 before, rebuilds it
    "head-in-parity-node-lost": ("3,3", "2:ftidask.levels.multilevel:protect@2", ["node1"], [1, 3]),
    # the heads' root dies right after its commit record at L3, before the L1 files go: L3 is complete
    "root-head-after-commit": ("3,3", "0:ftidask.engine.runstate:RunState.write_record:after@2", [], [2, 3]),
    # the head copying checkpoint 2 to the global directory dies: checkpoint 2 stays at L1
    "head-in-l4-copy": ("4,4", "6:ftidask.storage.files:copy_file_atomic@2", [], [2, 1]),
    # a head dies while it sends checkpoint 2 to its partner (L2): checkpoint 2 stays at L1
    "head-in-partner-copy": ("2,2", "4:ftidask.levels.multilevel:protect@2", [], [2, 1]),
    # ... and with a node lost too: checkpoint 1, raised to L2 before, rebuilds it from its partner copy
    "head-in-partner-copy-node-lost": ("2,2", "4:ftidask.levels.multilevel:protect@2", ["node2"], [1, 2]),
    # an application rank dies right after checkpoint 2 returns, while its head raises it to L3: at L1, or at L3
    # when the head committed before mpiexec tore the job down (a race on a loaded machine: both are exact)
    "app-while-head-works": ("2,3", "app:2", [], [[2, 1], [2, 3]]),
}


@pytest.mark.parametrize("name", KILLS)
def test_kill_while_heads_post_process(tmp_path: Path, name: str) -> None:
    """A SIGKILL during the heads' post-processing tears the job down (no hang: run's timeout); a restart with heads
    recovers the newest checkpoint that survives, bit for bit."""
    levels, kill, lost, source = KILLS[name]
    base = tmp_path / "run"
    _write(base, HEADS, levels, kill)
    for node in lost:
        for path in base.glob(f"Local/{node}/*"):
            shutil.rmtree(path)
    _assert_recovered(_recover(base, HEADS), source)


def test_finalize_while_heads_post_process(tmp_path: Path) -> None:
    """``finalize`` right after checkpoint 2 (its head still raising it to L3) waits for the head, then flushes it
    to L4 (keep_last_ckpt): a restart recovers it; no L1 file is left behind."""
    base = tmp_path / "run"
    _write(base, {**HEADS, "finalize": True, "keep_last_ckpt": 1}, "3,3")
    assert not _l1_files(base)
    _assert_recovered(_recover(base, HEADS), [2, 4])


# name -> (levels, crash point): a head dies while it raises differential checkpoint 2 (L2_DCP: in the level's
# exchanges; L3_DCP: encoding the parity; L4_DCP: copying the file to the global directory)
DCP_KILLS = {
    "l2-dcp": ("6,6", "2:ftidask.levels.multilevel:protect@2"),
    "l3-dcp": ("7,7", "6:ftidask.levels.multilevel:protect@2"),  # every element changes: encoded in full
    "l4-dcp": ("8,8", "4:ftidask.storage.files:copy_file_atomic@2"),
}


@pytest.mark.parametrize("name", DCP_KILLS)
def test_kill_while_heads_raise_a_differential_checkpoint(tmp_path: Path, name: str) -> None:
    """A head SIGKILLed while it raises differential checkpoint 2 tears the job down (no hang: run's timeout);
    checkpoint 2 stays a valid differential L1 checkpoint, which a restart recovers bit for bit, and the restarted
    run goes on with differential checkpoints that a second restart recovers exactly."""
    levels, kill = DCP_KILLS[name]
    cfg = {**HEADS, "enable_dcp": 1}
    base = tmp_path / "run"
    _write(base, cfg, levels, kill)
    _assert_recovered(_recover(base, cfg), [2, 1])
    for result in base.glob("result-*.json"):
        result.unlink()
    level = int(levels[0])
    stdout = _write(base, {**cfg, "resume": True}, levels)
    assert all(r["ok"] and r["level"] == level - 4 for r in _replies(stdout, 4)), stdout
    _assert_recovered(_recover(base, cfg), [4, level - 4])


@pytest.mark.slow
def test_head_killed_in_a_differential_raise_then_resume(tmp_path: Path) -> None:
    """L2_DCP/L3_DCP raised by heads: the head dies as it writes the hint of an L1 spare; the restart recovers,
    goes on with differential checkpoints (the spares and hints left as they were) and a second restart recovers
    the last one exactly."""
    cfg = {**HEADS, "enable_dcp": 1}
    base = tmp_path / "run"
    _write(base, cfg, "6,7,6", "2:ftidask.backends.mpi.heads:write_spare_hint@2")
    _write(base, {**cfg, "resume": True}, "7,6,7")
    _assert_recovered(_recover(base, cfg), [5, 3])


# name -> (write config and processes, restart config and processes, levels, recovered)
SWITCHES = {
    "without-then-with-heads": ((NO_HEADS, 4), (HEADS, 8), "3,3", [2, 3]),
    "with-then-without-heads": ((HEADS, 8), (NO_HEADS, 4), "3,3", [2, 3]),
    "with-heads-then-node-size-2": ((HEADS, 8), ({"local_test": 1, "node_size": 2, "group_size": 2}, 4), "2,2",
                                    [2, 2]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if i else []) for i, n in
                                  enumerate(SWITCHES)])
def test_restart_switching_heads(tmp_path: Path, name: str) -> None:
    """A run with heads restarted without them (and the reverse, or on other nodes): the same checkpoint."""
    (write_cfg, write_n), (read_cfg, read_n), levels, source = SWITCHES[name]
    base = tmp_path / "run"
    _write(base, write_cfg, levels, nprocs=write_n)
    _assert_recovered(_recover(base, read_cfg, read_n), source)


def test_head_cleanup_failure_after_the_raise_is_reported_as_raised(tmp_path: Path) -> None:
    """Retiring checkpoint 1 fails on the heads' root once checkpoint 2 is committed at L3: the heads' reply must
    say that checkpoint 2 is raised (ok, level 3) and name the clean-up failure, not that it stayed at L1."""
    base = tmp_path / "run"
    stdout = _write(base, HEADS, "3,3", "0:ftidask.engine.runstate:RunState.delete_record:raise@1")
    for reply in _replies(stdout, 2):
        assert reply["ok"] is True and reply["level"] == 3, reply
        assert "cleaning up" in reply["error"] and "injected failure" in reply["error"], reply
        # the heads' root is named as the head it is, not "rank 0" (an application rank that wrote nothing)
        assert "head of node 0: " in reply["error"] and "rank 0" not in reply["error"], reply
    _assert_recovered(_recover(base, HEADS), [2, 3])


def test_zarr_level_4_with_heads_is_written_as_zarr(tmp_path: Path) -> None:
    """``l4_format = zarr`` with heads (inline_l4 = 0): level 4 is still a Zarr store per rank (docs/zarr.md), not
    the head's copy of the L1 FTI-FF file; the application writes it (no post-processing: the reply is None,
    not the previous checkpoint's)."""
    cfg = {**HEADS, "l4_format": "zarr"}
    base = tmp_path / "run"
    stdout = _write(base, cfg, "3,4")
    assert all(r["ok"] and r["level"] == 3 for r in _replies(stdout, 1))
    assert _replies(stdout, 2) == [None] * NAPP
    assert sorted(p.name for p in base.glob("Global/*/l4/ckpt2.*/*")) == [f"Ckpt2-Rank{r}.zarr" for r in range(NAPP)]
    assert _record(base, 2)["extra"].get("l4_format") == "zarr"
    _assert_recovered(_recover(base, cfg), [2, 4])


def _record(base: Path, ckpt_id: int) -> dict:
    records = [json.loads(p.read_text()) for p in base.glob("Meta/*/commits/s*.json")]
    (record,) = [r for r in records if r["ckpt_id"] == ckpt_id]
    return record


def test_recover_while_heads_post_process_waits_for_them(tmp_path: Path) -> None:
    """``recover()`` (a rollback) right after checkpoint 2, its head still raising it to L3 (moving its files,
    rewriting its record): the recovery must wait for the head and recover checkpoint 2, not read L1 files that
    vanish under it and fall back to an older checkpoint (or none)."""
    stdout = _write(tmp_path / "run", {**HEADS, "rollback": True}, "3,3")
    rolled = re.findall(r"ROLLBACK \d+ (\[\d+, \d+\]) (True|False)", stdout)
    assert rolled == [("[2, 3]", "True")] * NAPP, stdout


# name -> (levels, the seam: one head raises at the start of checkpoint 1's post-processing)
HEAD_BUGS = {
    # an exception escaping the level's entry point before the group's exchanges (L3 parity, L2 partner copy)
    "l3-protect": ("3,3", "2:ftidask.levels.multilevel:protect:raise@1"),
    "l2-protect": ("2,2", "4:ftidask.levels.multilevel:protect:raise@1"),
    # ... or escaping the head's first step, reading the request (its commit record)
    "request": ("3,3", "6:ftidask.engine.runstate:CommitRecord.from_json:raise@1"),
}


@pytest.mark.parametrize("name", HEAD_BUGS)
def test_a_bug_on_one_head_fails_the_post_processing_on_every_head(tmp_path: Path, name: str) -> None:
    """An unexpected exception on one head, before its group's exchanges: the other heads must not wait for it (a
    hang: the job's timeout fails the test). Every application rank gets the same failed reply naming it, checkpoint
    1 stays at L1 (no half-raised level directory left), and the heads go on: checkpoint 2 is raised, recovered."""
    levels, seam = HEAD_BUGS[name]
    base = tmp_path / "run"
    stdout = _write(base, HEADS, levels, seam)
    failed = _replies(stdout, 1)
    assert all(r["ok"] is False for r in failed) and len({r["error"] for r in failed}) == 1, failed
    assert "injected failure" in failed[0]["error"], failed
    level = int(levels[0])
    assert all(r["ok"] is True and r["level"] == level for r in _replies(stdout, 2)), stdout
    assert not list(base.glob(f"Local/node*/*/l{level}/ckpt1.*")), "checkpoint 1's failed raise left files"
    _assert_recovered(_recover(base, HEADS), [2, level])


def test_heads_parity_records_the_files_it_encodes_and_damage_is_found(tmp_path: Path) -> None:
    """The heads' L3 parity records, as without heads, the FB hashes of the group's files it encodes (what lets a
    differential L3 checkpoint update it: rs_delta). A damaged parity file is found by ``ftidask verify``, and a
    recovery that needs the parity (node 0 lost) passes the damaged one over for a sound one: exact."""
    base = tmp_path / "run"
    _write(base, HEADS, "3")
    record = _record(base, 1)
    parities = sorted(base.glob("Local/node*/*/l3/ckpt1.*/Ckpt1-RSed*.fti"))
    assert len(parities) == NAPP, parities
    for parity in parities:
        info = json.loads(Path(f"{parity}.hash").read_text())
        assert info["fb_hashes"] == [f["fb_hash"] for f in record["files"]], info
    cli = [sys.executable, "-m", "ftidask", "verify", str(base / "Local")]
    assert subprocess.run(cli, capture_output=True, text=True, env=env(), timeout=60).returncode == 0
    (damaged,) = base.glob("Local/node1/*/l3/ckpt1.*/Ckpt1-RSed1.fti")  # the first parity a decoding of node 0 takes
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    found = subprocess.run(cli, capture_output=True, text=True, env=env(), timeout=60)
    assert found.returncode == 1 and re.search(r"DAMAGED.*Ckpt1-RSed1\.fti", found.stdout), found.stdout
    shutil.rmtree(next(base.glob("Local/node0/*")))
    _assert_recovered(_recover(base, HEADS), [1, 3])
    assert subprocess.run(cli, capture_output=True, text=True, env=env(), timeout=60).returncode == 0  # rebuilt


def _lose_ckpt2(base: Path, where: list[str]) -> None:
    """Make checkpoint 2 unrecoverable: its directory on each node of ``where`` removed (its spares stay), or its
    global file of rank 1 cut short (``global``)."""
    for node in where:
        if node == "global":
            (path,) = base.glob("Global/*/l4/ckpt2.*/Ckpt2-Rank1.fti")
            path.write_bytes(path.read_bytes()[:1000])
            continue
        dirs = list(base.glob(f"Local/{node}/*/l[23]/ckpt2.*"))
        assert dirs, node
        for path in dirs:
            shutil.rmtree(path)


# name -> (levels, what checkpoint 2 loses): more than the level rebuilds
FALLBACKS = {
    "l2-dcp": ("6,6", ["node1", "node2"]),  # two adjacent nodes: rank 1's file and its partner copy
    "l3-dcp": ("7,7", ["node0", "node1", "node2"]),  # 6 of the group's 8 files
    "l4-dcp": ("8,8", ["global"]),
}


@pytest.mark.parametrize("heads", [True, False], ids=["heads", "no-heads"])
@pytest.mark.parametrize("name", FALLBACKS)
def test_damaged_differential_checkpoint_falls_back_with_heads_as_without(tmp_path: Path, name: str,
                                                                          heads: bool) -> None:
    """Differential L2-L4 checkpoints 1 and 2; checkpoint 2 then lost beyond what its level rebuilds: the restart
    recovers checkpoint 1 (the previous differential checkpoint, kept as the level's spares), bit for bit on every
    rank, with heads as without. Before, with heads, the heads deleted checkpoint 1 when they raised checkpoint 2:
    NoCheckpointError."""
    levels, lost = FALLBACKS[name]
    cfg, nprocs = ({**HEADS, "enable_dcp": 1}, 8) if heads else ({**NO_HEADS, "enable_dcp": 1}, 4)
    base = tmp_path / "run"
    _write(base, cfg, levels, nprocs=nprocs)
    _lose_ckpt2(base, lost)
    level = int(levels[0]) - 4
    _assert_recovered(_recover(base, cfg, nprocs), [1, level])
    for result in base.glob("result-*.json"):
        result.unlink()
    # The run goes on from checkpoint 1 (checkpoints 2 and 3 anew); retiring the lost checkpoint 2 is no failure.
    stdout = _write(base, {**cfg, "resume": True}, levels, nprocs=nprocs)
    replies = _replies(stdout, 3)
    assert replies == [None] * NAPP if not heads else all(r == {"ok": True, "error": "", "level": level,
                                                                 "ckpt_id": 3} for r in replies), replies
    _assert_recovered(_recover(base, cfg, nprocs), [3, level])


@pytest.mark.parametrize(("level", "how"), [("4", "truncate"), pytest.param("3", "corrupt", marks=pytest.mark.slow),
                                            pytest.param("2", "corrupt", marks=pytest.mark.slow)])
def test_a_head_refuses_to_raise_a_damaged_level_1_file(tmp_path: Path, level: str, how: str) -> None:
    """Checkpoint 2's L1 file of rank 0 damaged before its head raises it (a byte flipped, or the file cut short): the
    heads raised it all the same (L3 encoded the damage into the parity) and retired checkpoint 1, which left nothing
    recoverable. Now the raise fails on every rank, naming the file, and checkpoint 1 stays the one recovered."""
    base = tmp_path / "run"
    stdout = _write(base, {**HEADS, "damage": how}, f"{level},{level}")
    assert all(r["ok"] and r["level"] == int(level) for r in _replies(stdout, 1)), stdout
    for reply in _replies(stdout, 2):
        assert reply["ok"] is False and "rank 0's level-1 file" in reply["error"], reply
    _assert_recovered(_recover(base, HEADS), [1, int(level)])


def test_init_again_after_the_heads_ended_is_refused_not_a_hang(tmp_path: Path) -> None:
    """With heads, finalize ends the heads' processes: an init on the same communicator afterwards waited for them for
    ever (a hang until the job's walltime). Now every application rank is refused at once, saying why."""
    proc = run(4, "heads_reinit_job.py", str(tmp_path), timeout=60)
    said = re.findall(r"REINIT (\d+) (.*)", proc.stdout)
    assert sorted(int(r) for r, _e in said) == [0, 1], proc.stdout
    for _rank, error in said:
        assert error.startswith("FTIError: the heads of this communicator ended at finalize()"), error
