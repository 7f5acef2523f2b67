"""MPI backend: keep_last_ckpt, FTI's validation at init, unavailable levels: same outcome on every rank, no hang."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()


def _results(base: Path, n: int) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(n)]


def test_keep_last_ckpt_survives_every_local_loss(tmp_path: Path) -> None:
    cfg = json.dumps({"local_test": 1, "node_size": 1, "group_size": 4, "keep_last_ckpt": 1})
    base = tmp_path / "run"
    run(4, "levels_job.py", "keep", cfg, str(base), "2", timeout=120)
    assert list(base.glob("Global/*/l4/*/Ckpt1-Rank*.fti"))  # flushed at finalize
    shutil.rmtree(base / "Local", ignore_errors=True)
    run(4, "levels_job.py", "recover", cfg, str(base), timeout=120)
    results = _results(base, 4)
    assert all(r["status"] == "ok" and r["source"] == [1, 4] for r in results), results


@pytest.mark.parametrize(("overrides", "level", "error", "match"), [
    ({"node_size": 3}, 1, "ConfigError", "not a multiple of node_size"),
    ({"node_size": 1, "group_size": 3, "ckpt_l3": 5}, 1, "ConfigError", "group_size"),
    ({"node_size": 1, "group_size": 3}, 2, "LevelError", "not a multiple of group_size"),
    ({"node_size": 4, "head": 1}, 1, None, ""),  # one node, one head: L1 works
    ({"local_test": 0, "node_size": 4}, 4, None, ""),  # nodes by host name: this machine is one node
    ({"local_test": 0, "node_size": 2}, 1, "ConfigError", "runs 4 process(es), node_size is 2"),
    ({"local_test": 0, "node_size": 4}, 2, "LevelError", "one node: L2 and L3 need 2 or more (on one machine"),
    # One rank's own value of a key every rank must read alike: it hung in init (head, group_size, local_test), in
    # finalize (keep_last_ckpt), or was taken (node_size: the record placed the ranks on nodes [0, 1, 1, 1]).
    ({"node_size": 2, "group_size": 2, "rank1": {"head": 1}}, 1, "ConfigError", "head: rank 0 0, rank 1 1, rank 2 0"),
    ({"node_size": 2, "rank1": {"node_size": 1}}, 1, "ConfigError", "node_size: rank 0 2, rank 1 1"),
    ({"rank1": {"keep_last_ckpt": 1}}, 1, "ConfigError", "keep_last_ckpt"),
    # the number of pieces L2/L3 exchange: one rank's own spun for ever in L3's stripes, truncated L2's messages
    ({"node_size": 1, "group_size": 4, "rank1": {"block_size": 1}}, 3, "ConfigError", "block_size: rank 0 1024"),
    ({"node_size": 1, "group_size": 4, "rank1": {"transfer_size": 1}}, 2, "ConfigError", "transfer_size"),
])
def test_same_outcome_on_every_rank(tmp_path: Path, overrides: dict, level: int, error: str | None,
                                    match: str) -> None:
    base = tmp_path / "run"
    base.mkdir()
    run(4, "levels_job.py", "probe", json.dumps({"local_test": 1, **overrides}), str(base), str(level),
        timeout=120)
    results = [json.loads(p.read_text()) for p in sorted(base.glob("result-*.json"))]
    assert results
    if error is None:
        assert {r["status"] for r in results} == {"ok"}
    else:
        assert len(results) == 4 and {r["error"] for r in results} == {error}, results
        assert all(match in r["message"] for r in results)


@pytest.mark.parametrize("level", [2, 3])
def test_write_failure_on_one_node_fails_everywhere(tmp_path: Path, level: int) -> None:
    """A rank that cannot write its file still takes part in the level's collectives: no hang, one error."""
    base = tmp_path / "run"
    blocker = base / "Local" / "node1" / "fixed" / f"l{level}"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")  # node 1 cannot create its checkpoint directory
    cfg = {"local_test": 1, "node_size": 1, "group_size": 4, "exec_id": "fixed"}
    run(4, "levels_job.py", "probe", json.dumps(cfg), str(base), str(level), timeout=120)
    results = _results(base, 4)
    assert {r["error"] for r in results} == {"CheckpointError"}, results
    assert len({r["message"] for r in results}) == 1 and "rank 1" in results[0]["message"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_rank_deletes_its_own_file_of_a_retired_l4_checkpoint(tmp_path: Path, mode: str) -> None:
    """Retiring an L4 checkpoint: each rank deletes its own file of the global directory (as FTI's ranks do), the
    directory goes once it holds none of the other ranks' files. One rank deleted all of them: a serial tail of
    the whole job's bytes on one rank, under the next checkpoint."""
    run(4, "l4_retire_job.py", str(tmp_path), *(["async"] if mode == "async" else []), timeout=120)
    for rank in range(4):
        deleted = json.loads((tmp_path / f"deleted-{rank}.json").read_text())
        files = [p for p, _content in deleted if f"Ckpt1-Rank{rank}.fti" in Path(p).name]
        if rank:
            assert files and all(Path(p).parent.name == "l4" for p in files), deleted
        dirs = [(p, content) for p, content in deleted if content is not None and "l4" in Path(p).parts]
        for _path, content in dirs:  # what a directory of the global level held when this rank deleted it
            assert not [name for name in content if "Rank" in name and not name.endswith("Rank0.fti")], deleted
    assert not list((tmp_path / "Global").glob("*/l4/*ckpt*1*")), list(find_paths(tmp_path / "Global", "*"))
