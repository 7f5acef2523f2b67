"""What every part of a context's engine shares: one record, handed to each collaborator.

Retention, recovery and the committer each need how the ranks talk, where the run's files go, its
commit records, its configuration and the slot of its differential-checkpoint store; they read them
from one :class:`Run` instead of each taking (and storing) the five.
"""

from __future__ import annotations

import dataclasses

from ..model.config import Config
from ..storage.files import RunPaths
from ..transport.base import Transport
from .dcpstore import DcpSlot
from .runstate import RunState


@dataclasses.dataclass(frozen=True)
class Run:
    """One run as the engine sees it (the context holds it; no part holds the context)."""

    transport: Transport
    paths: RunPaths
    state: RunState
    config: Config
    spares: DcpSlot  # the rank's differential-checkpoint store, made on first use


class RunPart:
    """A collaborator of the context that works on one :class:`Run` (its fields as attributes)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.transport, self.paths, self.state = run.transport, run.paths, run.state
        self.config, self.spares = run.config, run.spares
