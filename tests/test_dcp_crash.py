"""A process killed during a differential checkpoint recovers the previous or the new state, exactly."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftidask

sys.path.insert(0, str(Path(__file__).parent))
import _dcp_crash_child as child  # noqa: E402

CHILD = str(Path(__file__).parent / "_dcp_crash_child.py")


def _run(root: Path, steps: int, level: int = 5, crash: str | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, CHILD, str(root), str(steps), str(level), *([crash] if crash else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _committed(out: str) -> int:
    lines = out.split()
    return int(lines[-1]) if lines else 0


def _check_recovers(root: Path, last_printed: int) -> int:
    """Recover in a fresh context; the state must be exactly that of a committed step."""
    try:
        got = child.recovered_step(str(root))
    except ftidask.NoCheckpointError:
        assert last_printed == 0  # killed during the very first checkpoint: nothing was committed
        return 0
    # The commit record may be written just before the kill, after the last print.
    assert got in (last_printed, last_printed + 1), (got, last_printed)
    return got


_slow = pytest.mark.slow


@pytest.mark.parametrize("crash", ["write_var:1", pytest.param("write_var:6", marks=_slow), "write_var:15",
                                   pytest.param("block:3", marks=_slow), "block:40", "finished:3",
                                   pytest.param("renamed:2", marks=_slow), "renamed:4"])
def test_crash_at_a_chosen_point(tmp_path, crash):
    done = _run(tmp_path, 6, crash=crash)
    assert done.returncode == -signal.SIGKILL, done.stderr
    got = _check_recovers(tmp_path, _committed(done.stdout))
    # Restart: the torn spare is rewritten, differential checkpoints go on, the end state is exact.
    again = _run(tmp_path, got + 3)
    assert again.returncode == 0, again.stderr
    assert _check_recovers(tmp_path, got + 3) == got + 3


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=_slow), pytest.param(2, marks=_slow),
                                  pytest.param(3, marks=_slow)])
def test_killed_at_a_random_time(tmp_path, seed):
    rnd = random.Random(seed)
    proc = subprocess.Popen([sys.executable, CHILD, str(tmp_path), "200", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait for the first commits, then kill at a random moment of the checkpoint loop.
    first = proc.stdout.readline()
    assert first.strip() == "1", proc.stderr.read()
    time.sleep(rnd.uniform(0.0, 0.6))
    proc.send_signal(signal.SIGKILL)
    out, _err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL  # killed inside the loop, not after it
    _check_recovers(tmp_path, _committed(first + out))
