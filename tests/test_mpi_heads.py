"""Heads (head = 1, inline_lN = 0): the application writes L1, the heads raise it to L2-L4, recovery works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

# Each test runs up to two jobs of up to 300 s each (the write job of the module's fixture, made on first use, then
# the recovery): not cut at pytest's 300 s while its jobs are within theirs.
pytestmark = [*need_mpi(), pytest.mark.timeout(660)]

# 8 processes = 4 simulated nodes of (1 head + 1 application rank); one group of 4 (16: 1 head + 3 ranks).
CONFIG = {"local_test": 1, "node_size": 2, "group_size": 4, "head": 1, "block_size": 256, "transfer_size": 1}


def _record(base: Path) -> dict:
    (path,) = sorted(base.glob("Meta/*/commits/s*.json"))
    return json.loads(path.read_text())


CASES = [
    (2, ["node0"], "ok"),
    (2, ["node1", "node2"], "fail"),
    (3, ["node0", "node2"], "ok"),
    (4, ["node0", "node1", "node2", "node3"], "ok"),
    (4, ["global"], "fail"),
]


@pytest.mark.parametrize(("level", "damage", "expected"), CASES)
def test_heads_post_process(tmp_path: Path, written, level: int, damage: list[str], expected: str) -> None:
    _check(tmp_path, written, 8, level, damage, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("level", "damage", "expected"), CASES[:3])
def test_heads_16_processes(tmp_path: Path, written, level: int, damage: list[str], expected: str) -> None:
    """4 nodes of 1 head + 3 application ranks: each head serves three positions of its node."""
    _check(tmp_path, written, 16, level, damage, expected)


def test_heads_with_async_checkpoints(tmp_path: Path) -> None:
    """The application ranks write L1 in the background; their heads raise it to L3 as before."""
    cfg = json.loads(_config(8, 3))
    base = tmp_path / "run"
    proc = run(8, "levels_job.py", "write", json.dumps({**cfg, "async_ckpt": 1}), str(base), "3", timeout=300)
    replies = [json.loads(line.strip().split(" ", 2)[2]) for line in proc.stdout.split("WROTE ")[1:]]
    assert len(replies) == 4 and all(r["ok"] and r["level"] == 3 for r in replies), proc.stdout
    assert _record(base)["level"] == 3
    shutil.rmtree(base / "Local/node1")
    run(8, "levels_job.py", "recover", json.dumps(cfg), str(base), timeout=300)
    results = [json.loads((base / f"result-{r}.json").read_text()) for r in range(4)]
    assert {r["status"] for r in results} == {"ok"} and all(r["source"] == [1, 3] for r in results), results


def test_list_shows_a_checkpoint_the_heads_raised_to_level4(written, capsys) -> None:
    """The application wrote L1 and waited for it only; the heads raised it to L4 and removed the L1 files: ``ftidask
    list`` shows that checkpoint once, at level 4 (its commit record's level, not its files' variable table's 1),
    committed and sound, its files the application ranks' global ones."""
    from ftidask.tools.cli import main

    base, _stdout = written(8, 4)
    assert main(["list", str(base)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 1, rows
    (exec_id, ckpt_id, level, _seq, _day, _clock, nfiles, _size, state) = rows[0]
    assert (level, nfiles, state) == ("4", "4", "sound"), rows
    assert len(list(base.glob(f"Global/{exec_id}/l4/*/Ckpt{ckpt_id}-Rank*.fti"))) == 4


def _config(nprocs: int, level: int) -> str:
    return json.dumps({**CONFIG, "node_size": nprocs // 4, f"inline_l{level}": 0})


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """``(nprocs, level) -> (run directory, the write job's stdout)``: one write job per level, whose
    untouched run directory each damage case copies (as test_mpi_levels does)."""
    jobs: dict[tuple[int, int], tuple[Path, str]] = {}

    def get(nprocs: int, level: int) -> tuple[Path, str]:
        if (nprocs, level) not in jobs:
            base = tmp_path_factory.mktemp(f"heads{nprocs}-l{level}") / "run"
            proc = run(nprocs, "levels_job.py", "write", _config(nprocs, level), str(base), str(level), timeout=300)
            jobs[nprocs, level] = base, proc.stdout
        return jobs[nprocs, level]

    return get


def _check(tmp_path: Path, written, nprocs: int, level: int, damage: list[str], expected: str) -> None:
    napp = nprocs - 4
    cfg = _config(nprocs, level)
    written_base, stdout = written(nprocs, level)
    base = tmp_path / "run"
    shutil.copytree(written_base, base, symlinks=True)
    wrote = [line for line in stdout.split("WROTE ")[1:]]
    assert len(wrote) == napp  # the application ranks; the heads never return from init
    for line in wrote:
        _rank, written_level, reply = line.strip().split(" ", 2)
        assert int(written_level) == 1  # the application only waited for its L1 file
        assert json.loads(reply)["ok"] and json.loads(reply)["level"] == level
    record = _record(base)
    assert record["level"] == level and record["nranks"] == napp
    assert not list(base.glob("Local/node*/*/l1/*/*.fti"))  # the L1 files were raised, then removed
    for what in damage:
        shutil.rmtree(base / ("Global" if what == "global" else f"Local/{what}"), ignore_errors=True)
    run(nprocs, "levels_job.py", "recover", cfg, str(base), timeout=300)
    results = [json.loads((base / f"result-{r}.json").read_text()) for r in range(napp)]
    assert {r["status"] for r in results} == {expected}, results
    if expected == "ok":
        assert all(r["source"] == [1, level] for r in results)


def test_a_head_parses_each_record_once_in_a_run_that_keeps_every_l4_checkpoint(tmp_path: Path) -> None:
    """With keep_l4_ckpt, the head that raises each checkpoint to L4 read every commit record anew at every raise
    (a new RunState each time), and sent them all to the heads to retire none: 134 ms a checkpoint after 1000 kept
    (2 processes). Now a record is parsed once while its file stays the same, and each raise lists them once."""
    n = 30
    proc = run(2, "heads_many_records_job.py", str(tmp_path), str(n), timeout=300)
    replies = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("REPLY ")]
    assert [(r["ok"], r["level"], r["error"]) for r in replies] == [(True, 4, "")] * n
    stats = json.loads((tmp_path / "head-stats.json").read_text())
    assert stats["listed"] == n  # one listing a raise (retirement)
    assert stats["parsed"] == 0  # the raised records are the head's own, never read back: not 1 + 2 + ... + n
    assert len(list(tmp_path.glob("Global/*/l4_archive/ckpt*"))) == n  # every one kept


def test_heads_write_with_the_runs_modes(tmp_path: Path) -> None:
    """``permissions = group`` was set by Context's init only, which a head never runs: everything the heads wrote
    (the level-4 files and directories, their commit records) was 0600/0700 where the application's was 0640/0750."""
    import stat

    base = tmp_path / "run"
    cfg = {**json.loads(_config(8, 4)), "permissions": "group"}
    run(8, "levels_job.py", "write", json.dumps(cfg), str(base), "4", timeout=300)
    modes = {}
    for path in base.rglob("*"):
        if not path.name.startswith(("result-", "out")):  # the job's own outputs
            modes.setdefault(stat.S_IMODE(path.stat().st_mode), []).append(str(path.relative_to(base)))
    assert set(modes) == {0o640, 0o750}, {oct(m): p[:3] for m, p in modes.items()}
    assert list(base.glob("Global/*/l4/*/Ckpt*-Rank*.fti"))
