"""The MPI crash campaign of test_crash_campaign.py with a node lost: restarts that rebuild from L2/L3 redundancy (or
redistribute on another number of ranks, or flush to L4 at a keep_last_ckpt finalize) SIGKILLed at any event.

A first job (4 ranks) writes asynchronous L2/L3 checkpoints (plain or differential) and one of its ranks is killed
at a random event; then, before each restart, the same node's files are lost (its node directory removed: one node
lost, again and again, as a node that keeps failing; two distinct nodes lost before a rebuild completes are beyond
L2/L3). Each restart recovers (rebuilding the lost files, on as many ranks or on others), checkpoints on, and one
of its ranks is killed at a random event: in the rebuild, the redistribution, its checkpoints, the retiring of
older ones or a keep_last_ckpt flush of a checkpoint of another layout. A last restart, the node lost once more,
recovers the newest COMMITTED checkpoint bit for bit, finalizes and leaves no file behind.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from campaign import kept
from mpi_util import need_mpi
from test_crash_campaign import check_last_restart, check_recovery, expected, mpi_job

DCP = dict(enable_dcp=1, dcp_block_size=4096)
STAGES = {  # key: (ranks, spec); the first letter of a key: "a"/"r"/"s" follow "a0", "d"/"k" follow "d0"
    "a0": (4, dict(mode="async", levels=[2, 3], steps=4, finalize=False, cfg=dict(max_inflight=3))),
    "d0": (4, dict(mode="async", levels=[6, 7], steps=4, finalize=False, cfg=dict(DCP, max_inflight=3))),
    "r1": (4, dict(mode="sync", levels=[3, 2], steps=2, finalize=False, cfg=dict())),
    "r2": (4, dict(mode="async", levels=[2, 3], steps=2, finalize=False,
                   cfg=dict(max_inflight=2, async_snapshot="copy"))),
    "s3": (3, dict(mode="sync", levels=[3, 2], steps=2, finalize=False, cfg=dict())),
    "a2": (2, dict(mode="async", levels=[2, 3], steps=2, finalize=False, cfg=dict(max_inflight=2))),
    "d3": (3, dict(mode="async", levels=[6, 7], steps=2, finalize=False, cfg=DCP)),
    "k2": (2, dict(mode="sync", levels=[6], steps=0, finalize=True, cfg=dict(DCP, keep_last_ckpt=1))),
    "k3": (3, dict(mode="icp", levels=[7, 6], steps=2, finalize=True, cfg=dict(DCP, keep_last_ckpt=1))),
    # differential L3 only: each parity patched from deltas exchanged in stripes of 256 KiB (about ten a checkpoint),
    # each member's delta past its first 256 KiB kept in a scratch file (files.XOR_IN_MEMORY), as a large one is
    "p0": (4, dict(mode="async", levels=[7], steps=4, finalize=False, stripe=256 << 10, xor_in_memory=256 << 10,
                   cfg=dict(DCP, max_inflight=3))),
    "p1": (4, dict(mode="sync", levels=[7], steps=3, finalize=False, stripe=256 << 10, xor_in_memory=256 << 10,
                   cfg=DCP)),
    "p2": (4, dict(mode="icp", levels=[7], steps=2, finalize=False, stripe=256 << 10, xor_in_memory=256 << 10,
                   cfg=DCP)),
}
PLANS = {  # (stages, ranks of the last restart)
    "rebuild-twice": (["a0", "r1", "r2"], 4),
    "reshard-killed": (["a0", "s3"], 2),
    "reshard-killed-twice": (["a0", "s3", "a2"], 4),
    "dcp-reshard": (["d0", "d3"], 4),
    "keep-last-reshard": (["d0", "k2"], 3),
    "keep-last-twice": (["d0", "k3", "k2"], 4),
    "l3-delta-lost": (["p0", "p1", "p2"], 4),
    "l3-delta-kept": (["p0", "p1", "p2"], 4),  # no node lost until the last restart: the patched parity rebuilds it
    "l3-exchange-lost": (["p0", "p1", "p2"], 4),
    "l3-exchange-kept": (["p0", "p1", "p2"], 4),
}
POINTS = {  # plans whose rank is killed in the parity's patch (at its n-th stripe of a member, or piece patched)
    "l3-exchange-lost": "ftidask.levels.rs_delta:_windows",
    "l3-exchange-kept": "ftidask.levels.rs_delta:gf_add_scaled",
}
KEPT_NODES = {"l3-delta-kept", "l3-exchange-kept"}  # plans whose restarts lose no node (but the last)
FIRST = {"d": "d0", "k": "d0", "p": "p0"}  # the stage a calibration of a stage starts from (by its first letter)
_counts: dict[tuple[str, bool], dict[int, int]] = {}  # (stage, only_os) -> rank -> events of an unkilled run


def lose(root: Path, node: int) -> None:
    shutil.rmtree(root / "L" / f"node{node}", ignore_errors=True)


def calibrate(tmp_path: Path, keys: list[str], only_os: bool) -> None:
    for key in keys:
        if (key, only_os) in _counts:
            continue
        base = tmp_path / f"calibration-{key}-{only_os}"
        first = FIRST.get(key[0], "a0")
        for k in (first, key) if key != first else (first,):
            ranks, spec = STAGES[k]
            if k != first:
                lose(base, 1)
            proc = mpi_job(ranks, base, {**spec, "only_os": only_os}, {})
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _counts[key, only_os] = {r: int((base / f"events-{r}").read_text()) for r in range(ranks)}


def rebuild_campaign(tmp_path: Path, plan: str, seed: int) -> None:
    stages, last_ranks = PLANS[plan]
    only_os = seed % 2 == 1
    calibrate(tmp_path, stages, only_os)
    rng = random.Random(f"rebuild-{plan}-{seed}")
    root = tmp_path / "run"
    node = rng.randrange(4)
    for i, key in enumerate(stages):
        ranks, spec = STAGES[key]
        want, _status = expected(root)
        victim = rng.randrange(ranks)
        nth = rng.randint(1, _counts[key, only_os][victim])
        if i and plan not in KEPT_NODES:
            lose(root, node)
        if plan in POINTS:  # about 36 stripes of members a patched checkpoint (4 members, 2.1 MiB of deltas each)
            nth = rng.randint(1, 100)
            spec = {**spec, "point": [victim, POINTS[plan], nth]}
        proc = mpi_job(ranks, root, {**spec, "only_os": only_os}, {} if plan in POINTS else {victim: nth})
        lost = "none" if plan in KEPT_NODES else node
        where = (f"{plan} seed {seed}, stage {key} ({ranks} ranks, node {lost} lost): rank {victim} killed at "
                 f"{POINTS.get(plan, 'event')} {nth}")
        if i:
            check_recovery(proc, want, where)
    want, _status = expected(root)
    lose(root, node)
    proc = mpi_job(last_ranks, root, dict(mode="verify", levels=[3, 2], cfg=dict()), {})
    check_last_restart(proc, root, want,
                       f"{plan} seed {seed}: the last restart on {last_ranks} ranks, node {node} lost (want {want})")


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(12), 1))
@pytest.mark.parametrize("plan", [pytest.param(p, marks=need_mpi()) for p in PLANS])
def test_mpi_node_lost_restarts_killed_at_random_events(tmp_path, plan, seed):
    rebuild_campaign(tmp_path, plan, seed)
