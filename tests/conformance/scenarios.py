"""The loss scenarios of the levels, written once as data, and what every backend's runner shares.

A scenario is a level, losses and the checkpoint a recovery must then return. Every run has 4 ranks,
one per node, in one group of 4 (FTI's topology with ``node_size = 1, group_size = 4``, and the Dask
backend's groups of 4 workers: the same ring, :mod:`ftidask.levels.topology`). A run writes:

* an *older* checkpoint (id 1, values of version 1) at L4, in the global directory that the losses of
  the node-local levels cannot reach, unless the scenario says there is none (and never for L4/L8: a
  newer L4 checkpoint retires the older ones, as in FTI);
* for a differential level (5-8), a first checkpoint (id 2, version 2) at that level, which the next
  one patches;
* the *latest* checkpoint (id 3, version 3) at the scenario's level.

The losses then hit the latest checkpoint's files only (or whole node directories, or the spare that
keeps a differential level's previous checkpoint), and recovery must give the latest checkpoint, the
previous one of a differential level (id 2, kept whole as the spare: docs/dcp.md), the older one, or
``NoCheckpointError`` with the arrays untouched: bit for bit, never a partial recovery.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from ftidask.levels.topology import worker_topology
from ftidask.storage.files import SPARE_DIR, spare_file

NRANKS = 4
LATEST, PREVIOUS, OLDER, NONE = "latest", "previous", "older", "none"
#: L2 copies and L3 groups: the same ring for every backend (rank r's copy is kept by node r+1).
TOPOLOGY = worker_topology(NRANKS, NRANKS)


@dataclasses.dataclass(frozen=True)
class Loss:
    """``what`` (rank, partner, parity: a file of the latest checkpoint; node: a node's whole directory;
    spare: the file of rank r that a differential level keeps of its previous checkpoint) of ``ranks``,
    erased or corrupted. A partner loss of rank r hits the copy of r's file (kept by r+1)."""

    what: str
    ranks: tuple[int, ...]
    how: str = "erase"


@dataclasses.dataclass(frozen=True)
class Scenario:
    level: int
    losses: tuple[Loss, ...]
    outcome: str  # LATEST, PREVIOUS (dCP only), OLDER or NONE (no older checkpoint is written: recovery must fail)

    @property
    def name(self) -> str:
        lost = "+".join(f"{x.how}-{x.what}{''.join(map(str, x.ranks))}" for x in self.losses) or "nothing"
        return f"L{self.level}-{lost}-{self.outcome}"

    @property
    def differential(self) -> bool:
        return self.level > 4

    def __post_init__(self) -> None:
        assert not (self.outcome == OLDER and self.level in (4, 8)), "L4/L8 keep no older checkpoint"
        assert self.outcome != PREVIOUS or self.differential, "only a differential level keeps its previous one"

    def versions(self) -> list[tuple[int, int]]:
        """(checkpoint id, level) in writing order; the id is also the values' version."""
        out = [] if self.outcome == NONE or self.level in (4, 8) else [(1, 4)]
        if self.differential:
            out.append((2, self.level))
        return [*out, (3, self.level)]

    @property
    def expected(self) -> tuple[int, int] | None:
        """The (id, level) a recovery returns, None for NoCheckpointError."""
        # a differential checkpoint is recovered as what it is on disk: its base level (L6 is L2 dCP)
        base = self.level - 4 * self.differential
        return {LATEST: (3, base), PREVIOUS: (2, base), OLDER: (1, 4), NONE: None}[self.outcome]


def _s(level: int, outcome: str, *losses: Loss) -> Scenario:
    return Scenario(level, losses, outcome)


rank0, rank0_bad, spare0 = Loss("rank", (0,)), Loss("rank", (0,), "corrupt"), Loss("spare", (0,))
node = lambda *n: Loss("node", n)  # noqa: E731 - a table's shorthand

#: Every scenario; one level per block. Whole-level rules: L1/L4 keep no copy, L2 loses a file when its
#: node and the next one are both lost, L3 rebuilds from any 4 of a group's 8 files.
SCENARIOS: list[Scenario] = [
    _s(1, OLDER, rank0), _s(1, OLDER, rank0_bad), _s(1, OLDER, node(0)), _s(1, NONE, rank0),
    _s(2, LATEST, rank0), _s(2, LATEST, rank0_bad), _s(2, LATEST, Loss("partner", (2,), "corrupt")),
    _s(2, OLDER, rank0, Loss("partner", (0,))), _s(2, NONE, rank0_bad, Loss("partner", (0,), "corrupt")),
    _s(2, LATEST, node(0)), _s(2, LATEST, node(0, 2)), _s(2, OLDER, node(0, 1)),
    _s(3, LATEST, rank0), _s(3, LATEST, rank0_bad), _s(3, LATEST, Loss("parity", (1,), "corrupt")),
    _s(3, LATEST, Loss("parity", (0,)), Loss("rank", (1,))), _s(3, LATEST, node(0)), _s(3, LATEST, node(0, 1)),
    _s(3, OLDER, node(0, 1, 2)), _s(3, NONE, node(1, 2, 3)),
    _s(4, NONE, rank0), _s(4, NONE, Loss("rank", (3,), "corrupt")), _s(4, LATEST, node(0, 1, 2, 3)),
    _s(5, PREVIOUS, rank0_bad), _s(5, PREVIOUS, Loss("rank", (3,))), _s(5, OLDER, rank0_bad, Loss("spare", (2,))),
    _s(5, NONE, node(2)),
    _s(6, LATEST, rank0), _s(6, LATEST, node(1)), _s(6, PREVIOUS, rank0, Loss("partner", (0,), "corrupt")),
    _s(6, OLDER, rank0, Loss("partner", (0,), "corrupt"), Loss("spare", (0,), "corrupt")),
    _s(7, LATEST, rank0_bad), _s(7, LATEST, node(0, 1)), _s(7, OLDER, node(0, 1, 3)), _s(7, NONE, node(0, 1, 3)),
    _s(8, PREVIOUS, rank0), _s(8, NONE, rank0, spare0), _s(8, LATEST, node(0, 1, 2, 3)),
    _s(8, NONE, rank0_bad, Loss("spare", (3,), "corrupt")),
]
BY_NAME = {s.name: s for s in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS), "two scenarios with one name"


def config(base: Path, scenario: Scenario) -> dict:
    """The run's config keys (each backend adds its own): small blocks, so files have several stripes."""
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"),
            "local_test": 1, "node_size": 1, "group_size": NRANKS, "block_size": 1, "transfer_size": 1,
            "enable_dcp": int(scenario.differential), "dcp_block_size": 512, "verbosity": 4}


def arrays(rank: int, version: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s arrays at a checkpoint's version: every version of the first differs only in a few
    blocks from the one before (a differential checkpoint writes little); sizes differ by rank."""
    a = np.random.default_rng(100 + rank).random(3000 + 1000 * rank)
    a[rank * 100: rank * 100 + 50] += version
    return a, np.arange(rank, rank + 33, dtype=np.int32) * version


# --- the losses, on disk --------------------------------------------------------------------------

def _latest_files(base: Path, pattern: str) -> list[Path]:
    return sorted(p for p in base.glob(f"*/**/ckpt3.s*/{pattern}") if p.is_file())


def damage(base: Path, scenario: Scenario) -> None:
    """Apply the scenario's losses under ``base``, checking that each one really happened on disk."""
    for loss in scenario.losses:
        for r in loss.ranks:
            if loss.what == "node":
                node_dir = base / "Local" / f"node{r}"
                # L4/L8 keep nothing on the nodes (their files are global): a lost node loses nothing of it
                assert node_dir.is_dir() or scenario.level in (4, 8), f"{node_dir} does not exist"
                shutil.rmtree(node_dir, ignore_errors=True)
                assert not node_dir.exists()
                continue
            if loss.what == "spare":
                found = sorted(base.glob(f"*/**/{SPARE_DIR}/{spare_file(r)}"))
                name = spare_file(r)
            else:
                name = {"rank": f"Ckpt3-Rank{r}.fti", "partner": f"Ckpt3-Pcof{TOPOLOGY.right_partner(r)}.fti",
                        "parity": f"Ckpt3-RSed{r}.fti"}[loss.what]
                found = _latest_files(base, name)
            assert found, f"{scenario.name}: no file {name} under {base}"
            for path in found:
                if loss.how == "erase":
                    path.unlink()
                    assert not path.exists()
                else:
                    _corrupt(path)


def _corrupt(path: Path) -> None:
    """Flip bytes in the data, in place: same size, different content."""
    before = path.read_bytes()
    raw = bytearray(before)
    for at in (len(raw) // 3, len(raw) // 2, len(raw) - 20):
        raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == len(before) and path.read_bytes() != before


# --- one rank's program, for the backends whose ranks run it (threads, MPI) --------------------------

def write_rank(ctx, rank: int, scenario: Scenario) -> None:
    a, b = (np.zeros_like(x) for x in arrays(rank, 0))
    ctx.protect(1, a)
    ctx.protect(2, b)
    for ckpt_id, level in scenario.versions():
        a[...], b[...] = arrays(rank, ckpt_id)
        ctx.checkpoint(ckpt_id, level)


def recover_rank(ctx, rank: int) -> dict:
    """What one rank's recovery gave: {"from": [id, level]} with its arrays checked bit for bit against
    that checkpoint's, or {"error": class name, "untouched": whether the arrays kept their values}."""
    a, b = (np.full_like(x, 7) for x in arrays(rank, 0))
    ctx.protect(1, a)
    ctx.protect(2, b)
    try:
        ctx.recover()
    except Exception as exc:  # noqa: BLE001 - reported; the test says which errors are right
        return {"error": type(exc).__name__, "message": str(exc)[:300], "untouched": bool((a == 7).all() and (b == 7).all())}
    version = ctx.recovered_from[0]
    want_a, want_b = arrays(rank, version)
    return {"from": list(ctx.recovered_from), "exact": a.tobytes() == want_a.tobytes() and b.tobytes() == want_b.tobytes()}


def check(scenario: Scenario, results: list[dict]) -> None:
    """Every rank's recovery is the scenario's: the same checkpoint, bit for bit, or the same clean error."""
    want = scenario.expected
    if want is None:
        assert {r.get("error") for r in results} == {"NoCheckpointError"}, results
        assert all(r["untouched"] for r in results), f"a failed recovery wrote into the arrays: {results}"
    else:
        assert [tuple(r.get("from", ())) for r in results] == [want] * len(results), results
        assert all(r["exact"] for r in results), f"recovered arrays differ from checkpoint {want}: {results}"
