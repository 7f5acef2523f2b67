"""Before resharding an L2/L3 checkpoint: rebuild the old files that were lost, on the old layout's groups.

The groups of the old layout no longer exist as processes, so one rank of the new job plays every
member of an old group, one thread per member, over an in-memory :class:`GroupChannel` (the same
partner-copy and Reed-Solomon code as the MPI backend, :func:`ftidask.levels.multilevel.rebuild`).
It needs the old node directories to be visible from that rank (``local_test``, or shared
directories); where they are not, the files stay lost and the checkpoint is refused with the
missing file named.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..levels import multilevel
from ..storage import files as storage
from .recovery import check_file
from .runstate import CommitRecord

_WAIT = 600.0  # seconds a member waits for its peers (a thread that failed breaks the barrier at once)


class _Hub:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_WAIT)
        self.slots: list[Any] = [None] * size
        self.mail = {(a, b): queue.Queue() for a in range(size) for b in range(size)}  # type: ignore[var-annotated]


class _Member:
    """One member's view of a simulated group (the GroupChannel protocol)."""

    def __init__(self, hub: _Hub, index: int) -> None:
        self.hub, self.index, self.size = hub, index, hub.size

    def allgather(self, value: Any) -> list[Any]:
        self.hub.slots[self.index] = value
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        return [np.array(b, copy=True) for b in self.allgather(block)]

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        if send is not None and dest is not None:
            self.hub.mail[(self.index, dest)].put(np.array(send, copy=True))
        if source is None:
            return None
        return self.hub.mail[(source, self.index)].get(timeout=_WAIT)


def old_groups(record: CommitRecord, group_size: int) -> list[list[int]]:
    """The old layout's L2/L3 groups: per group of ``group_size`` consecutive nodes and per position on
    a node, the old ranks at that position, by node (as :class:`ftidask.levels.topology.Topology`)."""
    by_node: dict[int, list[int]] = {}
    for f in sorted(record.files, key=lambda f: f.rank):
        by_node.setdefault(f.node, []).append(f.rank)
    nodes = sorted(by_node)
    out = []
    for first in range(0, len(nodes), group_size):
        members = nodes[first:first + group_size]
        for pos in range(max(len(by_node[n]) for n in members)):
            out.append([by_node[n][pos] for n in members if pos < len(by_node[n])])
    return out


def rebuild_group(cfg: Any, record: CommitRecord, ranks: list[int], path_of: Callable[[int], Path]) -> str:
    """Check an old group's files and rebuild the lost ones (threads, one per member); '' or what failed."""
    own = {r: path_of(r) for r in ranks}
    ok = {r: check_file(own[r], record, r).kind == "ok" for r in ranks}
    if all(ok.values()) or len(ranks) < 2:
        return "" if all(ok.values()) else f"{own[ranks[0]]}: missing or damaged, and its group has no other member"
    sizes = {f.rank: f.size for f in record.files}
    hub = _Hub(len(ranks))
    results: dict[int, bool] = {}
    errors: list[str] = []

    def member(i: int, r: int) -> None:
        left = ranks[(i - 1) % len(ranks)]
        try:
            storage.makedirs(own[r].parent)  # a lost node's directory comes back
            results[r] = multilevel.rebuild(
                _Member(hub, i), cfg, record.level, record.ckpt_id, r, own[r], own[r].parent,
                [sizes[x] for x in ranks], ok[r],
                verify_own=lambda p: check_file(p, record, r).kind == "ok",
                verify_partner=lambda p: check_file(p, record, left).kind == "ok")
        except Exception as exc:  # noqa: BLE001 - reported; the other members must not wait for this one
            errors.append(f"rebuilding old rank {r}'s file: {type(exc).__name__}: {exc}")
            hub.barrier.abort()

    threads = [threading.Thread(target=member, args=(i, r), name=f"ftidask-rebuild-{r}") for i, r in enumerate(ranks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        return errors[0]
    lost = [r for r in ranks if not results.get(r)]
    return f"{own[lost[0]]}: missing or damaged, and not rebuilt from its group" if lost else ""
