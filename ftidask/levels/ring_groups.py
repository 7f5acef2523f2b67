"""Pure topology of the multi-node levels: groups of nodes, the partner ring, parity roles.

Written for the Dask backend (where a node is a worker); FTI's rules: nodes form groups of
``group_size`` consecutive nodes; in L2 each node keeps a copy of its left neighbour's file
(its *partner* in the group ring); in L3 each of a group's ``k`` nodes keeps its own file and
one of the ``k`` Reed-Solomon parity files of the group, so any ``k`` of the ``2k`` files
rebuild the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.errors import LevelError


def make_groups(nnodes: int, group_size: int) -> list[list[int]]:
    """Consecutive groups of ``group_size`` nodes; a lone leftover node joins the last group.

    FTI requires ``nnodes`` to be a multiple of ``group_size``; a Dask cluster's size is
    whatever it is, so a leftover of two or more nodes forms a smaller group of its own.
    """
    if nnodes < 1 or group_size < 1:
        raise LevelError(f"cannot group {nnodes} nodes by {group_size}")
    size = min(group_size, nnodes)
    groups = [list(range(lo, min(lo + size, nnodes))) for lo in range(0, nnodes, size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


def group_of(groups: Sequence[Sequence[int]], node: int) -> list[int]:
    """The group holding ``node``."""
    for group in groups:
        if node in group:
            return list(group)
    raise LevelError(f"node {node} is in no group")


def copy_holder(groups: Sequence[Sequence[int]], node: int) -> int:
    """The node that keeps the L2 copy of ``node``'s file (its right neighbour in the group ring)."""
    group = group_of(groups, node)
    if len(group) < 2:
        raise LevelError("level 2 needs groups of at least 2 nodes (workers)")
    return group[(group.index(node) + 1) % len(group)]


def copy_source(groups: Sequence[Sequence[int]], node: int) -> int:
    """The node whose file ``node`` keeps as its L2 copy (its left neighbour)."""
    group = group_of(groups, node)
    if len(group) < 2:
        raise LevelError("level 2 needs groups of at least 2 nodes (workers)")
    return group[(group.index(node) - 1) % len(group)]
