"""The levels over any transport whose ranks form FTI's topology: L2/L3 run over one group channel per group.

:class:`GroupLevels` is what a transport needs for levels 2 and 3 once it knows its
:class:`~ftidask.levels.topology.Topology` and has a :class:`~ftidask.levels.channel.GroupChannel` for
its rank's group: the protection, differential updates and rebuild of the shared level code, with
errors agreed between the group's collectives. The MPI backend's ranks (a sub-communicator per
group) and :class:`ThreadTransport` (ranks as threads of one process, a
:mod:`ftidask.transport.threads` channel per group) are both one, so the same engine and level
code run in one process in milliseconds (the conformance tests) and over mpiexec.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..dcp.delta import file_fb_hash
from ..ftiff import hashing
from ..levels import multilevel, partner_delta, rs_delta
from ..levels.channel import GroupChannel
from ..levels.topology import Topology, local_topology, validate_levels
from ..model.config import Config
from ..model.errors import CheckpointError, LevelError, RecoveryError
from ..storage import files as storage
from ..transport import collective
from ..transport.base import Transport
from ..transport.threads import WAIT, ThreadHub, ThreadMember, run_group
from .recovery import check_file
from .runstate import CommitRecord

log = logging.getLogger("ftidask")


class GroupLevels(Transport):
    """L2/L3 for a transport with a topology (``topo``), a config (``cfg``) and its rank's group channel
    (``group``: None when ``topo.multilevel_ok()`` says why the levels cannot run, kept in ``_problem``)."""

    cfg: Config
    topo: Topology
    group: GroupChannel | None = None
    _problem: str = ""

    def levels(self) -> tuple[int, ...]:
        """Levels 1-4, or only 1 and 4 when the topology cannot run L2/L3."""
        return (1, 4) if self._problem else (1, 2, 3, 4)

    def check_level(self, level: int) -> None:
        """Raise :class:`LevelError`, with the topology's reason, when ``level`` cannot run."""
        if level not in self.levels():
            raise LevelError(f"level {level} is not available: {self._problem}")

    def partner_of(self) -> int:
        """This rank's left partner in the topology (itself when L2/L3 cannot run)."""
        return self.topo.left_partner(self.rank) if self.group is not None else self.rank

    def group_of(self) -> list[int]:
        """The ranks of this rank's L3 group, by node (only itself when L2/L3 cannot run)."""
        return self.topo.group_ranks(self.rank) if self.group is not None else [self.rank]

    # --- levels -----------------------------------------------------------------------------------

    def protect_files(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path) -> None:
        """L2/L3 for ``own_file`` over the group (collective); this rank's errors raise :class:`CheckpointError`."""
        if level not in (2, 3):
            return
        self.check_level(level)
        assert self.group is not None
        # Local work between the group's collectives records its errors (collective.guarded), never raises.
        errors: list[str] = []
        size = _size_or_zero(own_file)
        fb_hash = collective.guarded(errors, lambda: file_fb_hash(own_file), "") if level == 3 else ""
        fb_hashes = self.group.allgather(fb_hash) if level == 3 else None
        # protect_in_step: an exception escaping the level code (a bug) is this rank's error, never its group's hang
        error = multilevel.protect_in_step(self.group, self.cfg, level, ckpt_id, self.rank, own_file, ckpt_dir,
                                           self.group.allgather(size), fb_hashes)
        if error or errors:
            raise CheckpointError("; ".join([*errors, error] if error else errors))

    def protect_files_delta(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path, delta: Any,
                            xor: Any = None) -> None:
        """L2 of a differential file: the partner gets only the changed ranges when it holds the base.
        L3: the parity is updated from every member's ``xor`` delta when all can (else re-encoded)."""
        if level == 3:
            self.check_level(level)
            assert self.group is not None
            errors: list[str] = []
            why = rs_delta.update(self.group, xor, collective.guarded(errors, lambda: file_fb_hash(own_file), ""),
                                  rs_delta.spare_parity_path(ckpt_dir, self.rank),
                                  ckpt_dir / storage.parity_file(ckpt_id, self.rank),
                                  self.group.allgather(_size_or_zero(own_file)), hashing.hash_id(self.cfg.hash))
            if why is None:
                if errors:  # after the level's last collective: local, agreed by the caller
                    raise CheckpointError("; ".join(errors))
                return
            log.info("L3: parity re-encoded in full: %s", why)
        if level != 2:
            self.protect_files(level, ckpt_id, own_file, ckpt_dir)
            return
        self.check_level(level)
        assert self.group is not None
        size = _size_or_zero(own_file)
        error = partner_delta.protect(self.group, own_file, ckpt_dir / storage.partner_file(ckpt_id, self.rank),
                                      partner_delta.spare_partner_path(ckpt_dir, self.rank), size, delta,
                                      self.cfg.transfer_size << 20)
        if error:
            raise CheckpointError(error)

    def rebuild_file(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path, ok: bool,
                     record: CommitRecord | None = None) -> bool:
        """Rebuild the group's lost L2/L3 files from ``record`` (collective); True when this rank has its file. ``ok``
        as given for other levels, no record, or another topology."""
        if level not in (2, 3) or self.group is None or record is None:
            return ok
        sizes = {f.rank: f.size for f in record.files}
        ranks = self.topo.group_ranks(self.rank)
        if record.nranks != self.size or any(r not in sizes for r in ranks):
            return ok  # written by another topology: nothing to rebuild with
        left = self.topo.left_partner(self.rank)

        def verify(path: Path, rank: int) -> bool:  # called between the group's collectives: never raises
            return bool(collective.guarded([], lambda: check_file(path, record, rank).kind == "ok", False,
                                          f"checking {path}"))

        errors: list[str] = []
        rebuilt = multilevel.rebuild(
            self.group, self.cfg, level, record.ckpt_id, self.rank, own_file, ckpt_dir, [sizes[r] for r in ranks],
            ok, verify_own=lambda p: verify(p, self.rank), verify_partner=lambda p: verify(p, left), errors=errors)
        if errors and not rebuilt:  # after the level's last collective: why this rank's file did not come back
            raise RecoveryError("; ".join(errors))
        if errors:  # a partner copy or parity of another rank could not be rebuilt here: the next checkpoint's
            log.warning("rebuilding checkpoint %d (level %d): %s", record.ckpt_id, level, "; ".join(errors))
        return rebuilt


def _size_or_zero(path: Path) -> int:
    """The file's size, 0 when it is missing (its rank still takes part in the collective)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


class ThreadWorld:
    """What the ranks of one in-process run share: the topology and one hub per L2/L3 group.

    Nodes are simulated as with ``local_test`` (``node_size`` consecutive ranks, no heads); each
    rank's files go to its node's directories as in any other run.
    """

    def __init__(self, cfg: Config, nranks: int, wait: float = WAIT) -> None:
        self.cfg, self.wait = cfg, wait
        self.topo = local_topology(nranks, cfg.node_size, 0, cfg.group_size)
        validate_levels(self.topo, [lv for lv in (2, 3) if cfg.interval(lv) > 0])
        self.problem = self.topo.multilevel_ok()
        groups = [] if self.problem else self.topo.rank_groups()
        self.hubs = {tuple(g): ThreadHub(len(g), wait) for g in groups}


class ThreadTransport(GroupLevels):
    """One rank of an in-process run: collectives over the run's threads, L2/L3 over its group's hub."""

    name = "threads"

    def __init__(self, world: ThreadWorld, member: ThreadMember) -> None:
        self.cfg, self.topo, self._problem = world.cfg, world.topo, world.problem
        self._world = member
        self.rank, self.size = member.index, member.size
        self.node, self.nnodes = self.topo.node_of_app(self.rank), self.topo.nnodes
        if not self._problem:
            ranks = self.topo.group_ranks(self.rank)
            self.group = ThreadMember(world.hubs[tuple(ranks)], ranks.index(self.rank))

    def barrier(self) -> None:
        """Wait until every rank thread of the run has reached this call."""
        self._world.allgather(None)

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank, sent as JSON (no rank holds another's objects)."""
        # Values cross as JSON, as between MPI ranks: no rank ever holds another's objects.
        return [json.loads(v) for v in self._world.allgather(json.dumps(value, default=_plain))]


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    raise TypeError(f"cannot send {type(value).__name__} between ranks")


def run_ranks(cfg: Config, nranks: int, step: Callable[[ThreadTransport], Any],
              wait: float = WAIT) -> tuple[list[Any], list[str]]:
    """Run ``step`` once per rank of an in-process run, each on its own thread: ``(results by rank, errors)``."""
    world = ThreadWorld(cfg, nranks, wait)
    return run_group(nranks, lambda member: step(ThreadTransport(world, member)),
                     names=[f"rank {r}" for r in range(nranks)], wait=wait)
