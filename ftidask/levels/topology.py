"""Who is where: nodes, heads, groups and partners of a run (pure functions, no backend).

The one model of placement for every backend. FTI's topology (MPI): processes are grouped into
nodes (by host name, or with ``local_test`` as simulated nodes of ``node_size`` consecutive
ranks); with ``head = 1`` the first process of each node is a head, kept out of the
application's communicator. Nodes form groups of ``group_size`` consecutive nodes (FTI's
sectors); inside a group, the process at the same position on the next node is the L2 partner
(a ring), and the processes at the same position on every node of the group form the L3
erasure-coding group.

The Dask backend builds the same model from its worker list (:func:`worker_topology`): each
worker is one rank on a node of its own. A cluster's size is whatever it is, so its groups
follow a looser rule (:func:`worker_groups`) and are given to the model explicitly; a commit
record lists them, and recovery rebuilds the model from that list (:func:`recorded_topology`),
so a checkpoint is always read with the groups it was written with.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import reprlib
from collections.abc import Sequence

from ..model.errors import ConfigError, LevelError


@dataclasses.dataclass(frozen=True)
class Topology:
    """The placement of every process of ``COMM_WORLD`` (world ranks) and of the application ranks."""

    node_size: int
    head: int
    group_size: int
    node_of: tuple[int, ...]  # world rank -> node id
    local_of: tuple[int, ...]  # world rank -> position on its node (0..node_size-1)
    #: The groups of nodes when they do not follow FTI's rule (Dask's workers); None: FTI's
    #: consecutive groups of ``group_size`` nodes.
    node_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def nprocs(self) -> int:
        """Processes in ``COMM_WORLD``, heads included."""
        return len(self.node_of)

    @property
    def nnodes(self) -> int:
        """Number of nodes (``nprocs // node_size``)."""
        return self.nprocs // self.node_size

    @property
    def app_per_node(self) -> int:
        """Application processes per node (FTI's nbApprocs)."""
        return self.node_size - self.head

    def is_head(self, world: int) -> bool:
        """Whether world rank ``world`` is its node's head (its first process, when ``head`` is set)."""
        return bool(self.head) and self.local_of[world] == 0

    @functools.cached_property
    def app_world(self) -> tuple[int, ...]:
        """World rank of each application rank (heads removed, world order kept)."""
        return tuple(w for w in range(self.nprocs) if not self.is_head(w))

    def app_rank_at(self, node: int, position: int) -> int:
        """The application rank at ``position`` (0..app_per_node-1) on ``node``."""
        return self._app_index[(node, position)]

    @functools.cached_property
    def _app_index(self) -> dict[tuple[int, int], int]:
        return {(self.node_of[w], self.local_of[w] - self.head): a for a, w in enumerate(self.app_world)}

    def node_of_app(self, app: int) -> int:
        """The node of application rank ``app``."""
        return self.node_of[self.app_world[app]]

    def position_of_app(self, app: int) -> int:
        """Application rank ``app``'s position among its node's application processes."""
        return self.local_of[self.app_world[app]] - self.head

    # --- groups (FTI's sectors) ------------------------------------------------------------------

    @functools.cached_property
    def _groups(self) -> tuple[tuple[int, ...], ...]:
        if self.node_groups is not None:
            return self.node_groups
        size = max(self.group_size, 1)
        return tuple(tuple(range(lo, min(lo + size, self.nnodes))) for lo in range(0, self.nnodes, size))

    @functools.cached_property
    def _group_index(self) -> dict[int, int]:
        return {node: g for g, nodes in enumerate(self._groups) for node in nodes}

    def group_of_node(self, node: int) -> int:
        """The index of ``node``'s group (FTI's sector)."""
        return self._group_index[node]

    def index_in_group(self, node: int) -> int:
        """``node``'s place in its group (0..size-1)."""
        return self._groups[self.group_of_node(node)].index(node)

    def group_nodes(self, node: int) -> list[int]:
        """The nodes of ``node``'s group, in group order."""
        return list(self._groups[self.group_of_node(node)])

    def group_ranks(self, app: int) -> list[int]:
        """The L3 group of ``app``: the ranks at its position on each node of its group, by node."""
        pos = self.position_of_app(app)
        return [self.app_rank_at(n, pos) for n in self.group_nodes(self.node_of_app(app))]

    def rank_groups(self) -> list[list[int]]:
        """Every L2/L3 group of application ranks: by group of nodes, then by position on a node."""
        return [[self.app_rank_at(n, pos) for n in nodes] for nodes in self._groups for pos in range(self.app_per_node)]

    def _ring(self, app: int) -> list[int]:
        ranks = self.group_ranks(app)
        if len(ranks) < 2:  # a copy on the same node is no copy: never pretend there is a partner
            raise LevelError(f"level 2 needs groups of at least 2 nodes; rank {app}'s group is {ranks}")
        return ranks

    def left_partner(self, app: int) -> int:
        """Whose file ``app``'s node keeps as ``Pcof{app}``: same position, previous node of the group."""
        ranks = self._ring(app)
        return ranks[(ranks.index(app) - 1) % len(ranks)]

    def right_partner(self, app: int) -> int:
        """Who keeps ``app``'s file as its partner copy: same position, next node of the group."""
        ranks = self._ring(app)
        return ranks[(ranks.index(app) + 1) % len(ranks)]

    def multilevel_ok(self) -> str:
        """'' when L2 and L3 can run, else why not."""
        if self.node_groups is not None:
            small = [list(g) for g in self.node_groups if len(g) < 2]
            return f"group(s) {small} have fewer than 2 nodes: L2 and L3 need 2 or more" if small else ""
        if self.group_size < 2:
            return f"group_size = {self.group_size}: L2 and L3 need group_size >= 2; set group_size to 2 or more"
        if self.nnodes < 2:
            return ("one node: L2 and L3 need 2 or more (on one machine: local_test = 1, which makes a node of "
                    "every node_size ranks)")
        if self.nnodes % self.group_size:
            fits = [g for g in range(2, min(self.nnodes, 128) + 1) if self.nnodes % g == 0]
            return (f"{self.nnodes} node(s) are not a multiple of group_size = {self.group_size} "
                    f"(L2 and L3 need whole groups of nodes): set group_size to {_either(fits)} (a divisor of the "
                    f"{self.nnodes} nodes), or run on a multiple of {self.group_size} nodes")
        return ""


def _either(numbers: list[int]) -> str:
    """``[1, 2, 3]`` -> ``'1, 2 or 3'`` (the first 8 only, then ``...``)."""
    shown = [str(n) for n in numbers[:8]]
    if len(numbers) > 8:
        return ", ".join(shown) + ", ..."
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _check_basic(nprocs: int, node_size: int, head: int) -> None:
    if nprocs % node_size:
        fits = [n for n in range(2 if head else 1, nprocs + 1) if nprocs % n == 0]  # a head needs a rank beside it
        if not fits:  # one process with head = 1
            raise ConfigError(f"head = 1 needs at least 2 processes per node, and this job has {nprocs}: run more "
                              "processes, or set head = 0")
        raise ConfigError(f"the number of processes ({nprocs}) is not a multiple of node_size ({node_size}): set "
                          f"node_size to the processes on each node ({_either(fits)}: a divisor of {nprocs}"
                          f"{' of at least 2 with head = 1' if head else ''})")
    if head and node_size < 2:
        raise ConfigError("head = 1 needs node_size >= 2 (one head and at least one application process per node)")


def local_topology(nprocs: int, node_size: int, head: int, group_size: int) -> Topology:
    """``local_test`` topology: node = rank // node_size (simulated nodes on one machine)."""
    _check_basic(nprocs, node_size, head)
    return Topology(node_size, head, group_size, tuple(w // node_size for w in range(nprocs)),
                    tuple(w % node_size for w in range(nprocs)))


def host_topology(hostnames: Sequence[str], node_size: int, head: int, group_size: int) -> Topology:
    """Nodes by host name, numbered in order of first appearance; each must hold ``node_size`` processes."""
    _check_basic(len(hostnames), node_size, head)
    node_ids: dict[str, int] = {}
    count: dict[str, int] = {}
    node_of, local_of = [], []
    for host in hostnames:
        node_of.append(node_ids.setdefault(host, len(node_ids)))
        local_of.append(count.get(host, 0))
        count[host] = count.get(host, 0) + 1
    wrong = {h: c for h, c in count.items() if c != node_size}
    if wrong:
        host, c = next(iter(wrong.items()))
        raise ConfigError(f"host {host!r} runs {c} process(es), node_size is {node_size}; set node_size to the "
                          "processes per node, or local_test = 1 to simulate nodes of node_size ranks")
    return Topology(node_size, head, group_size, tuple(node_of), tuple(local_of))


def hosts_by_node(hostnames: Sequence[str]) -> list[str]:
    """The host of each node of :func:`host_topology` (by node id: the hosts in order of first appearance)."""
    return list(dict.fromkeys(hostnames))


def reordered(old_hosts: Sequence[str], old_nodes: Sequence[int], hostnames: Sequence[str]) -> list[int] | None:
    """FTI_ReorderNodes: the new position of each process (by world rank, ``hostnames`` its host) that puts every
    process of a restarted run where a process of its host was when the checkpoint was written (``old_hosts``: the
    host of each node id then, ``old_nodes``: the node of each world rank then), so that the ranks on a host find the
    node-local files they wrote there: the k-th process on a host takes the place of the k-th process that host had
    (heads stay first; a placement of ranks across hosts in turn is kept as it was). A host new to the run (a spare
    that replaced a failed node) takes the places of a host that is gone, the smallest node id first (its files come
    back from L2/L3 redundancy). None when nothing moves, or when the run has another number of processes or nodes,
    or processes spread otherwise over the hosts (another layout, which recovery redistributes or refuses)."""
    if (len(old_nodes) != len(hostnames) or len(set(old_hosts)) != len(old_hosts)
            or any(not 0 <= n < len(old_hosts) for n in old_nodes)):
        return None
    before = [old_hosts[n] for n in old_nodes]
    current, was = hosts_by_node(hostnames), hosts_by_node(before)
    if len(current) != len(was) or was != list(old_hosts):  # node ids by first appearance, as host_topology numbers
        return None
    present, had = set(current), set(was)
    host_of = {h: h for h in current if h in had}  # each current host -> the old host whose places it takes
    gone = iter(h for h in was if h not in present)  # ``was`` is in node-id order (checked above)
    for h in current:
        if h not in host_of:
            host_of[h] = next(gone)
    places: dict[str, list[int]] = {}
    for w, h in enumerate(before):
        places.setdefault(h, []).append(w)
    counts = collections.Counter(hostnames)
    if any(counts[h] != len(places[host_of[h]]) for h in current):
        return None
    taken: dict[str, int] = {}
    keys = []
    for h in hostnames:
        keys.append(places[host_of[h]][taken.get(h, 0)])
        taken[h] = taken.get(h, 0) + 1
    return None if keys == list(range(len(keys))) else keys


def validate_levels(topo: Topology, wanted: Sequence[int]) -> None:
    """FTI's check at init: levels 2 and 3 configured need valid groups."""
    problem = topo.multilevel_ok()
    if problem and any(level in (2, 3) for level in wanted):
        raise ConfigError(f"L2/L3 checkpoints are configured but {problem}")


def worker_groups(nnodes: int, group_size: int) -> list[list[int]]:
    """Dask's groups: consecutive groups of ``group_size`` nodes; a lone leftover node joins the last group.

    FTI requires ``nnodes`` to be a multiple of ``group_size``; a Dask cluster's size is
    whatever it is, so a leftover of two or more nodes forms a smaller group of its own.
    These groups are written into every Dask commit record: the rule must never change.
    """
    if nnodes < 1 or group_size < 1:
        raise LevelError(f"cannot group {nnodes} nodes by {group_size}")
    size = min(group_size, nnodes)
    groups = [list(range(lo, min(lo + size, nnodes))) for lo in range(0, nnodes, size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


def recorded_topology(groups: Sequence[Sequence[int]], group_size: int = 0) -> Topology:
    """One rank per node (Dask's workers), in the given groups of ranks (a commit record's ``groups``).

    The ranks of the groups together must be 0..n-1, each once.
    """
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and g and all(type(r) is int for r in g) for g in groups):
        raise LevelError(f"groups {reprlib.repr(groups)} are not lists of ranks")  # a damaged record's
    ranks = sorted(r for g in groups for r in g)
    if ranks != list(range(len(ranks))) or not ranks:
        raise LevelError(f"groups {[list(g) for g in groups]} do not hold ranks 0..n-1 once each")
    n = len(ranks)
    return Topology(1, 0, group_size or max(len(g) for g in groups), tuple(range(n)), (0,) * n,
                    tuple(tuple(int(r) for r in g) for g in groups))


def worker_topology(nworkers: int, group_size: int) -> Topology:
    """The Dask backend's topology: worker ``i`` (sorted addresses) is rank ``i`` on node ``i``."""
    return recorded_topology(worker_groups(nworkers, group_size), group_size)
