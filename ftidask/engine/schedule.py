"""FTI_Snapshot's schedule: which levels are due at this call (``ckpt_l1`` .. ``ckpt_l4`` intervals, and ``dcp_l4``:
level 8, a differential L4 checkpoint).

With ``snapshot_unit = iterations`` intervals count calls, alike on every rank: no message.

In minutes (FTI's unit) it is FTI's schedule (FTI_UpdateIterTime): the ranks do not compare clocks at
every call. Every ``sync`` calls they agree, with one allgather, on the mean time of a call, hence on
how many calls make a minute and at which call to look at the intervals next; ``sync`` starts at 1 and
doubles while under half a minute's calls, up to ``max_sync_intv`` (a power of 2; 0: FTI's 512). Each
look counts a minute; level L is due when that count reaches its next multiple of ``ckpt_lL``. Every
rank so checkpoints at the same call, from the same numbers, with no collective at the other calls.
Two differences from FTI's code, where it misbehaves, are marked below (docs/config.md says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..model.config import Config
from ..model.errors import CheckpointError
from ..model.level import Level
from ..transport.base import Transport
from ..transport.collective import gather_tagged

log = logging.getLogger("ftidask")

DEFAULT_MAX_SYNC = 512  # FTI's, when max_sync_intv is 0 (or not set)
_MOST_CALLS = 2**31 - 1  # calls a minute when a call takes no measurable time (FTI's C int)
# FTI_Snapshot looks at L1, L2, L3, then L4's dCP interval, then L4, each due one replacing the level chosen before: a
# full L4 due wins over a differential one, a differential L4 over L1-L3.
PRECEDENCE = (1, 2, 3, 8, 4)


def max_sync(value: int) -> int:
    """FTI's longest resynchronisation interval for ``max_sync_intv``: 512 for 0, else the power of 2 at most it."""
    return DEFAULT_MAX_SYNC if value <= 0 else 1 << (value.bit_length() - 1)


class SnapshotSchedule:
    """The levels due at each :meth:`ftidask.Context.snapshot` call of one context.

    ``clock`` (seconds, monotonic) is an attribute so that tests can drive the minutes without waiting.
    """

    def __init__(self, config: Config, transport: Transport, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.transport, self.clock = config, transport, clock
        self.iteration = 0  # calls so far, this one included (FTI's ckptIcnt after its increment)
        self.max_sync = max_sync(config.max_sync_intv)
        self.sync = 1  # calls between two agreements on the mean call time (FTI's syncIter)
        self.per_minute = 1  # calls a minute, as last agreed (FTI's ckptIntv)
        self.next_check = self.last_check = 0  # the calls at which the intervals are (were) looked at
        self.mean = 0.0  # the agreed mean time of a call (FTI's globMeanIter)
        self.total = 0.0  # this rank's time in calls so far, checkpoints left out (FTI's totalIterTime)
        self.minutes = 0  # looks so far: minutes (FTI's minuteCnt)
        self.counts = dict.fromkeys(PRECEDENCE, 1)  # level L is due at minute counts[L] * its interval (FTI's ckptCnt)
        self.mark = clock()  # when the last call (or checkpoint) ended (FTI's iterTime)
        self.said = False  # whether the configured levels this backend lacks were said

    def due(self) -> list[int]:
        """Count this call; the levels due now, the one to write last (:data:`PRECEDENCE`; minutes: collective every
        ``sync`` calls, the same on every rank)."""
        self.iteration += 1
        configured = [lv for lv in PRECEDENCE if self.config.interval(lv) > 0]
        have = self.transport.levels()
        levels = [lv for lv in configured if Level.of(lv).base in have]
        if len(levels) < len(configured) and not self.said:  # they were left out silently: protection the user
            self.said = True  # believed they had (ckpt_l2 in one process, or on a Dask cluster of one worker)
            log.warning("snapshot(): levels %s are configured (ckpt_l*) but this backend cannot write them here (it "
                        "has levels %s): they are left out", [lv for lv in configured if lv not in have], list(have))
        if self.config.snapshot_unit == "iterations":
            return [lv for lv in levels if self.iteration % self.config.interval(lv) == 0]
        now = self.clock()
        self._time_call(now)
        if self.iteration != self.next_check:
            return []
        # A look at the intervals: one more minute. Beyond a minute a call, the minutes the calls took; from
        # the agreed mean (FTI reads each rank's own total here, on which the ranks may disagree).
        self.minutes = int(self.mean * (self.iteration - 1) // 60) if self.mean > 60 else self.minutes + 1
        due = [lv for lv in levels if self.minutes >= self.counts[lv] * self.config.interval(lv)]
        for lv in due:  # an interval passed counts, taken or not (only the last due level is written)
            self.counts[lv] += 1
        self.last_check, self.next_check = self.next_check, self.next_check + self.per_minute
        if not due:
            self.mark = now
        return due

    def written(self) -> None:
        """The checkpoint of the levels due was written (or queued): its time is no call's."""
        self.mark = self.clock()

    def _time_call(self, now: float) -> None:
        """FTI_UpdateIterTime: add the call that ends now; every ``sync`` calls agree on the mean call time,
        from it on the calls a minute and the next look, and let ``sync`` grow towards ``max_sync``."""
        calls, last, self.mark = self.iteration - 1, self.mark, now
        if calls == 0:  # the time before the first call is not a call's
            return
        self.total += now - last
        if calls % self.sync:
            return
        means = gather_tagged(self.transport, "snapshot", self.total / calls, CheckpointError)
        self.mean = sum(means) / len(means)  # the same list, summed in the same order: the same on every rank
        if self.mean > 60:
            self.per_minute = 1
        else:  # rounded half to even, as C's rint
            self.per_minute = min(_MOST_CALLS, round(60 / self.mean)) if self.mean > 0 else _MOST_CALLS
        first = 1 if self.last_check == 0 else 0
        # Never a look already passed: FTI keeps one that is not before the previous call (its ckptIcnt here),
        # so a look due at that very call is never made, nor any later one while the calls keep slowing down.
        if self.last_check + self.per_minute + first >= self.iteration:
            self.next_check = self.last_check + self.per_minute + first
        log.debug("Current iter : %d ckpt intv. : %d . Next ckpt. at iter. %d . Sync. intv. : %d",
                  calls, self.per_minute, self.next_check, self.sync)
        if self.sync < self.per_minute // 2 and self.sync < self.max_sync:
            self.sync *= 2
            log.debug("Iteration frequency : %.2f sec/iter => %d iter/min. Resync every %d iter.",
                      self.mean, self.per_minute, self.sync)
