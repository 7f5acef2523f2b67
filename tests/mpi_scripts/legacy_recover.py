"""Rank script of tests/test_legacy_fixtures.py: restart each copied legacy MPI case and recover it.

usage: legacy_recover.py CASE_DIR [CASE_DIR ...]
For each case (a copy of tests/data/legacy/<case>, possibly with a node erased), every rank changes
to the case directory, runs ``ftidask.init("config.fti", comm=MPI.COMM_WORLD)``, protects variables
of the right shape, recovers and compares bit for bit; then writes one more checkpoint at the same
level on top of the legacy one, scribbles over its variables, recovers again and compares; then
finalizes. Each rank writes ``<case_dir>/legacy-result-<rank>.json``: {"problems": [...]}.
Public API only (ftidask.init, the Context's methods, ftidask.State...).
"""

import json
import os
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "legacy"))
import legacy_check  # noqa: E402

import ftidask  # noqa: E402


def one_case(case_dir: Path, rank: int) -> list[str]:
    case = legacy_check.load(case_dir)
    entries = case["vars"][str(rank)]
    os.chdir(case_dir)
    ctx = ftidask.init("config.fti", comm=MPI.COMM_WORLD)
    problems = []
    if ctx.status() != case["status"]:
        problems.append(f"status {ctx.status()}, expected {case['status']}")
    if ctx.exec_id != case["exec_id"]:
        problems.append(f"exec_id {ctx.exec_id!r}, expected {case['exec_id']!r}")
    targets = legacy_check.targets_for(case_dir, entries)
    legacy_check.protect_all(ctx, targets, entries)
    out = ctx.recover()
    problems += legacy_check.recovered_from_problems(ctx.recovered_from, case["checkpoint"])
    problems += legacy_check.compare(case_dir, entries, targets, out)
    # The run goes on from the legacy checkpoint: one more checkpoint at its level, recovered again.
    ckpt_id, level = case["checkpoint"]
    ctx.checkpoint(ckpt_id + 1, level)
    legacy_check.scribble(targets)
    ctx.recover()
    problems += [f"after the next checkpoint: {p}"
                 for p in legacy_check.recovered_from_problems(ctx.recovered_from, [ckpt_id + 1, level])]
    problems += [f"after the next checkpoint: {p}" for p in legacy_check.compare(case_dir, entries, targets)]
    ctx.finalize()
    return problems


def main() -> None:
    rank = MPI.COMM_WORLD.rank
    for arg in sys.argv[1:]:
        case_dir = Path(arg)
        try:
            problems = one_case(case_dir, rank)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which shows it
            problems = [f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"]
        (case_dir / f"legacy-result-{rank}.json").write_text(json.dumps({"problems": problems}))
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
