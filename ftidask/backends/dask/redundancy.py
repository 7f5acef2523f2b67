"""Which ranks of an L2/L3 Dask checkpoint lack their redundancy, found with stats only.

A restart rebuilds a partner copy or parity file that is missing, of the wrong size or (a parity) without
its ``.hash`` record beside sound own files, as FTI does (its ckpt_consistency check: partner files erased,
restart, crash, every rank file erased, restart), so that the checkpoint survives the next loss. Finding
them must cost no read: a restart with nothing lost opens the own files only. The level code checks the
same once its group runs (``_present`` in :mod:`ftidask.levels.partner` and :mod:`ftidask.levels.rs`);
this check, on the client, decides which groups run at all. Redundancy damaged in place (right size,
record there) is not seen by a stat: it is left to the next checkpoint at that level, the MPI backend's
policy (a later rebuild checks it before using it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...levels import rs
from ...levels.topology import Topology


class Redundancy:
    """The partner copies (L2) or parity files and their records (L3) of one checkpoint, by rank."""

    def __init__(self, level: int, topo: Topology, sizes: dict[int, int], side: dict[int, str]) -> None:
        self.level = level
        self.side = side  # rank -> its Pcof (L2) or RSed (L3) file, in its node's directory
        self.records = {r: str(rs.hash_path(Path(p))) for r, p in side.items()} if level == 3 else {}
        if level == 2:  # rank r keeps its left partner's file
            self.expected = {r: sizes[topo.left_partner(r)] for r in side}
        else:  # a parity is as long as the group's largest file (FTI's maxFs)
            self.expected = {r: max(sizes[g] for g in topo.group_ranks(r)) for r in side}

    def paths(self) -> list[str]:
        """Every file to stat: the partner copies or parity files, then the parities' records."""
        return list(self.side.values()) + list(self.records.values())

    def missing(self, hosts: dict[int, str], stats: dict[str, Any], paths: list[str]) -> set[int]:
        """The ranks of ``hosts`` (rank -> the worker that serves its sound own file) whose redundancy, as
        that worker sees it, is missing, of the wrong size or without its record; ``stats``: each worker's
        :func:`~ftidask.backends.dask.tasks.sizes` of ``paths``."""
        if self.level not in (2, 3):
            return set()
        at = {p: i for i, p in enumerate(paths)}
        out = set()
        for r, worker in hosts.items():
            seen = stats.get(worker)
            if not isinstance(seen, list):  # the worker did not answer: it serves no file (see _Placer)
                continue
            if seen[at[self.side[r]]] != self.expected[r] or (r in self.records and seen[at[self.records[r]]] < 0):
                out.add(r)
        return out

