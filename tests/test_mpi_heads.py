"""Heads (head = 1, inline_lN = 0): the application writes L1, the heads raise it to L2-L4, recovery works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()

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
def test_heads_post_process(tmp_path: Path, level: int, damage: list[str], expected: str) -> None:
    _check(tmp_path, 8, level, damage, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("level", "damage", "expected"), CASES[:3])
def test_heads_16_processes(tmp_path: Path, level: int, damage: list[str], expected: str) -> None:
    """4 nodes of 1 head + 3 application ranks: each head serves three positions of its node."""
    _check(tmp_path, 16, level, damage, expected)


def _check(tmp_path: Path, nprocs: int, level: int, damage: list[str], expected: str) -> None:
    node_size = nprocs // 4
    napp = nprocs - 4
    cfg = json.dumps({**CONFIG, "node_size": node_size, f"inline_l{level}": 0})
    base = tmp_path / "run"
    proc = run(nprocs, "levels_job.py", "write", cfg, str(base), str(level), timeout=300)
    wrote = [line for line in proc.stdout.split("WROTE ")[1:]]
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
