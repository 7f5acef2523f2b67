"""Before resharding an L2/L3 checkpoint: rebuild the old files that were lost, on the old layout's groups.

The groups of the old layout no longer exist as processes, so one rank of the new job plays every
member of an old group, one thread per member, over an in-memory :class:`GroupChannel` (the same
partner-copy and Reed-Solomon code as the MPI backend, :func:`ftidask.levels.multilevel.rebuild`).
It needs the old node directories to be visible from that rank (``local_test``, or shared
directories); where they are not, the files stay lost and the checkpoint is refused with the
missing file named.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..levels import multilevel
from ..levels.topology import recorded_topology
from ..model.errors import FormatError
from ..storage import files as storage
from ..transport.threads import ThreadMember, run_group
from .recovery import check_file
from .runstate import CommitRecord


def old_groups(record: CommitRecord, group_size: int) -> list[list[int]]:
    """The old layout's L2/L3 groups: per group of ``group_size`` consecutive nodes and per position on
    a node, the old ranks at that position, by node (as :class:`ftidask.levels.topology.Topology`).

    A Dask record lists the groups it was written with (its cluster's size need not be a multiple of
    ``group_size``): those are the groups, never ones derived again. An MPI record gives the ``group_size`` it
    was written with, which a restart on another number of ranks may have had to change (``group_size`` here is
    then only the fallback of records written before it was recorded)."""
    if record.extra.get("groups"):
        groups = recorded_topology(record.extra["groups"]).rank_groups()
        if sorted(r for g in groups for r in g) != sorted(f.rank for f in record.files):  # a forged record
            raise FormatError(f"checkpoint {record.ckpt_id}: its groups {reprlib.repr(record.extra['groups'])} do "
                              f"not hold its {len(record.files)} ranks once each")
        return groups
    recorded = record.extra.get("group_size")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
        group_size = recorded
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
    def member(ch: ThreadMember) -> bool:
        i = ch.index
        r, left = ranks[i], ranks[(i - 1) % len(ranks)]
        storage.makedirs(own[r].parent)  # a lost node's directory comes back
        return multilevel.rebuild(
            ch, cfg, record.level, record.ckpt_id, r, own[r], own[r].parent, [sizes[x] for x in ranks], ok[r],
            verify_own=lambda p: check_file(p, record, r).kind == "ok",
            verify_partner=lambda p: check_file(p, record, left).kind == "ok")

    rebuilt, errors = run_group(len(ranks), member, names=[f"rebuilding old rank {r}'s file" for r in ranks])
    results = dict(zip(ranks, rebuilt))
    if errors:
        return errors[0]
    lost = [r for r in ranks if not results.get(r)]
    return f"{own[lost[0]]}: missing or damaged, and not rebuilt from its group" if lost else ""


def old_files_sound(ctx: Any, record: CommitRecord, path_of: Callable[[int], Path]) -> bool:
    """Whether every old file of ``record`` (another layout's) verifies, lost L2/L3 files rebuilt first, as a
    redistribution would find them: each rank checks its share of the old files or groups; agreed. Collective."""
    t, problem = ctx.transport, ""
    try:
        if record.level in (2, 3) and not record.fallback:  # a fallback's redundancy was the committed one's
            groups = old_groups(record, ctx.config.group_size)
            for j in range(t.rank, len(groups), t.size):
                problem = problem or rebuild_group(ctx.config, record, groups[j], path_of)
        else:
            for old in range(t.rank, record.nranks, t.size):
                verdict = check_file(path_of(old), record, old)
                problem = problem or ("" if verdict.kind == "ok" else verdict.message or "damaged")
    except Exception as exc:  # noqa: BLE001 - agreed below: a rank that raised alone would leave the others waiting
        problem = problem or f"{type(exc).__name__}: {exc}"
    return not any(t.allgather(problem))
