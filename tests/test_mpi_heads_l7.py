"""Level 7 (L3_DCP) raised by MPI heads with deltas of several stripes: the heads keep only which blocks changed and
read their XOR back from the previous checkpoint's file and the new one during the exchange (``dcp.filexor``).

tests/mpi_scripts/heads_l7_job.py: 2 nodes of a head and an application rank of 16 MiB, one group of 2, 2/5 of the
state changed at each checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from mpi_util import need_mpi, run
from test_dcp_mpi import _parity_rows

pytestmark = [*need_mpi(), pytest.mark.timeout(600)]


def _results(base: Path) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(2)]


def _heads_descriptors(base: Path) -> list[str]:
    return [fd for w in (0, 2) for fd in json.loads((base / f"heads-fds-{w}.json").read_text())]


def _own(base: Path, ckpt: int, level: int) -> list[Path]:
    return [next(base.glob(f"Local/node{r}/*/l{level}/ckpt{ckpt}.*/Ckpt{ckpt}-Rank{r}.fti")) for r in range(2)]


@pytest.mark.slow  # 3 mpiexec jobs of 4 processes (7 s); tests/test_dcp_mpi.py runs the same code on small deltas
def test_heads_patch_the_parity_from_both_files_then_a_lost_node_is_rebuilt(tmp_path: Path) -> None:
    """Checkpoints 2 and 3 patch the parity from the files' differences (6.4 MiB a file, two stripes, blocks cut at
    their edges): each parity is a full encoding's, byte for byte; the heads keep no descriptor open; node 1 lost
    (its files removed), the restart rebuilds checkpoint 3 through L3 exactly."""
    proc = run(4, "heads_l7_job.py", str(tmp_path), "write", timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert [r["replies"] for r in _results(tmp_path)] == [[[True, 3]] * 3] * 2, log
    changed = [int(n) for n in re.findall(r"parity of rank 0 updated from the group's deltas \((\d+) bytes", log)]
    assert len(changed) == 2 and "re-encoded in full" not in log, log  # checkpoints 2 and 3
    assert all(6_000_000 < n < 8 << 20 for n in changed), changed  # 2/5 of 16 MiB: more than a stripe (4 MiB)
    assert _heads_descriptors(tmp_path) == []
    own = _own(tmp_path, 3, 3)
    rows = _parity_rows(own)
    for r in range(2):
        assert (own[r].parent / f"Ckpt3-RSed{r}.fti").read_bytes() == rows[r], f"rank {r}: not a full encoding's"
    shutil.rmtree(tmp_path / "Local" / "node1")
    run(4, "heads_l7_job.py", str(tmp_path), "read", timeout=300, check=False)
    assert [r["recovered"] for r in _results(tmp_path)] == [[3, 3, True]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncate", "flip", "flip-new"])
def test_a_file_changed_between_the_comparison_and_the_exchange_fails_the_raise(tmp_path: Path, kind: str) -> None:
    """The head of node 0 cuts rank 0's base (checkpoint 2's file) to half, or flips a byte of a block that changed
    in it or in the new file, after comparing them for checkpoint 3 and before the exchange: its read of that block
    fails, every head fails the raise alike (checkpoint 3 stays at level 1, its L3 directory and parity gone: never a
    parity patched from bytes that were not compared), and no head keeps a descriptor open. The restart recovers
    checkpoint 3 from level 1 exactly; without its level-1 files, checkpoint 2 through L3 (rank 0's base rebuilt)."""
    proc = run(4, "heads_l7_job.py", str(tmp_path), "write", f"{kind}@2", timeout=300, check=False)
    log = proc.stdout + proc.stderr
    results = _results(tmp_path)
    assert [r["replies"][:2] for r in results] == [[[True, 3]] * 2] * 2, log
    third = [r["replies"][2] for r in results]
    assert all(ok is False for ok, _why in third), third
    why = "shorter than when it was compared" if kind == "truncate" else "changed since they were compared"
    assert all(why in error for _ok, error in third) and third[0] == third[1], third
    assert not list(tmp_path.glob("Local/node*/*/l3/ckpt3.*")), "checkpoint 3's L3 directory was left"
    assert _heads_descriptors(tmp_path) == []
    run(4, "heads_l7_job.py", str(tmp_path), "read", timeout=300, check=False)
    assert [r["recovered"] for r in _results(tmp_path)] == [[3, 1, True]] * 2
    for path in tmp_path.glob("Local/node*/*/l1/ckpt3.*"):
        shutil.rmtree(path)
    run(4, "heads_l7_job.py", str(tmp_path), "read", timeout=300, check=False)
    assert [r["recovered"] for r in _results(tmp_path)] == [[2, 3, True]] * 2
