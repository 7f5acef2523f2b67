"""Differential L2 checkpoints over a real mpiexec job: partners get deltas, a lost file comes back."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ftidask.dcp import pagetrack

SCRIPT = Path(__file__).parent / "mpi_scripts" / "dcp_l2_job.py"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

TRACKING = pagetrack.available()

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None, reason="needs mpiexec"),
    pytest.mark.skipif(importlib.util.find_spec("ftidask.backends.mpi.transport") is None, reason="needs the MPI backend"),
]


def _job(root: Path, phase: str, level: int) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(SCRIPT), str(root), phase, str(level)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return "".join((root / f"{phase}-rank{r}.txt").read_text() for r in range(4))


def _parity_rows(files: list[Path]) -> list[bytes]:
    """Every parity row of the group's files, encoded from scratch (the reference)."""
    from ftidask.levels.erasure import ReedSolomon

    datas = [np.frombuffer(f.read_bytes(), np.uint8) for f in files]
    width = max(d.size for d in datas)
    padded = [np.concatenate([d, np.zeros(width - d.size, np.uint8)]) for d in datas]
    return [p.tobytes() for p in ReedSolomon(len(files), len(files)).encode(padded)]


@pytest.mark.parametrize("level", [6, 7])
def test_dcp_async_then_lost_rank_file(tmp_path, level):
    """Asynchronous differential checkpoints (the arrays overwritten while each is in flight): still
    2 blocks of 391 per rank sent as changed ranges (L2) or parity updates (L3); a lost file recovers."""
    out = _job(tmp_path, "write-async", level)
    assert out.count("blocks 2 391") == 12, out
    assert out.count("(changed ranges)" if level == 6 else "L3: parity updated") == 12, out
    (own,) = tmp_path.glob(f"l/node1/trial/l{level - 4}/ckpt5.*/Ckpt5-Rank1.fti")
    own.unlink()
    out = _job(tmp_path, "read", level)
    assert out.count("exact True") == 4, out


@pytest.mark.parametrize("level", [6, 7, 8])
def test_dcp_then_lost_rank_file(tmp_path, level):
    out = _job(tmp_path, "write", level)
    # Checkpoints 3-5 patch the spare: 2 blocks of 391 changed per rank.
    assert out.count("blocks 2 391") == 12, out
    # From checkpoint 2 on, write tracking (where the kernel has it) lets each rank hash only the
    # blocks of the page it wrote and of the array's two edge pages (pages straddle blocks: 5 here).
    hashed = {(int(m[1]), int(m[2])): int(m[3]) for m in re.finditer(r"rank (\d) ckpt (\d) .* hashed (\d+)", out)}
    assert len(hashed) == 20 and all(v == 391 for (_r, k), v in hashed.items() if k == 1), out
    if TRACKING:
        assert all(v <= 6 for (_r, k), v in hashed.items() if k > 1), out
    if level == 6:
        # ... and L2 partners receive only the changed ranges (GroupLevels.protect_files_delta, engine/grouplevels.py).
        assert out.count("(changed ranges)") == 12, out
    if level == 7:
        # ... and L3 parity is updated from the deltas (rs_delta), equal to a full re-encoding.
        assert out.count("L3: parity updated") == 12 and out.count("L3: parity re-encoded") == 8, out
        own = [next(tmp_path.glob(f"l/node{r}/trial/l3/ckpt5.*/Ckpt5-Rank{r}.fti")) for r in range(4)]
        rows = _parity_rows(own)
        for r in range(4):
            assert (own[r].parent / f"Ckpt5-RSed{r}.fti").read_bytes() == rows[r]
    if level in (6, 7):
        (own,) = tmp_path.glob(f"l/node1/trial/l{level - 4}/ckpt5.*/Ckpt5-Rank1.fti")
        own.unlink()  # node 1 lost its file: it comes back from the partner copy (L2) or the parity (L3)
    out = _job(tmp_path, "read", level)
    assert out.count("exact True") == 4, out


@pytest.mark.parametrize("level", [6, 7, 8])
def test_heads_raising_dcp_levels_keep_them_differential(tmp_path, level):
    """With heads and inline L2-L4 off, a head copies each L1 differential file to the level (L4: to the global
    file system; L2/L3: beside their partner copies and parity) and then moves the L1 file to the rank's spare
    (with its FB-hash hint), so the next checkpoint patches it (1 of n blocks, not all), also after a restart,
    which recovers the newest exactly. Before, every checkpoint was written in full (L2/L3 linked the file)."""
    import json

    sys.path.insert(0, str(Path(__file__).parent))
    from mpi_util import run

    run(8, "heads_dcp_job.py", str(tmp_path), "3", str(level), timeout=180, check=False)  # heads end as in a crash
    first = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    for got in first:
        (full, total), *rest = got["infos"]
        assert full == total and rest == [[1, total]] * 2 and got["states"] <= 2, got
    if level < 8:  # node 1 lost: its file comes back from the partner copy or the parity, and without its spare
        shutil.rmtree(tmp_path / "Local" / "node1")  # its rank writes its next checkpoint in full
    run(8, "heads_dcp_job.py", str(tmp_path), "5", str(level), timeout=180, check=False)
    again = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    for rank, (got, before) in enumerate(zip(again, first, strict=True)):
        total = before["infos"][0][1]
        changed = total if rank == 1 and level < 8 else 1
        assert got["recovered"] == [3, level - 4, True] and got["infos"] == [[changed, total], [1, total]], got


def test_heads_update_the_l3_parity_of_differential_checkpoints(tmp_path):
    """L3_DCP raised by heads: from the second checkpoint on, each head updates the previous parity with the blocks
    that changed instead of encoding it anew (the heads log it for every rank; before, every parity was encoded in
    full: its record named no files), the parity equals a full encoding, and a lost node is rebuilt from it exactly."""
    import json

    sys.path.insert(0, str(Path(__file__).parent))
    from mpi_util import run

    proc = run(8, "heads_dcp_job.py", str(tmp_path), "3", "7", "2", timeout=180, check=False)
    log = proc.stdout + proc.stderr
    # Info lines come from rank 0 (of the heads too); the group decides together (rs_delta.update agrees on it).
    changed = [int(n) for n in re.findall(r"parity of rank 0 updated from the group's deltas \((\d+) bytes", log)]
    assert len(changed) == 2 and "re-encoded in full" not in log, log  # checkpoints 2 and 3
    assert all(n <= 2 * 4096 for n in changed), changed  # a changed data block and the table's, of 8 to 32 blocks
    own = [next(tmp_path.glob(f"Local/node{r}/*/l3/ckpt3.*/Ckpt3-Rank{r}.fti")) for r in range(4)]
    rows = _parity_rows(own)
    from ftidask.levels import rs

    for r in range(4):
        assert (own[r].parent / f"Ckpt3-RSed{r}.fti").read_bytes() == rows[r]
        # the heads hashed each new file as they compared it with its base: the record keeps the whole-file hashes
        record = json.loads(rs.hash_path(own[r].parent / f"Ckpt3-RSed{r}.fti").read_text())
        assert record["file_hashes"] == {f.name: rs.file_hash(f, record["hash_id"]) for f in own}
    shutil.rmtree(tmp_path / "Local" / "node1")
    run(8, "heads_dcp_job.py", str(tmp_path), "4", "7", timeout=180, check=False)
    for r in range(4):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["recovered"] == [3, 3, True]


def test_head_killed_while_it_updates_the_l3_parity(tmp_path):
    """A head SIGKILLed while it patches a parity (checkpoint 2 of L3_DCP, updated from checkpoint 1's): the job is
    torn down, not hung; checkpoint 2 stays a valid differential L1 checkpoint, which the restart recovers exactly;
    the restarted run's next checkpoints update the parity again (the torn spare parity is never trusted) and a
    last restart recovers the newest exactly."""
    import json

    sys.path.insert(0, str(Path(__file__).parent))
    from mpi_util import run

    proc = run(8, "heads_dcp_job.py", str(tmp_path), "3", "7", "3", "2:ftidask.levels.rs_delta:patch_parity@1",
               timeout=180, check=False)
    assert proc.returncode != 0 and not list(tmp_path.glob("result-*.json")), proc.stdout + proc.stderr
    proc = run(8, "heads_dcp_job.py", str(tmp_path), "4", "7", "2", timeout=180, check=False)
    for r in range(4):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["recovered"] == [2, 1, True]
    log = proc.stdout + proc.stderr
    assert "parity of rank 0 updated from the group's deltas" in log, log  # checkpoints 3 and 4, from 1 and 3
    run(8, "heads_dcp_job.py", str(tmp_path), "4", "7", timeout=180, check=False)
    for r in range(4):
        assert json.loads((tmp_path / f"result-{r}.json").read_text())["recovered"] == [4, 3, True]
