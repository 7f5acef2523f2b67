"""FTI_ReorderNodes over MPI: a run restarted on its hosts in another order gives each host its node id back, and the
application's ranks are renumbered so that each finds the node-local files its host holds; a spare host that replaced
a failed one takes the failed node's id and its files come back from the partner copies. Hosts are simulated (the
``processor_name`` seam), each with a disk of its own (``ckpt_dir`` per host), so a process sees only its host's
files, as on a cluster. Pure cases of the renumbering: tests/test_topology.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

pytestmark = need_mpi()


def results(base: Path, n: int = 4) -> list[dict]:
    """Each application process's result, by world rank (a head has none)."""
    return [json.loads(p.read_text()) for w in range(n) if (p := base / f"result-{w}.json").exists()]


@pytest.mark.parametrize("level", [1, 2])
def test_a_restart_on_the_hosts_in_another_order_finds_every_node_local_file(tmp_path: Path, level: int) -> None:
    base = tmp_path / "run"
    run(4, "reorder_job.py", "write", str(base), "A,B,C,D", str(level), timeout=180)
    run(4, "reorder_job.py", "recover", str(base), "C,D,A,B", timeout=180)
    got = results(base)
    # the process on host C is world rank 0: it is application rank 2 now, as when C wrote its files
    assert [r["app_rank"] for r in got] == [2, 3, 0, 1], got
    assert all(r["status"] == "ok" and r["exact"] for r in got), got


def test_a_spare_host_takes_the_failed_nodes_id_and_its_files_are_rebuilt(tmp_path: Path) -> None:
    """Host A failed with its disk; the job restarts on B, C, D and a spare E listed first. E takes A's node id (0),
    B, C and D keep theirs, and rank 0's file comes back from its L2 partner copy on B's disk."""
    base = tmp_path / "run"
    run(4, "reorder_job.py", "write", str(base), "A,B,C,D", "2", timeout=180)
    shutil.rmtree(base / "disk-A")
    run(4, "reorder_job.py", "recover", str(base), "E,C,B,D", timeout=180)
    got = results(base)
    assert [r["app_rank"] for r in got] == [0, 2, 1, 3], got
    assert all(r["status"] == "ok" and r["exact"] for r in got), got
    assert list((base / "disk-E").glob("node0/*/l2/ckpt1.s*/Ckpt1-Rank0.fti"))  # rebuilt where node 0's files go


def test_the_same_order_renumbers_nothing(tmp_path: Path) -> None:
    base = tmp_path / "run"
    run(4, "reorder_job.py", "write", str(base), "A,B,C,D", "1", timeout=180)
    run(4, "reorder_job.py", "recover", str(base), "A,B,C,D", timeout=180)
    got = results(base)
    assert [r["app_rank"] for r in got] == [0, 1, 2, 3] and all(r["status"] == "ok" and r["exact"] for r in got), got


def test_heads_stay_first_on_their_host(tmp_path: Path) -> None:
    """Two processes a host, the first a head (head = 1: the heads write L2): on the hosts in another order each host
    keeps its head and takes its node id back; the application ranks find their files and the partner copies."""
    base = tmp_path / "run"
    run(4, "reorder_job.py", "write", str(base), "A,A,B,B", "2", "heads", timeout=180)
    run(4, "reorder_job.py", "recover", str(base), "B,B,A,A", "heads", timeout=180)
    got = results(base)
    assert [(r["host"], r["app_rank"]) for r in got] == [("B", 1), ("A", 0)], got
    assert all(r["status"] == "ok" and r["exact"] for r in got), got


def test_ranks_placed_across_hosts_in_turn_keep_their_placement(tmp_path: Path) -> None:
    """Ranks placed on the hosts in turn (A, B, A, B: ranks 0 and 2 on A), restarted on B, A, B, A: each process takes
    the place its host had, so ranks 0 and 2 are A's again (numbering the hosts' processes in blocks put rank 1 on A,
    whose disk does not hold its file)."""
    base = tmp_path / "run"
    run(4, "reorder_job.py", "write", str(base), "A,B,A,B", "1", "pairs", timeout=180)
    run(4, "reorder_job.py", "recover", str(base), "B,A,B,A", "pairs", timeout=180)
    got = results(base)
    assert [(r["host"], r["app_rank"]) for r in got] == [("B", 1), ("A", 0), ("B", 3), ("A", 2)], got
    assert all(r["status"] == "ok" and r["exact"] for r in got), got
