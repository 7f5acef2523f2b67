"""FTI_Snapshot's schedule: which levels are due at this call (``ckpt_l1`` .. ``ckpt_l4`` intervals).

Intervals count minutes (FTI's unit) or, with ``snapshot_unit = iterations``, calls. Minutes are
measured by each process, so the ranks agree on rank 0's answer; iterations are counted alike on
every rank and need no message.
"""

from __future__ import annotations

import time

from ..model import constants
from ..model.config import Config
from ..transport.base import Transport


class SnapshotSchedule:
    """The levels due at each :meth:`ftidask.Context.snapshot` call of one context."""

    def __init__(self, config: Config, transport: Transport) -> None:
        self.config, self.transport = config, transport
        self.iteration = 0
        self.last_time = [time.monotonic()] * 4

    def due(self) -> tuple[list[int], float]:
        """Count this call; the levels due now (collective in minutes) and the time they are due at."""
        self.iteration += 1
        now = time.monotonic()
        due = []
        for level in constants.LEVELS:
            interval = self.config.interval(level)
            if interval <= 0 or level not in self.transport.levels():
                continue
            if self.config.snapshot_unit == "iterations":
                is_due = self.iteration % interval == 0
            else:
                is_due = now - self.last_time[level - 1] >= interval * 60
            if is_due:
                due.append(level)
        if self.config.snapshot_unit != "iterations":
            due = self.transport.bcast(due)  # minutes are measured per process: rank 0's answer
        return due, now

    def written(self, due: list[int], now: float) -> None:
        """The checkpoint for ``due`` was written (or queued): their intervals start again at ``now``."""
        for level in due:
            self.last_time[level - 1] = now
