"""Differential checkpoints written by 4 ranks (no heads), restarted on another number of ranks (docs/mpi.md, declared
arrays): the restarted run recovers checkpoint 3 and writes checkpoint 4, which retires 3 (written on the other
layout). The ranks keep 3 as the level's fallback, its files moved to the spares as its commit record places them
(each by a rank on its node; rank 0 those of nodes the run no longer has): checkpoint 4 lost or damaged, a restart
gets 3 back bit for bit, on either layout. Before, each rank retired its own rank's file (none it knew), 3 was not
kept and the fallback record of checkpoint 2 stayed, naming spares that checkpoint 4 had overwritten: the restart
raised NoCheckpointError. tests/mpi_scripts/heads_reshard_job.py is the job (as with heads:
tests/test_mpi_heads_reshard.py::test_heads_keep_a_fallback_of_another_layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()

DCP = {"enable_dcp": 1, "dcp_block_size": 512}
WRITTEN = {"node_size": 2, "group_size": 2, **DCP}  # 4 ranks on 2 nodes
#: restart layouts: name -> (processes, init keywords)
LAYOUTS = {
    "2-nodes": (2, {"node_size": 1, "group_size": 2, **DCP}),  # old ranks 0-1 on node 0, 2-3 on node 1
    "1-node": (2, {"node_size": 2, "group_size": 2, **DCP}),  # node 1 gone: rank 0 keeps its files
    "3-ranks": (3, {"node_size": 1, "group_size": 3, **DCP}),
}


def _recover(base: Path, nprocs: int, cfg: dict, tag: str, **spec) -> list[dict]:
    run(nprocs, "heads_reshard_job.py", "recover", str(base), json.dumps({"cfg": cfg, "tag": tag, **spec}),
        timeout=180)
    return [json.loads((base / f"result-{tag}-{r}.json").read_text()) for r in range(nprocs)]


def _restarted(base: Path, level: int, layout: str, count: int) -> None:
    """Checkpoints 1-3 by 4 ranks; a restart on ``layout`` recovers 3 and writes ``count`` more."""
    run(4, "heads_reshard_job.py", "write", str(base), json.dumps({"cfg": WRITTEN, "level": level, "count": 3}),
        timeout=180)
    nprocs, cfg = LAYOUTS[layout]
    got = _recover(base, nprocs, cfg, "c", declared=True, then={"level": level, "count": count})
    assert [g["from"] for g in got] == [[3, level - 4]] * nprocs, got


def _spoil(base: Path, ckpt_id: int, how: str) -> None:
    paths = list(find_paths(base, f"Ckpt{ckpt_id}-*"))
    assert paths
    for path in paths:
        if how == "lost":
            path.unlink()
        else:  # a byte of its data flipped
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))


@pytest.mark.slow  # 3 mpiexec jobs: 4-5 s each
@pytest.mark.parametrize("level,layout,how,back_on", [
    (7, "2-nodes", "lost", "written"),
    (6, "2-nodes", "damaged", "restarted"),
    (8, "1-node", "damaged", "written"),
    (5, "1-node", "lost", "restarted"),
    (7, "3-ranks", "lost", "restarted"),
])
def test_ranks_keep_a_fallback_of_another_layout(tmp_path, level, layout, how, back_on):
    base = tmp_path / "run"
    _restarted(base, level, layout, 1)
    _spoil(base, 4, how)
    nprocs, cfg = (4, WRITTEN) if back_on == "written" else LAYOUTS[layout]
    got = _recover(base, nprocs, cfg, "b", declared=True)
    assert got == [{"status": "ok", "from": [3, level - 4], "step": 3, "exact": True}] * nprocs, got


@pytest.mark.slow
def test_the_next_retirement_keeps_its_own_layout(tmp_path):
    """After checkpoint 3 (4 ranks) was kept by the 2 ranks, checkpoint 5 retires 4 (their own): 5 lost, 4 comes
    back, on either layout."""
    base = tmp_path / "run"
    _restarted(base, 6, "2-nodes", 2)
    _spoil(base, 5, "lost")
    for nprocs, cfg, tag in ((2, LAYOUTS["2-nodes"][1], "b"), (4, WRITTEN, "d")):
        got = _recover(base, nprocs, cfg, tag, declared=True)
        assert got == [{"status": "ok", "from": [4, 2], "step": 4, "exact": True}] * nprocs, got
