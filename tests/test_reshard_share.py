"""Who hashes a container that several ranks of a redistribution need (ftidask.engine.reshard_read): one of them,
chosen alike on every rank; and the agreement's verdict when a rank read another version of a file than its verifier
hashed. The MPI runs are in test_mpi_reshard_share.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ftidask.engine.reshard_read import trusted, verdict, verifiers

#: per rank: [old, block, container, size, bytes needed]
needs_st = st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 2),
                                       st.integers(1, 1 << 20), st.integers(0, 1 << 20)), max_size=6),
                    min_size=1, max_size=6)


def normalised(needs: list) -> list:
    """One size per container, bytes needed at most its size, each container once per rank."""
    sizes: dict = {}
    out = []
    for mine in needs:
        seen, rows = set(), []
        for old, bi, ci, size, n in mine:
            size = sizes.setdefault((old, bi, ci), size)
            if (old, bi, ci) not in seen:
                seen.add((old, bi, ci))
                rows.append([old, bi, ci, size, min(n, size)])
        out.append(rows)
    return out


@settings(max_examples=200, deadline=None)
@given(needs_st)
def test_every_shared_container_has_one_verifier_that_needs_it(raw: list) -> None:
    needs = normalised(raw)
    owners = verifiers(needs)
    readers: dict = {}
    for rank, mine in enumerate(needs):
        for old, bi, ci, size, n in mine:
            readers.setdefault((old, bi, ci), {})[rank] = (size, n)
    assert set(owners) == {k for k, r in readers.items() if len(r) > 1}
    for key, owner in owners.items():
        size, n = readers[key][owner]
        whole = [r for r, (s, m) in readers[key].items() if m == s]
        if whole:
            assert owner in whole  # it reads all of it anyway
        else:
            assert n == max(m for _s, m in readers[key].values())
    # every rank trusts exactly the shared containers it needs and does not verify
    for rank, mine in enumerate(needs):
        trust = trusted(rank, owners, mine)
        got = {(old, bi, ci) for old, keys in trust.items() for bi, ci in keys}
        assert got == {(o, b, c) for o, b, c, _s, _n in mine if owners.get((o, b, c), rank) != rank}
    # JSON round trip (the MPI transport's allgather): lists, the same verdict
    assert verifiers([[list(map(int, row)) for row in mine] for mine in needs]) == owners


def test_the_work_is_spread_over_ties() -> None:
    # Three ranks each need a third of two containers (columns of two old files): not one rank for both.
    needs = [[[0, 0, 0, 90, 30], [1, 0, 0, 90, 30]] for _ in range(3)]
    owners = verifiers(needs)
    assert len(set(owners.values())) == 2


def test_split_two_onto_three() -> None:
    # old 0 [0, 6): new 0 takes 4, new 1 takes 2; old 1 [6, 12): new 1 takes 2, new 2 takes 4
    needs = [[[0, 0, 0, 6, 4]], [[0, 0, 0, 6, 2], [1, 0, 0, 6, 2]], [[1, 0, 0, 6, 4]]]
    owners = verifiers(needs)
    assert owners == {(0, 0, 0): 0, (1, 0, 0): 2}
    assert trusted(1, owners, needs[1]) == {0: frozenset({(0, 0)}), 1: frozenset({(0, 0)})}
    assert trusted(0, owners, needs[0]) == {}


def test_verdict_names_the_first_problem_then_the_containers_read_from_another_version() -> None:
    needs = [[[0, 0, 0, 6, 4]], [[0, 0, 0, 6, 2]]]
    owners = verifiers(needs)
    same = [0, 2049, 11, 4096, 5, 6]  # old rank, device, inode, size, mtime_ns, ctime_ns
    assert verdict([["", [same]], ["", [same]]], owners, needs) == ("", {})
    assert verdict([["", [same]], ["disk gone", [same]]], owners, needs) == ("rank 1: disk gone", {})
    assert verdict([["a", []], ["b", []]], owners, needs) == ("rank 0 (and 1 other rank(s)): a", {})
    for k in range(1, 6):  # any field: the trusting rank hashes its own (the verifier has nothing to redo)
        changed = list(same)
        changed[k] += 1
        assert verdict([["", [same]], ["", [changed]]], owners, needs) == ("", {1: [(0, 0, 0)]})
    # a rank that shares nothing is never compared
    assert verdict([["", [same]], ["", [[0, 99, 1, 1, 1, 1]]]], {}, [[], []]) == ("", {})
