"""MPI backend: a restart into fresh arrays moves verified pages under them (ftidask.engine.pagemove), and
a rank whose file is damaged leaves every rank's arrays untouched (their pages never written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.engine import pagemove

pytestmark = [*need_mpi(), pytest.mark.skipif(not pagemove.enabled, reason="no native page_move in this build")]


def results(base: Path) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("level", [1, 3])
def test_fresh_arrays_over_mpi(tmp_path: Path, level: int) -> None:
    base = tmp_path / "run"
    run(4, "fresh_restart_job.py", "write", str(base), str(level), timeout=180)
    run(4, "fresh_restart_job.py", "recover", str(base), timeout=180)
    got = results(base)
    assert all(r["status"] == "ok" and r["exact"] and r["staged"] for r in got), got
    assert all(r["moved"] > 30 << 20 for r in got), got
    # rank 2's file damaged in its data, nothing older: every rank fails alike, no array written
    own = next(base.glob("Local/**/Ckpt1-Rank2.fti"))
    raw = bytearray(own.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    own.write_bytes(bytes(raw))
    if level == 3:  # and its group cannot rebuild it: two more files of the group lost
        for path in [*base.glob("Local/**/Ckpt1-RSed*.fti")]:
            path.unlink()
    run(4, "fresh_restart_job.py", "recover", str(base), timeout=180)
    got = results(base)
    assert all(r["status"] == "fail" and r["error"] == "NoCheckpointError" for r in got), got
    assert all(r["staged"] and r["still_fresh"] for r in got), got
