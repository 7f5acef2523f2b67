"""The one topology model as pure functions: nodes, heads, groups, partners, validation, for MPI (FTI)
and Dask (workers) alike (no MPI or cluster needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftidask.levels.topology import (
    host_topology,
    hosts_by_node,
    local_topology,
    recorded_topology,
    reordered,
    validate_levels,
    worker_groups,
    worker_topology,
)
from ftidask.model.errors import ConfigError, LevelError


def test_local_test_nodes_of_consecutive_ranks() -> None:
    topo = local_topology(16, 4, 0, 4)
    assert topo.nnodes == 4 and len(topo.app_world) == 16
    assert [topo.node_of_app(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert topo.group_ranks(5) == [1, 5, 9, 13]  # position 1 on each node of the group
    assert topo.left_partner(9) == 5 and topo.left_partner(5) == 1
    assert topo.left_partner(1) == 13  # a ring


def test_one_rank_per_node_ring() -> None:
    topo = local_topology(4, 1, 0, 4)
    assert [topo.left_partner(r) for r in range(4)] == [3, 0, 1, 2]
    assert topo.group_ranks(2) == [0, 1, 2, 3]


def test_several_groups_stay_apart() -> None:
    topo = local_topology(8, 1, 0, 2)
    assert sorted({topo.group_of_node(n) for n in range(topo.nnodes)}) == [0, 1, 2, 3]
    assert topo.group_ranks(5) == [4, 5]
    assert topo.left_partner(5) == 4 and topo.left_partner(4) == 5
    assert topo.group_nodes(6) == [6, 7]


def test_heads_leave_the_application() -> None:
    topo = local_topology(16, 4, 1, 4)
    assert [w for w in range(16) if topo.is_head(w)] == [0, 4, 8, 12]
    assert topo.app_per_node == 3 and len(topo.app_world) == 12
    assert topo.app_world == (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15)
    assert topo.app_rank_at(2, 1) == 7  # world rank 10
    assert topo.group_ranks(7) == [1, 4, 7, 10]
    assert topo.is_head(12) and topo.node_of[12] == 3


def test_nodes_by_host_name() -> None:
    hosts = ["b", "a", "b", "a", "c", "c", "d", "d"]
    topo = host_topology(hosts, 2, 0, 2)
    assert topo.node_of == (0, 1, 0, 1, 2, 2, 3, 3)
    assert topo.local_of == (0, 0, 1, 1, 0, 1, 0, 1)
    assert topo.app_world == tuple(range(8))
    assert topo.group_ranks(2) == [2, 3]  # position 1 on nodes 0 (host b) and 1 (host a)
    with pytest.raises(ConfigError, match="node_size"):
        host_topology(["a", "a", "a", "b"], 2, 0, 2)


def test_group_ranks_by_position_on_host_nodes() -> None:
    topo = host_topology(["x", "y", "x", "y"], 2, 0, 2)
    # app ranks in world order: 0 (x,0) 1 (y,0) 2 (x,1) 3 (y,1)
    assert topo.group_ranks(2) == [2, 3] and topo.group_ranks(1) == [0, 1]


@pytest.mark.parametrize(("nprocs", "node_size", "head", "match"), [
    (6, 4, 0, "not a multiple of node_size"),
    (4, 1, 1, "head = 1 needs node_size >= 2"),
    (6, 4, 0, r"set node_size to the processes on each node \(1, 2, 3 or 6: a divisor of 6\)$"),
    # with a head the hint offered node_size 1, which head = 1 then refused; one process fits no node_size at all
    (3, 2, 1, r"\(3: a divisor of 3 of at least 2 with head = 1\)$"),
    (1, 2, 1, "head = 1 needs at least 2 processes per node, and this job has 1: run more processes, or set head = 0"),
])
def test_fti_validation(nprocs: int, node_size: int, head: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        local_topology(nprocs, node_size, head, 4)


def test_groups_must_be_whole_for_l2_l3() -> None:
    topo = local_topology(6, 1, 0, 4)
    assert "not a multiple of group_size" in topo.multilevel_ok()
    validate_levels(topo, [])  # L1/L4 only: fine
    with pytest.raises(ConfigError, match="L2/L3"):
        validate_levels(topo, [3])
    assert "group_size >= 2" in local_topology(4, 1, 0, 1).multilevel_ok()
    assert local_topology(4, 1, 0, 2).multilevel_ok() == ""


# --- the Dask backend's workers in the same model -------------------------------------------------
# Dask commit records list these groups and recovery reads them back: the literals pin what every
# checkpoint written so far holds (the rule of the former levels/ring_groups.make_groups).

def test_worker_groups_absorb_a_lone_leftover_worker() -> None:
    assert worker_groups(4, 4) == [[0, 1, 2, 3]]
    assert worker_groups(3, 4) == [[0, 1, 2]]
    assert worker_groups(5, 2) == [[0, 1], [2, 3, 4]]
    assert worker_groups(6, 4) == [[0, 1, 2, 3], [4, 5]]
    assert worker_topology(5, 2).rank_groups() == [[0, 1], [2, 3, 4]]
    with pytest.raises(LevelError):
        worker_groups(0, 4)


def test_worker_partner_ring_and_lone_worker() -> None:
    topo = worker_topology(4, 4)
    assert [topo.right_partner(r) for r in range(4)] == [1, 2, 3, 0]  # who keeps r's copy
    assert [topo.left_partner(r) for r in range(4)] == [3, 0, 1, 2]  # whose copy r keeps
    assert topo.multilevel_ok() == ""
    lone = worker_topology(1, 4)
    assert lone.group_ranks(0) == [0] and "fewer than 2" in lone.multilevel_ok()
    with pytest.raises(LevelError, match="at least 2 nodes"):
        lone.right_partner(0)


def test_ragged_worker_groups_keep_their_ring() -> None:
    topo = worker_topology(5, 2)
    assert topo.group_ranks(4) == [2, 3, 4] and topo.index_in_group(4) == 2
    assert topo.right_partner(4) == 2 and topo.left_partner(2) == 4 and topo.right_partner(1) == 0


def test_recorded_groups_rebuild_the_same_topology() -> None:
    groups = worker_topology(7, 3).rank_groups()
    assert groups == [[0, 1, 2], [3, 4, 5, 6]]
    topo = recorded_topology(groups)
    assert topo.rank_groups() == groups and topo.right_partner(6) == 3
    with pytest.raises(LevelError, match="ranks 0..n-1"):
        recorded_topology([[0, 1], [1, 2]])


def test_fti_groups_by_position_and_partners_invert() -> None:
    topo = local_topology(16, 4, 1, 2)  # 4 nodes of a head + 3 app ranks, groups of 2 nodes
    assert topo.rank_groups() == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert all(topo.left_partner(topo.right_partner(r)) == r for r in range(12))


def test_old_groups_of_a_dask_record_are_its_recorded_groups() -> None:
    """Resharding a Dask checkpoint rebuilds on the groups it was written with, leftover worker included."""
    from ftidask.engine.reshard_rebuild import old_groups
    from ftidask.engine.runstate import CommitRecord, FileRecord

    files = tuple(FileRecord(r, r, 8, "") for r in range(3))
    dask = CommitRecord(1, 1, 2, 0.0, 3, files, {"groups": worker_groups(3, 2)})
    assert old_groups(dask, 2) == [[0, 1, 2]]
    assert old_groups(CommitRecord(1, 1, 2, 0.0, 3, files), 2) == [[0, 1], [2]]  # MPI: by recorded nodes


@pytest.mark.parametrize("groups", ["x", [1], [[0, "a"]], [[0, True]], [[]]])
def test_recorded_groups_that_are_not_lists_of_ranks_are_a_level_error(groups):
    """A record's groups of the wrong types raised TypeError while they were sorted."""
    with pytest.raises(LevelError, match="groups"):
        recorded_topology(groups)


def test_layout_errors_say_what_to_set() -> None:
    """A node or group count that does not fit says which setting fits (before: only what did not fit)."""
    assert "set group_size to 2, 3 or 6 (a divisor of the 6 nodes), or run on a multiple of 4 nodes" in \
        local_topology(6, 1, 0, 4).multilevel_ok()
    assert "one node: L2 and L3 need 2 or more (on one machine: local_test = 1" in \
        local_topology(3, 3, 0, 4).multilevel_ok()
    assert "set group_size to 2 or more" in local_topology(4, 1, 0, 1).multilevel_ok()
    with pytest.raises(ConfigError, match=r"set node_size to the processes on each node \(1, 2, 3 or 6"):
        local_topology(6, 4, 0, 4)


# --- FTI_ReorderNodes: a restart on the same hosts in another order --------------------------------------------


def _renumbered(hostnames: list[str], keys: list[int] | None) -> list[str]:
    """The hosts by new world rank once each process took its key as its position."""
    return list(hostnames) if keys is None else [h for _k, h in sorted(zip(keys, hostnames))]


def _placement(hostnames: list[str]) -> tuple[list[str], list[int]]:
    """What a commit record keeps of a run on ``hostnames``: the host of each node id, the node of each world rank."""
    names = hosts_by_node(hostnames)
    return names, [names.index(h) for h in hostnames]


def test_hosts_in_another_order_get_their_node_ids_back() -> None:
    old = ["a", "a", "b", "b", "c", "c"]  # two processes a host, the first a head
    names = ["c", "c", "a", "a", "b", "b"]
    keys = reordered(*_placement(old), names)
    assert keys == [4, 5, 0, 1, 2, 3]
    topo = host_topology(_renumbered(names, keys), 2, 1, 3)
    assert _renumbered(names, keys) == old
    assert [topo.is_head(w) for w in range(6)] == [True, False] * 3  # each host's first process stays its head


def test_ranks_placed_in_turn_keep_their_placement() -> None:
    old = ["a", "b", "a", "b"]  # ranks 0 and 2 on a: numbered in blocks, rank 1 would land on a
    keys = reordered(*_placement(old), ["b", "a", "b", "a"])
    assert _renumbered(["b", "a", "b", "a"], keys) == old


def test_a_spare_host_takes_a_failed_hosts_places() -> None:
    # b failed; the spare x is listed first: a and c keep their places, x takes b's
    assert _renumbered(["x", "c", "a"], reordered(*_placement(["a", "b", "c"]), ["x", "c", "a"])) == ["a", "x", "c"]
    # two spares: the places of the hosts gone by node id, to the spares by order of first appearance
    assert _renumbered(["y", "x", "a"], reordered(*_placement(["a", "b", "c"]), ["y", "x", "a"])) == ["a", "y", "x"]


@pytest.mark.parametrize("old, names", [
    (["a", "b"], ["a", "b"]),  # the same order
    (["a", "b"], ["x", "b"]),  # a spare in the failed node's place already
    (["a", "b", "c"], ["b", "a"]),  # another number of processes: another layout, redistributed or refused
    (["a", "b", "b", "b"], ["a", "a", "b", "b"]),  # the hosts' shares differ from the record's
    (["a", "a", "b"], ["a", "b", "c"]),  # another number of nodes
])
def test_nothing_moves(old, names) -> None:
    assert reordered(*_placement(old), names) is None


def test_a_forged_placement_moves_nothing() -> None:
    assert reordered(["a", "a"], [0, 1], ["a", "b"]) is None  # a host named twice
    assert reordered(["a", "b"], [0, 5], ["b", "a"]) is None  # a node id out of range
    assert reordered(["b", "a"], [1, 0], ["b", "a"]) is None  # node ids not numbered as the hosts first appear


@given(st.permutations(list("abcdefgh")), st.integers(1, 3), st.sets(st.integers(0, 7), max_size=3),
       st.booleans(), st.randoms(use_true_random=False))
def test_every_process_goes_where_its_host_was(order, per_host, failed, in_turn, rnd) -> None:
    hosts = list("abcdefgh")
    old = [h for _ in range(per_host) for h in hosts] if in_turn else [h for h in hosts for _ in range(per_host)]
    spare = {h: f"spare{i}" for i, h in enumerate(order) if hosts.index(h) in failed}
    names = [spare.get(h, h) for h in old]
    rnd.shuffle(names)  # the job's processes in any order
    after = _renumbered(names, reordered(*_placement(old), names))
    assert sorted(after) == sorted(names)
    # each process where its host was; a spare where a failed host was, the same one for all of its processes
    assert all(a == o or (a.startswith("spare") and o in spare) for a, o in zip(after, old))
    assert len({(a, o) for a, o in zip(after, old)}) == len(set(after))
