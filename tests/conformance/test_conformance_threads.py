"""Every loss scenario over the in-process transport: 4 ranks as threads, the real engine and levels.

The ranks run :class:`ftidask.engine.grouplevels.ThreadTransport`, which takes the levels' code path of the
MPI backend (:class:`~ftidask.engine.grouplevels.GroupLevels`) over in-memory group channels, so the
whole matrix (:data:`scenarios.SCENARIOS`) runs in about a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import scenarios as sc

from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config


def run(base: Path, scenario: sc.Scenario, program) -> list:
    cfg = load_config(None, **sc.config(base, scenario))
    results, errors = run_ranks(cfg, sc.NRANKS, lambda t: program(Context(cfg, t), t.rank), wait=60)
    assert errors == [], errors
    return results


@pytest.mark.parametrize("name", list(sc.BY_NAME))
def test_scenario(tmp_path: Path, name: str) -> None:
    scenario = sc.BY_NAME[name]
    run(tmp_path, scenario, lambda ctx, rank: sc.write_rank(ctx, rank, scenario))
    sc.damage(tmp_path, scenario)
    sc.check(scenario, run(tmp_path, scenario, sc.recover_rank))
