"""snapshot() in minutes: FTI's schedule (FTI_UpdateIterTime) and ``max_sync_intv``, FTI's syncIntv suite.

The ranks agree on the mean time of a call every ``sync`` calls (1, 2, 4, ... up to ``max_sync_intv``), from it
on the calls a minute and the call at which the intervals are looked at next; they checkpoint at that call.
FTI's ITF (testing/suites/features/syncIntv) checks, from FTI's debug lines, that each checkpoint is made at a
predicted call, and that the resynchronisations come at multiples of the interval, never beyond
``max_sync_intv``. A clock driven by the test stands for the calls' durations: nothing waits.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

import ftidask
from ftidask.engine.schedule import SnapshotSchedule, max_sync
from ftidask.model import constants

LINE = re.compile(r"Current iter : (\d+) ckpt intv. : (\d+) . Next ckpt. at iter. (\d+) . Sync. intv. : (\d+)")


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(dirs: dict, durations: list[float], **config: object) -> tuple[list[tuple[int, int]], list[tuple]]:
    """snapshot() once per duration (the call's time); ``[(call, level)]`` of the checkpoints it made, and
    the (call, calls a minute, next look, sync) of FTI's debug lines."""
    ctx = ftidask.init(**dirs, **config)
    clock = Clock()
    ctx._schedule = SnapshotSchedule(ctx.config, ctx.transport, clock=clock)
    ctx.protect(1, np.zeros(4))
    made, lines = [], []
    handler = _Collect(lines)
    logger = logging.getLogger("ftidask")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        for call, seconds in enumerate(durations, start=1):
            clock.now += seconds
            if ctx.snapshot() == constants.FTI_DONE:
                made.append((call, ctx.last_checkpoint.level))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)  # the level the other tests expect
        ctx.finalize()
    return made, lines


class _Collect(logging.Handler):
    def __init__(self, lines: list[tuple]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        found = LINE.search(record.getMessage())
        if found:
            self.lines.append(tuple(int(x) for x in found.groups()))


def itf_checks(made: list[tuple[int, int]], lines: list[tuple], max_sync_intv: int) -> None:
    """FTI's syncIntv ITF: each checkpoint at a predicted call (or a number of calls a minute after the
    previous one); resynchronisations at multiples of their interval, which never exceeds the maximum."""
    predicted, per_minute = {next_look for _c, _p, next_look, _s in lines}, {p for _c, p, _n, _s in lines}
    last = 0
    for call, _level in made:
        assert call in predicted or call - last in per_minute, (call, sorted(predicted))
        last = call
    for call, _p, _n, sync in lines:
        assert sync <= max_sync(max_sync_intv) and call % sync == 0, (call, sync)


def test_max_sync_is_fti_power_of_two() -> None:
    assert [max_sync(v) for v in (0, 1, 2, 3, 6, 8, 100, 512, 1000)] == [512, 1, 2, 2, 4, 8, 64, 512, 512]


def test_checkpoints_at_the_calls_a_minute_of_calls_makes(dirs) -> None:
    """Calls of 1.5 s: 40 a minute. Looks at calls 41, 81, 121, 161 (minutes 1-4): L1 each minute, L4 every
    second one (the highest due level is written); the sync interval doubles to 32 (>= half of 40), agreeing
    at calls 1, 2, 4, 8, 16, 32, 64, ..."""
    made, lines = drive(dirs, [1.5] * 170, ckpt_l1=1, ckpt_l4=2)
    assert made == [(41, 1), (81, 4), (121, 1), (161, 4)]
    assert [c for c, *_ in lines] == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160]
    assert {(p, n) for _c, p, n, _s in lines} >= {(40, 41), (40, 81), (40, 161)}
    itf_checks(made, lines, 0)


@pytest.mark.parametrize(("max_sync_intv", "sync", "looks"), [(1, 1, [170, 208, 242, 274]),
                                                               (6, 4, [170, 209, 243, 275]),
                                                               (0, 32, [174, 215, 251, 284])])
def test_max_sync_intv_bounds_the_resynchronisation(dirs, max_sync_intv: int, sync: int, looks: list[int]) -> None:
    """FTI's syncIntv application: the calls slow down (here from 1 s to 3 s, after call 150). The ranks agree
    every call, every 4 (6 rounded down to a power of 2) or every 32 calls (512: half a minute's calls bound it):
    the sooner they agree again, the sooner the looks follow the new pace. Each checkpoint is a predicted one,
    and they go on to the end (FTI's schedule stops looking here: a look set to the call just passed)."""
    made, lines = drive(dirs, [1.0] * 150 + [3.0] * 150, ckpt_l1=1, max_sync_intv=max_sync_intv)
    itf_checks(made, lines, max_sync_intv)
    assert max(s for *_x, s in lines) == sync
    if max_sync_intv == 1:  # an agreement at every call (and only then a collective)
        assert [c for c, *_ in lines] == list(range(1, 300))
    assert made == [(c, 1) for c in [61, 121, *looks]]  # 60 calls a minute while every call takes 1 s


def test_a_minute_longer_than_a_call_counts_the_minutes_passed(dirs) -> None:
    """Calls of 90 s (over a minute): a look at every call, the minutes counted from the agreed mean time:
    ckpt_l1 = 3 is due at minutes 3, 6, 9 ... (calls 3, 5, 7: 180 s, 360 s, 540 s of calls)."""
    made, _lines = drive(dirs, [90.0] * 8, ckpt_l1=3)
    assert [c for c, _lv in made] == [3, 5, 7]


def test_iterations_unit_needs_no_clock(dirs) -> None:
    made, lines = drive(dirs, [1000.0] * 6, ckpt_l1=2, ckpt_l4=3, snapshot_unit="iterations")
    assert made == [(2, 1), (3, 4), (4, 1), (6, 4)] and lines == []


def mpi_test(fn):
    for mark in need_mpi():
        fn = mark(fn)
    return fn


@mpi_test
def test_ranks_of_different_pace_checkpoint_at_the_same_call(tmp_path: Path) -> None:
    """4 ranks whose calls take 1, 2, 3 and 4 s: the agreed mean (2.5 s) makes 24 calls a minute, and every
    rank checkpoints at calls 25, 49, 73 and 97 (each checkpoint is collective: a rank of its own would hang
    the job), with an allgather only at the 10 agreements (calls 1, 2, 4, 8, 16, 32, 48, 64, 80, 96)."""
    cfg = {"local_test": 1, "node_size": 1, "ckpt_l1": 1, "max_sync_intv": 16}
    run(4, "itf_job.py", "syncintv", json.dumps(cfg), str(tmp_path), "100", timeout=120)
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    assert all(r["made"] == [25, 49, 73, 97] and r["gathers"] == 10 for r in got), got


@pytest.mark.dask
@pytest.mark.timeout(240)
def test_dask_client_keeps_the_same_schedule(dirs, dask_client) -> None:
    """On Dask the client is the one process that schedules: the same calls as one process's."""
    made, lines = drive(dirs, [1.5] * 90, ckpt_l1=1, ckpt_l4=2, client=dask_client)
    assert made == [(41, 1), (81, 4)]
    itf_checks(made, lines, 0)


@pytest.fixture
def dirs(tmp_path: Path) -> dict:
    return {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta")}


def test_configured_levels_the_backend_lacks_are_said(tmp_path, caplog):
    """ckpt_l2 in one process: snapshot() never wrote level 2, and said nothing (checkpoint(id, 2) is refused)."""
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       ckpt_l2=2, snapshot_unit="iterations", verbosity=2)
    ctx.protect(1, np.zeros(3))
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        for _ in range(6):
            ctx.snapshot()
    said = [r for r in caplog.records if "levels [2] are configured" in r.getMessage()]
    assert len(said) == 1 and ctx.last_checkpoint is None
    ctx.finalize()


def test_dcp_l4_is_a_differential_level_4_between_l3_and_l4(dirs) -> None:
    """FTI's ``dcp_l4``: snapshot() writes level 8 (a differential L4) at its interval; when several are due, FTI's
    order decides (L1, L2, L3, dCP L4, L4: the last due wins). It was accepted and ignored: no checkpoint at all."""
    made, _lines = drive(dirs, [1000.0] * 12, ckpt_l1=2, dcp_l4=3, ckpt_l4=6, enable_dcp=1,
                         snapshot_unit="iterations")
    assert made == [(2, 1), (3, 8), (4, 1), (6, 4), (8, 1), (9, 8), (10, 1), (12, 4)]
    made, _lines = drive(dirs, [1.5] * 170, dcp_l4=1, ckpt_l4=2, enable_dcp=1)  # minutes: looks at 41, 81, ...
    assert made == [(41, 8), (81, 4), (121, 8), (161, 4)]
    made, _lines = drive(dirs, [1000.0] * 3, dcp_l4=1, enable_dcp=1, snapshot_unit="iterations")
    assert made == [(1, 8), (2, 8), (3, 8)]


def test_dcp_l4_needs_enable_dcp(dirs) -> None:
    with pytest.raises(ftidask.ConfigError, match=r"dcp_l4 .* needs enable_dcp = 1"):
        ftidask.init(**dirs, dcp_l4=2)


def test_a_negative_interval_is_never_as_in_fti(dirs, tmp_path) -> None:
    """FTI reads ckpt_lN with a default of -1 and checkpoints only when the interval is above 0: an FTI config file
    holding -1 was refused (ConfigError); it loads now, as never."""
    cfg = tmp_path / "fti.cfg"
    cfg.write_text("[basic]\nckpt_l1 = -1\nckpt_l2 = -1\nckpt_l3 = -1\nckpt_l4 = 2\ndcp_l4 = -5\n"
                   "[advanced]\nsnapshot_unit = iterations\n")
    assert ftidask.load_config(cfg).ckpt_l1 == 0 and ftidask.load_config(cfg).dcp_l4 == 0
    made, _lines = drive(dirs, [1000.0] * 4, ckpt_l1=-1, ckpt_l4=2, dcp_l4=-3, snapshot_unit="iterations")
    assert made == [(2, 4), (4, 4)]


def test_a_restart_with_nothing_to_recover_raises_until_the_program_starts_afresh(tmp_path):
    """FTI's init starts afresh when no checkpoint verifies; ftidask never gives up a restart by itself: snapshot()
    raises NoCheckpointError (the arrays untouched), and a checkpoint() the program calls instead ends the restart,
    after which snapshot() runs its schedule (docs/guide.md)."""
    import glob
    import os

    kw = dict(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"), verbosity=4,
              ckpt_l1=1, snapshot_unit="iterations")
    ctx = ftidask.init(**kw)
    ctx.protect(1, np.arange(4.0))
    ctx.checkpoint(1, 1)
    ctx._close()  # the program dies; then its level-1 files are lost with the node
    for path in glob.glob(str(tmp_path / "L" / "**" / "*.fti"), recursive=True):
        os.remove(path)
    again = ftidask.init(**kw)
    a = np.full(4, 7.0)
    again.protect(1, a)
    for _ in range(2):  # tried again at each call (a disk may come back)
        with pytest.raises(ftidask.NoCheckpointError):
            again.snapshot()
        assert again.status() == 1 and (a == 7.0).all()
    assert again.checkpoint(2, 1).id == 2
    assert [again.snapshot() for _ in range(3)] == [ftidask.FTI_SCES, ftidask.FTI_DONE, ftidask.FTI_DONE]
    again.finalize()
