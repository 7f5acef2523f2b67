"""The crash-consistency campaign of test_crash_campaign.py, with heads (``head = 1``, ``inline_lN = 0``): an
application rank, a head, or both SIGKILLed at the n-th event of ftidask's code (n drawn with a fixed seed from a
calibration run's count of that process), while the heads raise L1 checkpoints to L2, L3 (also differential L3,
whose parity the heads update from the files' differences: ``head_parity``), L4, and while they stage the
application's files. Then the whole job is started again (mpiexec, the same directories), killed again, and a last
restart must recover the newest COMMITTED checkpoint bit for bit: with heads, a checkpoint is committed once the
application wrote its L1 commit record; its head rewrites that record at the raised level (the raise's commit point)
and removes the L1 files after it, so the newest record, at whichever level, is what a restart recovers. No job may
hang (mpiexec's timeout), a staged file is published whole or not at all and the restart stages the rest, and once
the last job has finalized no file of the run is left. Jobs: ``mpi_scripts/heads_crash_job.py``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from campaign import kept
from mpi_util import SCRIPTS, env, mpiexec, need_mpi
from test_crash_campaign import assert_no_leftovers, check_recovery, expected, lines

pytestmark = need_mpi()

_HEADS = dict(inline_l2=0, inline_l3=0, inline_l4=0)
TWO_NODES = dict(node_size=2, group_size=2, **_HEADS)  # 4 processes: 2 nodes of a head and an application rank
CASES = {  # name -> (processes, spec)
    # differential L3 (the heads update the parity), L2_DCP, L4_DCP, L2, L4, L3
    "dcp": (4, dict(mode="sync", levels=[7, 7, 7, 6, 8, 4, 2, 3], cfg=dict(enable_dcp=1, dcp_block_size=4096,
                                                                            **TWO_NODES))),
    "plain": (4, dict(mode="sync", levels=[3, 2, 4, 3], cfg=TWO_NODES)),
    # the application writes L1 in the background while its head raises the checkpoint before
    "async": (4, dict(mode="async", levels=[3, 4, 2], cfg=TWO_NODES)),
    # asynchronous differential checkpoints, raised by the heads
    "async-dcp": (4, dict(mode="async", levels=[7, 8, 6, 7], cfg=dict(enable_dcp=1, dcp_block_size=4096,
                                                                       **TWO_NODES))),
    # finalize flushes the last checkpoint to L4 (its head may still raise it) and archives the L4 ones
    "keep": (4, dict(mode="sync", levels=[3, 4, 2], cfg=dict(keep_last_ckpt=1, keep_l4_ckpt=1, **TWO_NODES))),
    # the heads stage the application's files between their post-processing
    "stage": (4, dict(mode="sync", levels=[3, 4], stage=3, cfg=dict(enable_staging=1, **TWO_NODES))),
    # 4 nodes of a head and two application ranks, one group of 4: a head serves two ranks' files
    "dcp-12": (12, dict(mode="sync", levels=[7, 7, 8, 2], cfg=dict(enable_dcp=1, dcp_block_size=4096,
                                                                    node_size=3, group_size=4, **_HEADS))),
}
_counts: dict[tuple[str, bool], dict[int, int]] = {}  # (case, only_os) -> world rank -> events of an unkilled run


def job(nprocs: int, base: Path, spec: dict, kill: dict[int, int], timeout: float = 180) -> subprocess.CompletedProcess:
    """One job; a hang fails the test at ``timeout`` (subprocess.TimeoutExpired)."""
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, str(SCRIPTS / "heads_crash_job.py"), str(base),
           json.dumps({**spec, "kill": {str(w): n for w, n in kill.items()}})]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def heads(nprocs: int, spec: dict) -> list[int]:
    size = spec["cfg"]["node_size"]
    return list(range(0, nprocs, size))


def calibrate(tmp_path: Path, name: str, only_os: bool, steps: int) -> dict[int, int]:
    if (name, only_os) not in _counts:
        nprocs, spec = CASES[name]
        base = tmp_path / f"calibration-{only_os}"
        proc = job(nprocs, base, {**spec, "steps": steps, "finalize": True, "only_os": only_os}, {})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _counts[name, only_os] = {w: int((base / f"events-{w}").read_text()) for w in range(nprocs)}
    return _counts[name, only_os]


def victims(rng: random.Random, nprocs: int, spec: dict, counts: dict[int, int]) -> dict[int, int]:
    """A head, an application rank, or one of each, each killed at a random event of its own."""
    hs = heads(nprocs, spec)
    apps = [w for w in range(nprocs) if w not in hs]
    who = rng.choice(["head", "app", "both"])
    chosen = ([rng.choice(hs)] if who != "app" else []) + ([rng.choice(apps)] if who != "head" else [])
    return {w: rng.randint(1, counts[w]) for w in chosen}


def staged(rank: int, k: int) -> bytes:
    """heads_crash_job.staged (that script imports mpi4py.MPI, which initializes MPI in this process)."""
    return np.random.default_rng(5000 + 10 * rank + k).bytes((1 << 20) + 4096 * k + 17)


def staged_whole(root: Path, nprocs: int, spec: dict, where: str, final: bool = False) -> None:
    """Every staged file is whole or absent (published atomically); at the end, every one is there."""
    out = root / "G" / "out"
    napp = nprocs - len(heads(nprocs, spec))
    names = {f"r{r}-f{k}.bin" for r in range(napp) for k in range(spec.get("stage", 0))}
    present = {p.name for p in out.iterdir()} if out.is_dir() else set()
    assert present <= names or not final, f"{where}: stray files in {out}: {sorted(present - names)}"
    for name in present & names:
        rank, k = (int(x[1:]) for x in name[:-4].split("-"))
        assert (out / name).read_bytes() == staged(rank, k), f"{where}: {name} torn"
    if final:
        assert present == names, f"{where}: not staged: {sorted(names - present)}"


def campaign(tmp_path: Path, name: str, seed: int, kills: int = 2, steps: int = 4) -> None:
    nprocs, spec = CASES[name]
    only_os = seed % 2 == 1
    spec = {**spec, "steps": steps, "finalize": True, "only_os": only_os}
    counts = calibrate(tmp_path, name, only_os, steps)
    rng = random.Random(f"heads-{name}-{seed}")
    root = tmp_path / "run"
    for crash in range(kills):
        want, _status = expected(root)
        kill = victims(rng, nprocs, spec, counts)
        where = f"{name} seed {seed}, job {crash + 1}: killed {kill} (world rank: event)"
        proc = job(nprocs, root, spec, kill)
        if want is not None or crash:  # a restart: it recovers first
            check_recovery(proc, want, where)
        if spec.get("stage"):
            staged_whole(root, nprocs, spec, where)
    want, _status = expected(root)
    proc = job(nprocs, root, {**spec, "mode": "verify"}, {})
    where = f"{name} seed {seed}, the last restart (want {want})"
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    got = lines(proc, "R")
    assert got, f"{where}: no recovery\n{proc.stdout}"
    if want is None:
        assert got[0][1] == "none" and got[0][2].endswith("Error"), f"{where}: {got}"
    else:
        assert got[0][1:3] == [str(want), "exact"], f"{where}: {got}\n{proc.stderr[-3000:]}"
    if spec["cfg"].get("keep_last_ckpt"):
        assert expected(root) == ((want or 0) + 1, 2), f"{where}: its checkpoint not kept"
    else:
        assert expected(root) == (None, 0), f"{where}: finalize left a run to restart"
    if spec.get("stage"):
        staged_whole(root, nprocs, spec, where, final=True)
        assert all(w[3] == "0" for w in lines(proc, "S")), f"{where}: the restart's transfers: {lines(proc, 'S')}"
    assert_no_leftovers(root, spec["cfg"], where, outside=root / "G" / "out")


@pytest.mark.parametrize("name", ["dcp"])  # the rest: slow
def test_heads_killed_at_random_events(tmp_path, name):
    campaign(tmp_path, name, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 9), 2))  # odd seeds: kills at calls of os functions only
@pytest.mark.parametrize("name", ["dcp", "plain", "async", "async-dcp", "keep", "stage"])
def test_heads_killed_at_random_events_many_seeds(tmp_path, name, seed):
    campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(2), 1))
def test_heads_serving_two_ranks_killed_at_random_events(tmp_path, seed):
    campaign(tmp_path, "dcp-12", seed)


def test_head_killed_while_it_stages_leaves_no_temporary_file(tmp_path):
    """A head SIGKILLed in a transfer (its temporary file written, not yet published) takes the job down; nothing
    outlives it to remove the temporary file at the destination, so the application notes the transfers it hands
    to its head, as a mover thread does, and the restart of the run removes what they left (it was left forever)."""
    nprocs, spec = CASES["stage"]
    spec = {**spec, "steps": 2, "finalize": True, "point": [0, "ftidask.staging.copy:_publish", 2]}
    root = tmp_path / "run"
    proc = job(nprocs, root, spec, {})
    assert proc.returncode != 0, proc.stdout  # the crash point was reached: the job was torn down
    assert list((root / "G" / "out").glob(".*.tmp")), "the head died before its temporary file was written"
    want, _status = expected(root)  # 1 or 2: checkpoint 2 races the head's transfers (the kill takes the job down)
    assert want in (1, 2), want
    proc = job(nprocs, root, {**spec, "mode": "verify", "point": None}, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_recovery(proc, want, "the restart")
    staged_whole(root, nprocs, spec, "the restart", final=True)
    assert_no_leftovers(root, spec["cfg"], "the restart", outside=root / "G" / "out")


def test_an_application_that_dies_of_an_uncaught_error_does_not_hang_its_heads(tmp_path):
    """The application ranks end with an uncaught exception (no finalize) while their heads wait for requests: the
    job ends (the heads waited for good: mpiexec hung until its timeout) and a restart recovers the newest
    checkpoint, raised by the heads."""
    nprocs, spec = CASES["plain"]
    root = tmp_path / "run"
    proc = job(nprocs, root, {**spec, "steps": 2, "error": True}, {}, timeout=90)
    assert proc.returncode != 0 and "the application failed" in proc.stderr, proc.stderr[-3000:]
    proc = job(nprocs, root, {**spec, "mode": "verify"}, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines(proc, "R")[0][1:5] == ["2", "exact", "2", str(spec["levels"][2 % len(spec["levels"])])]
    assert_no_leftovers(root, spec["cfg"], "the restart")


# Crash points in the heads' own steps (the head of node 0, world rank 0, the heads' root) while they raise the
# "dcp" case's checkpoints: 1 to L3 (encoded in full), 2 to L3 from the differences, 3 to L2, 4 to L4.
HEAD_POINTS = [
    "ftidask.backends.mpi.head_parity:_prepare@1",  # checkpoint 2: the previous parity copied to the spare
    "ftidask.levels.rs_delta:patch_parity@1",  # ... the spare patched with the group's deltas
    "ftidask.levels.rs_delta:update:after@1",  # ... patched, before the raised commit record
    "ftidask.engine.runstate:RunState.write_record:after@2",  # checkpoint 2 at L3, its L1 files still there
    "ftidask.backends.mpi.heads:_keep_as_spares@2",  # checkpoint 2's L1 files on their way to the spares
    "ftidask.backends.mpi.heads:write_spare_hint@1",
    "ftidask.engine.runstate:RunState.note_retired@1",  # checkpoint 1 retired by 2: its files kept as the spares
    "ftidask.backends.mpi.heads:_keep_as_fallback@1",
    "ftidask.engine.runstate:RunState.delete_record@1",
    "ftidask.storage.files:copy_file_atomic@3",  # checkpoint 4 copied to the global directory
    "ftidask.storage.files:remove_tree@2",
]


@pytest.mark.slow
@pytest.mark.parametrize("point", HEAD_POINTS)
def test_head_killed_at_its_steps_then_restarted(tmp_path, point):
    """The heads' root SIGKILLed at each step of its raising and retiring: the restart recovers the newest committed
    checkpoint bit for bit, goes on, and leaves nothing once finalized."""
    nprocs, spec = CASES["dcp"]
    where, _, nth = point.rpartition("@")
    spec = {**spec, "steps": 4, "finalize": True}
    root = tmp_path / "run"
    proc = job(nprocs, root, {**spec, "point": [0, where, int(nth)]}, {})
    assert proc.returncode != 0, f"{point}: never reached\n{proc.stdout[-2000:]}"
    want, _status = expected(root)
    proc = job(nprocs, root, {**spec, "finalize": False}, {})  # the restart goes on, its checkpoints left
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_recovery(proc, want, point)
    proc = job(nprocs, root, {**spec, "mode": "verify"}, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines(proc, "R")[0][1:3] == [str((want or 0) + 4), "exact"], lines(proc, "R")
    assert_no_leftovers(root, spec["cfg"], point)


@pytest.mark.parametrize("keep", ["archived", pytest.param("kept-last", marks=pytest.mark.slow)])
def test_l1_files_a_killed_head_left_under_an_l4_checkpoint_go_at_finalize(tmp_path, keep):
    """A head killed once checkpoint 1 is raised to L4 (its record written) but before it removed its node's L1 files:
    the restart recovers checkpoint 1 from L4. Its finalize archives it (keep_l4_ckpt) or keeps it where it is, the
    newest (keep_last_ckpt): the L1 files under it stayed on the node for good (the commit record named their
    directory until the end, and the archive or the kept checkpoint left it there)."""
    nprocs, spec = CASES["plain"]
    cfg = {**spec["cfg"], **({"keep_l4_ckpt": 1} if keep == "archived" else {"keep_last_ckpt": 1})}
    spec = {**spec, "levels": [3, 4, 2], "cfg": cfg, "steps": 1, "finalize": False}  # checkpoint 1 at L4
    root = tmp_path / "run"
    proc = job(nprocs, root, {**spec, "point": [2, "ftidask.storage.files:remove_tree", 1]}, {})
    assert proc.returncode != 0, proc.stdout
    assert expected(root) == (1, 1) and list(root.glob("L/node1/*/l1/ckpt1.*/*.fti")), "killed elsewhere"
    # archived: checkpoint 2 (L2) is flushed to L4 and kept, checkpoint 1 archived; kept: no checkpoint, 1 kept
    proc = job(nprocs, root, {**spec, "mode": "verify" if keep == "archived" else "sync", "steps": 0,
                              "finalize": True}, {})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines(proc, "R")[0][1:5] == ["1", "exact", "1", "4"], lines(proc, "R")
    assert_no_leftovers(root, cfg, keep)
