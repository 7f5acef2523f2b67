"""A job killed (SIGKILL) while its recovery rebuilds lost L2/L3 files: the next recovery gives the checkpoint, exact.

The ranks run as threads of one child process (:class:`~ftidask.engine.grouplevels.ThreadTransport`, the MPI
backend's level code), killed at a write or a commit of a rebuilt file: a half-rebuilt file is never trusted (it is
still at its temporary name, or complete), the restart rebuilds what is missing again, and the redundancy it
rebuilds is sound (a second loss, of other files, is recovered from it). Found fine by the random-kill campaign
(kills at random file-system operations of recoveries that rebuild); kept as a regression test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "conformance"))
import scenarios as sc  # noqa: E402

from ftidask.api.context import Context  # noqa: E402
from ftidask.engine.grouplevels import run_ranks  # noqa: E402
from ftidask.model.config import load_config  # noqa: E402

CHILD = r"""
import sys
from pathlib import Path
sys.path.insert(0, {tests!r}); sys.path.insert(0, {tests!r} + "/conformance")
import crashpoints, scenarios as sc
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.levels.blockio import SafeOutput
from ftidask.model.config import load_config
crashpoints.kill_at_call(SafeOutput, {name!r}, {nth}, after={after})
scenario = sc.Scenario({level}, (), sc.LATEST)
cfg = load_config(None, **sc.config(Path({base!r}), scenario))
print(run_ranks(cfg, sc.NRANKS, lambda t: sc.recover_rank(Context(cfg, t), t.rank), wait=60))
"""


def _run(base: Path, scenario: sc.Scenario, program) -> list:
    cfg = load_config(None, **sc.config(base, scenario))
    results, errors = run_ranks(cfg, sc.NRANKS, lambda t: program(Context(cfg, t), t.rank), wait=60)
    assert errors == [], errors
    return results


FIRST = {2: (sc.Loss("rank", (0,)), sc.Loss("partner", (2,))), 3: (sc.Loss("rank", (0,)), sc.Loss("parity", (1,)))}
SECOND = {2: (sc.Loss("rank", (2,)),), 3: (sc.Loss("rank", (1,)), sc.Loss("rank", (2,)))}


@pytest.mark.parametrize("level,name,nth,after", [
    (3, "write", 5, False),  # mid-way through the rebuilt file (at its temporary name)
    pytest.param(3, "close", 1, True, marks=pytest.mark.slow),  # the data file committed, the parity not rebuilt
    pytest.param(2, "write", 1, True, marks=pytest.mark.slow),
    pytest.param(2, "close", 1, True, marks=pytest.mark.slow)])
def test_killed_while_rebuilding_then_recovered_exactly(tmp_path, level, name, nth, after):
    """Checkpoint 3 at L2/L3 on 4 ranks, rank 0's file and a partner copy / parity lost; the recovery is killed as it
    writes or commits a rebuilt file. The next recovery gives checkpoint 3, exact on every rank; then other files
    are lost and the recovery from what the previous one rebuilt gives checkpoint 3, exact, again."""
    scenario = sc.Scenario(level, FIRST[level], sc.LATEST)
    _run(tmp_path, scenario, lambda ctx, rank: sc.write_rank(ctx, rank, scenario))
    sc.damage(tmp_path, scenario)
    code = CHILD.format(tests=str(Path(__file__).parent), name=name, nth=nth, after=after, level=level,
                        base=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    sc.check(scenario, _run(tmp_path, scenario, sc.recover_rank))
    again = sc.Scenario(level, SECOND[level], sc.LATEST)
    sc.damage(tmp_path, again)
    sc.check(again, _run(tmp_path, again, sc.recover_rank))
