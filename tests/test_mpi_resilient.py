"""The resilient-loop decorator on a real MPI stencil code (examples/heat_mpi.py).

An uninterrupted run gives the reference checksum; a run that loses a rank, or that is told its
time is up (SIGUSR1/SIGTERM to every rank, as a batch scheduler does), must end, once restarted,
with exactly the same checksum.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mpi_util import ROOT, env, mpiexec, need_mpi, run

pytestmark = need_mpi()
EXAMPLE = ROOT / "examples" / "heat_mpi.py"
CRASHING = ROOT / "tests" / "mpi_scripts" / "heat_crash.py"  # the example, its last rank killed at an iteration
ARGS = ["--rows", "16", "--cols", "64", "--iters", "60", "--every", "10", "--node-size", "1"]


def heat(base: Path, *extra: str, crash_at: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    script = [str(EXAMPLE)] if crash_at is None else [str(CRASHING), str(crash_at)]
    cmd = [mpiexec(), "-n", "4", sys.executable, *script, "--dir", str(base), *ARGS, *extra]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def checksum(proc: subprocess.CompletedProcess) -> str:
    match = re.search(r"checksum=([0-9a-f]{64})", proc.stdout)
    assert match, proc.stdout + proc.stderr
    return match.group(1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    proc = heat(tmp_path_factory.mktemp("ref"))
    assert proc.returncode == 0, proc.stderr
    return checksum(proc)


@pytest.mark.parametrize("level", [1, 3])
def test_rank_dies_then_resumes(tmp_path: Path, reference: str, level: int) -> None:
    crashed = heat(tmp_path, "--level", str(level), crash_at=35)
    assert crashed.returncode != 0 and "done" not in crashed.stdout
    resumed = heat(tmp_path, "--level", str(level))
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 0\n" not in resumed.stdout  # resumed, not restarted from scratch
    assert "iteration 30" in resumed.stdout.splitlines()[0]
    assert f"(restart: recovered checkpoint 30 at level {level})" in resumed.stdout.splitlines()[0]
    assert checksum(resumed) == reference


@pytest.mark.parametrize("signum, heads", [(signal.SIGUSR1, False), (signal.SIGTERM, False), (signal.SIGTERM, True)])
def test_time_is_up_signal(tmp_path: Path, reference: str, signum: int, heads: bool) -> None:
    """With heads, the heads died of the signal (no handler of theirs) and took the job down: no last checkpoint,
    the restart began at iteration 0. They ignore it now, and raise the application ranks' last checkpoint."""
    extra = []
    if heads:  # 4 processes: 2 nodes of a head and an application rank
        (tmp_path / "heads.fti").write_text("[basic]\nhead = 1\ngroup_size = 2\n")
        extra = ["--config", str(tmp_path / "heads.fti"), "--node-size", "2", "--level", "2"]
        reference = checksum(heat(tmp_path / "reference", *extra))
    cmd = [mpiexec(), "-n", "4", sys.executable, str(EXAMPLE), "--dir", str(tmp_path), *ARGS, *extra,
           "--every", "1000", "--sleep", "0.1"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait until the loop runs (the ranks iterate in lockstep, so all have their handlers installed):
        # a signal that arrives during start-up would meet Python's or MPI's default handlers instead.
        seen = ""
        while "iteration 10" not in seen:
            line = proc.stdout.readline()
            assert line, f"the job ended early: {seen}"
            seen += line
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "heat_mpi.py" in " ".join(p.cmdline())]
        assert len(ranks) == 4
        for p in ranks:  # as the scheduler does: every process of the job gets the signal
            p.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "done" not in out
    resumed = heat(tmp_path, *extra, "--every", "1000")
    assert resumed.returncode == 0, resumed.stderr
    first = int(re.search(r"iteration (\d+)", resumed.stdout).group(1))
    assert 0 < first < 60
    assert checksum(resumed) == reference


def test_random_stream_continues_after_a_rank_dies(tmp_path: Path) -> None:
    """Each rank adds random heat from its own numpy Generator (``rng=`` of the decorator): after a rank
    dies and the job restarts, the generators continue their exact streams, so the result is the
    uninterrupted run's bit for bit (a generator restarted from its seed would repeat numbers)."""
    ref = heat(tmp_path / "ref", "--noise", "0.5")
    assert ref.returncode == 0, ref.stderr
    crashed = heat(tmp_path / "run", "--noise", "0.5", crash_at=35)
    assert crashed.returncode != 0 and "done" not in crashed.stdout
    resumed = heat(tmp_path / "run", "--noise", "0.5")
    assert resumed.returncode == 0, resumed.stderr
    assert "(restart: recovered checkpoint 30" in resumed.stdout.splitlines()[0]
    assert checksum(resumed) == checksum(ref)


@pytest.mark.parametrize("mode", ["every", "iterations", "every0", "level9"])
def test_a_loop_argument_of_one_rank_is_an_error_on_every_rank(tmp_path: Path, mode: str) -> None:
    """One rank's own every/check_every/iterations: its stop-signal agreement met another rank's checkpoint call (a
    raw TypeError there, a hang here); an argument refused on one rank raised there only, the other rank hung. The
    ranks compare the loop's arguments first now: the same error on every rank, nothing written."""
    run(2, "resilient_mismatch_job.py", mode, str(tmp_path), timeout=120)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1] and results[0]["result"] != "done", results
    assert "ResilientLoop" in results[0]["message"], results
    assert not list(tmp_path.rglob("*.fti"))
