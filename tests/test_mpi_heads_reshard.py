"""Checkpoints written with heads (``head = 1``: the heads raise L1 to L2-L4, dCP at L6-L8) restarted on another number
of ranks, with and without heads (docs/mpi.md, "Restarting on another number of ranks"): declared blocks come back
bit for bit, also with a node's directory lost (rebuilt on the old groups first); undeclared arrays come back on the
same ranks on the same nodes (heads gone) and are refused, with the same RecoveryError on every rank, on another
number. tests/mpi_scripts/heads_reshard_job.py is the job.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()

DCP = {"enable_dcp": 1, "dcp_block_size": 512}
#: restart layouts: name -> (processes, init keywords, declared). The write job: 6 processes, 2 nodes of 1 head + 2.
TARGETS = {
    "3-ranks": (3, {"node_size": 1, "group_size": 3}, True),
    "heads-2-ranks": (4, {"head": 1, "node_size": 2, "group_size": 2}, True),
    "heads-6-ranks": (8, {"head": 1, "node_size": 4, "group_size": 2}, True),
    "same-nodes-undeclared": (4, {"node_size": 2, "group_size": 2}, False),  # the 4 ranks on their nodes, no heads
}


def _cfg(level: int, **more) -> dict:
    base = level - 4 if level > 4 else level
    return {"head": 1, "node_size": 3, "group_size": 2, **({f"inline_l{base}": 0} if base > 1 else {}),
            **(DCP if level > 4 else {}), **more}


def _recover(base: Path, nprocs: int, cfg: dict, tag: str, **spec) -> list[dict]:
    napp = nprocs - (nprocs // cfg["node_size"] if cfg.get("head") else 0)
    run(nprocs, "heads_reshard_job.py", "recover", str(base), json.dumps({"cfg": cfg, "tag": tag, **spec}),
        timeout=180)
    return [json.loads((base / f"result-{tag}-{r}.json").read_text()) for r in range(napp)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):
    """level -> a run directory with checkpoints 1-3 written with heads (6 processes, 4 application ranks)."""
    jobs: dict[int, Path] = {}

    def get(level: int) -> Path:
        if level not in jobs:
            base = tmp_path_factory.mktemp(f"heads-l{level}") / "run"
            run(6, "heads_reshard_job.py", "write", str(base),
                json.dumps({"cfg": _cfg(level), "level": level, "count": 3}), timeout=180)
            jobs[level] = base
        return jobs[level]

    return get


def _check(written, tmp_path: Path, level: int, target: str, lose: str | None) -> None:
    base = tmp_path / "run"
    shutil.copytree(written(level), base)
    if lose:
        shutil.rmtree(base / "L" / lose)
    nprocs, cfg, declared = TARGETS[target]
    got = _recover(base, nprocs, {**cfg, **(DCP if level > 4 else {})}, "r", declared=declared)
    assert got == [{"status": "ok", "from": [3, level - 4 if level > 4 else level], "step": 3, "exact": True}] * len(
        got), got


@pytest.mark.parametrize("target", [pytest.param("3-ranks", marks=pytest.mark.slow), "heads-2-ranks"])
def test_heads_l3_restarts_on_another_number_of_ranks(written, tmp_path, target):
    _check(written, tmp_path, 3, target, "node1")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("level", [4, 7])
@pytest.mark.parametrize("target", list(TARGETS))
def test_heads_restart_on_another_layout(written, tmp_path, level, target):
    _check(written, tmp_path, level, target, "node1" if level == 7 else None)


@pytest.mark.campaign
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("lose", [None, "node0", "node1"])
@pytest.mark.parametrize("level", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("target", list(TARGETS))
def test_heads_restart_on_another_layout_campaign(written, tmp_path, level, target, lose):
    if lose and level in (1, 5):  # an L1 file lost is lost: NoCheckpointError on every rank
        base = tmp_path / "run"
        shutil.copytree(written(level), base)
        shutil.rmtree(base / "L" / lose)
        nprocs, cfg, declared = TARGETS[target]
        got = _recover(base, nprocs, {**cfg, **(DCP if level > 4 else {})}, "r", declared=declared)
        assert {g["type"] for g in got} == {"NoCheckpointError"}, got
        return
    _check(written, tmp_path, level, target, lose)


def test_heads_undeclared_on_another_number_of_ranks_is_refused(written, tmp_path):
    base = tmp_path / "run"
    shutil.copytree(written(3), base)
    got = _recover(base, 3, {"node_size": 1, "group_size": 3}, "u", declared=False, old_size=4)
    assert {g["type"] for g in got} == {"RecoveryError"} and len({g["message"] for g in got}) == 1, got
    assert "written by 4 ranks, this run recovers on 3" in got[0]["message"], got


@pytest.mark.parametrize("level", [7, pytest.param(6, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_heads_keep_a_fallback_of_another_layout(written, tmp_path, level):
    """Differential checkpoints 1-3 written by 4 ranks with heads; a restart on 2 ranks with heads recovers 3 and
    writes checkpoint 4, which retires 3: the heads keep 3 as the level's fallback. Checkpoint 4 lost, a restart on
    the 4 ranks recovers 3 exactly. Before, each head moved to the spares the files of its node's ranks of this run
    (ranks 0 and 1, the second looked for on the wrong node) and not the 4 files checkpoint 3 records: its fallback
    record named spares that did not belong to it (NoCheckpointError)."""
    base = tmp_path / "run"
    shutil.copytree(written(level), base)
    cfg2 = {**TARGETS["heads-2-ranks"][1], **_cfg(level, node_size=2)}
    got = _recover(base, 4, cfg2, "c", declared=True, then={"level": level, "count": 1})
    assert [g["from"] for g in got] == [[3, level - 4]] * 2, got
    for path in find_paths(base, "Ckpt4-*"):
        path.unlink()
    got = _recover(base, 6, _cfg(level), "b", declared=True)
    assert got == [{"status": "ok", "from": [3, level - 4], "step": 3, "exact": True}] * 4, got


@pytest.mark.slow
def test_heads_remove_what_a_run_on_more_nodes_left(tmp_path):
    """Checkpoints 1-3 at L2 written by 4 nodes of 1 head + 1 rank; a restart on 2 such nodes recovers 3 and writes
    checkpoint 4, whose heads retire 3: its files on the old nodes 2 and 3 go too. Before, each head removed its own
    node's directory of it only: what no node of the run holds now stayed for good."""
    base = tmp_path / "run"
    cfg = {"head": 1, "node_size": 2, "group_size": 2, "inline_l2": 0}
    run(8, "heads_reshard_job.py", "write", str(base), json.dumps({"cfg": cfg, "level": 2, "count": 3}), timeout=180)
    assert len(list(base.glob("L/node3/*/l2/ckpt3.*/*.fti"))) == 2
    got = _recover(base, 4, cfg, "c", declared=True, then={"level": 2, "count": 1})
    assert [g["from"] for g in got] == [[3, 2]] * 2, got
    assert sorted(p.name for p in find_paths(base, "*.fti")) == sorted(
        f"Ckpt4-{kind}{r}.fti" for kind in ("Rank", "Pcof") for r in (0, 1))


@pytest.mark.parametrize("level,target,more", [
    (3, "heads-2-ranks", {}),
    pytest.param(7, "heads-2-ranks", {}, marks=pytest.mark.slow),
    pytest.param(3, "3-ranks", {"l4_format": "zarr"}, marks=pytest.mark.slow),
])
def test_keep_last_flushes_a_checkpoint_of_another_layout(written, tmp_path, level, target, more):
    """A run written with heads (4 ranks on 2 nodes), restarted on another layout that recovers checkpoint 3 and
    finalizes with keep_last_ckpt before writing one: the 4 old files are flushed to L4, and a restart on the first
    layout recovers it exactly from there. Before, each rank flushed its own rank's file from its own node: old rank
    1 (on node 0) was looked for on node 1, finalize failed (and ranks 2 and 3 would never have been copied)."""
    base = tmp_path / "run"
    shutil.copytree(written(level), base)
    nprocs, cfg, _declared = TARGETS[target]
    got = _recover(base, nprocs, {**cfg, **(DCP if level > 4 else {}), "keep_last_ckpt": 1, **more}, "k",
                   declared=True, finalize=True)
    assert {g["status"] for g in got} == {"ok"}, got
    assert not list(base.glob("L/node*/*/l[123]/ckpt*"))  # as FTI: only the L4 copy stays
    got = _recover(base, 6, _cfg(level), "b", declared=True)
    assert got == [{"status": "ok", "from": [3, 4], "step": 3, "exact": True}] * 4, got
