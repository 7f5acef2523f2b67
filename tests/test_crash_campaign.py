"""A crash-consistency campaign: SIGKILL at any event of ftidask's code, then a restart that must recover the newest
COMMITTED checkpoint bit for bit (or say there is nothing to recover), never hang, never trip on the leftovers.

Unlike test_crash_random_time.py (killed after a timer) and the crash points of test_crash.py (one named call),
the child (``_crash_campaign_child.py``) kills itself at the n-th event of ftidask's code, in any thread: a call or
a return of a Python function, or of a C function (``os.replace``, ``os.fsync``) called from one; n is drawn
with a fixed seed from a calibration run's count. The expected checkpoint is read from the disk just after the
kill: the newest commit record (``{meta}/{exec_id}/commits/s*.json``) of the current run, unless the run was
marked finalized. Each case kills a run, then kills its restart (which recovers, checkpoints on and
finalizes: the second kill lands in the recovery, which moves verified pages under fresh arrays, in the
checkpoints, in the retiring of older ones, or in finalize), then a last restart verifies and goes on; once it
has finalized, no file of the run is left in the checkpoint directories. Also: restarts killed during their start and
recovery, staging with its mover (thread or process) killed, and 4 MPI ranks killed then restarted on 2
(``mpi_scripts/crash_campaign_job.py``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from campaign import kept
from conftest import ROOT
from mpi_util import SCRIPTS, env, mpiexec, need_mpi

from ftidask.storage.files import find_paths

CHILD = Path(__file__).with_name("_crash_campaign_child.py")
_counts: dict[str, int] = {}  # events of a whole unkilled run, per case (calibration)

CASES = {
    # async, several in flight, both snapshot mechanisms, differential levels
    "async-cow-dcp": dict(mode="async", levels=[5, 8, 1], cfg=dict(enable_dcp=1, dcp_block_size=4096,
                                                                   async_snapshot="cow", max_inflight=3)),
    "async-copy-dcp": dict(mode="async", levels=[8, 5, 4], cfg=dict(enable_dcp=1, dcp_block_size=4096,
                                                                    async_snapshot="copy", max_inflight=3)),
    # Zarr level 4, async and sync
    "async-zarr": dict(mode="async", levels=[4, 1], cfg=dict(l4_format="zarr", max_inflight=3)),
    "sync-zarr-dcp": dict(mode="sync", levels=[4, 8, 1], cfg=dict(l4_format="zarr", enable_dcp=1)),
    # incremental, killed between adds
    "icp-dcp": dict(mode="icp", levels=[5, 8], cfg=dict(enable_dcp=1, dcp_block_size=4096)),
    "icp-l1-l4": dict(mode="icp", levels=[1, 4, 1], cfg=dict(keep_l4_ckpt=1)),
    # finalize that keeps the last checkpoint, or archives L4
    "keep-last": dict(mode="sync", levels=[1, 4], cfg=dict(keep_last_ckpt=1)),
    "keep-l4-dcp": dict(mode="sync", levels=[8, 1], cfg=dict(keep_l4_ckpt=1, enable_dcp=1)),
}
DCP = dict(enable_dcp=1, dcp_block_size=4096)
MORE_CASES = {  # combinations: a retirement after a differential checkpoint, a finalize flushing it (keep_last_ckpt)
    "keep-last-dcp": dict(mode="sync", levels=[5, 8, 5], cfg=dict(DCP, keep_last_ckpt=1)),
    "keep-last-dcp-async": dict(mode="async", levels=[8, 5], cfg=dict(DCP, keep_last_ckpt=1, max_inflight=3)),
    "keep-last-icp-dcp": dict(mode="icp", levels=[5, 8], cfg=dict(DCP, keep_last_ckpt=1)),
    # Zarr level 4: written by a finalize (keep_last_ckpt), archived, written asynchronously beside dCP
    "zarr-keep-last": dict(mode="sync", levels=[1, 4], cfg=dict(l4_format="zarr", keep_last_ckpt=1)),
    "async-keep-last-zarr": dict(mode="async", levels=[4, 1], cfg=dict(l4_format="zarr", keep_last_ckpt=1,
                                                                        async_snapshot="copy", max_inflight=2)),
    "zarr-keep-l4-dcp": dict(mode="sync", levels=[8, 4, 1], cfg=dict(l4_format="zarr", keep_l4_ckpt=1, enable_dcp=1)),
    "async-zarr-dcp": dict(mode="async", levels=[8, 4], cfg=dict(l4_format="zarr", enable_dcp=1, max_inflight=3)),
}
CASES.update(MORE_CASES)
SMALL = 2000  # thousands of small variables beside the large ones: written in one local step, verified from runs
SMALL_CASES = {  # the arrays in use recovered again at the end of each run (rollback): compressed ones decoded in
    "many-l1-l4": dict(mode="sync", levels=[1, 4, 1], many=SMALL, rollback=1, cfg=dict()),
    "many-dcp": dict(mode="sync", levels=[5, 8, 5], many=SMALL, rollback=1, cfg=dict(DCP)),
    "many-async": dict(mode="async", levels=[1, 8, 4], many=SMALL, rollback=1, cfg=dict(DCP, max_inflight=3)),
    "many-icp": dict(mode="icp", levels=[1, 5, 4], many=SMALL, rollback=1, cfg=dict(DCP)),
    "many-keep-last": dict(mode="sync", levels=[8, 1, 5], many=SMALL, rollback=1, cfg=dict(DCP, keep_last_ckpt=1)),
    "zstd-rollback": dict(mode="sync", levels=[1, 4], compressor="zstd", rollback=1, cfg=dict()),
    "zstd-async-keep-last": dict(mode="async", levels=[4, 1], compressor="zstd", rollback=1,
                                 cfg=dict(max_inflight=2, keep_last_ckpt=1)),
    "many-zstd": dict(mode="sync", levels=[4, 1], many=500, compressor="zstd", rollback=1, cfg=dict()),
}
CASES.update(SMALL_CASES)


def expected(root: Path) -> tuple[int | None, int]:
    """(the id of the newest committed checkpoint a restart must recover, or None; the status it must see)."""
    meta = root / "M"
    current = meta / "current_exec_id"
    if not current.exists():
        return None, 0
    run = meta / json.loads(current.read_text())["exec_id"]
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
    records = []
    for path in (run / "commits").glob("s*.json"):
        raw = json.loads(path.read_text())
        records.append((int(raw["seq"]), int(raw["ckpt_id"])))
    if not records or (info.get("state") == "finalized" and not info.get("keep_last")):
        return None, 0
    return max(records)[1], 2 if info.get("state") == "finalized" else 1


def child(root: Path, spec: dict, kill: int, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(CHILD), str(root), json.dumps({**spec, "kill": kill})], env=env,
                          capture_output=True, text=True, timeout=timeout)


def lines(proc: subprocess.CompletedProcess, tag: str) -> list[list[str]]:
    return [w for w in (line.split() for line in proc.stdout.splitlines()) if w and w[0] == tag]


def check_recovery(proc: subprocess.CompletedProcess, want: int | None, where: str) -> None:
    """The run's recovery, if it got that far: exactly the newest committed checkpoint."""
    got = [w for w in lines(proc, "R") if len(w) >= 3]
    if not got:
        return
    words = got[0]
    if want is None:
        assert words[1] == "none", f"{where}: recovered {words} with nothing committed\n{proc.stderr[-3000:]}"
        return
    assert words[1:3] == [str(want), "exact"], f"{where}: recovered {words}, want {want}\n{proc.stderr[-3000:]}"


def check_rollback(proc: subprocess.CompletedProcess, where: str) -> None:
    """The run's recovery into its arrays in use, if it got that far: exactly its newest checkpoint."""
    back, done = lines(proc, "B"), lines(proc, "C")
    if back:
        assert done and back[0][1:3] == [done[-1][1], "exact"], f"{where}: rolled back {back[0]}, committed {done}"


def calibrate(name: str, spec: dict, root: Path) -> int:
    if name not in _counts:
        proc = child(root / "calibration", spec, 0)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _counts[name] = int(lines(proc, "events")[0][1])
    return _counts[name]


def campaign(tmp_path: Path, name: str, seed: int, kills: int = 2) -> None:
    spec = {"steps": 4, "finalize": True, "only_os": seed % 2 == 1, **CASES[name]}
    total = calibrate(f"{name}-{spec['only_os']}", spec, tmp_path)
    rng = random.Random(f"{name}-{seed}")
    root = tmp_path / "run"
    for crash in range(kills):
        want, _status = expected(root)
        nth = rng.randint(1, total)
        proc = child(root, spec, nth)
        where = f"{name} seed {seed}, kill {crash + 1} at event {nth} of {total}"
        assert proc.returncode in (0, -9), f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        if want is not None or crash:  # a restart: it recovers first
            check_recovery(proc, want, where)
        check_rollback(proc, where)
    want, status = expected(root)
    proc = child(root, {**spec, "mode": "verify"}, 0)
    where = f"{name} seed {seed}, the last restart (want {want})"
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    got = lines(proc, "R")
    assert got, f"{where}: no recovery\n{proc.stdout}"
    if want is None:
        assert got[0][1] == "none" and got[0][2].endswith("Error"), f"{where}: {got}"
    else:
        assert got[0][1:3] == [str(want), "exact"], f"{where}: {got}\n{proc.stderr[-3000:]}"
    check_rollback(proc, where)
    if not spec["cfg"].get("keep_last_ckpt"):
        assert expected(root) == (None, 0), f"{where}: finalize left a run to restart"
    assert_no_leftovers(root, spec["cfg"], where)


def assert_no_leftovers(root: Path, cfg: dict, where: str, outside: Path | None = None) -> None:
    """Once the last run is finalized, no file stays in the checkpoint directories but what finalize keeps: the
    last checkpoint (keep_last_ckpt) or the archived ones (keep_l4_ckpt), at level 4. Interrupted checkpoints'
    files are removed at the next start, whichever run it starts. ``outside``: a directory of the application's."""
    left = [p for d in ("L", "G") for p in find_paths(root / d, "*") if p.is_file() and outside not in p.parents]
    if cfg.get("keep_last_ckpt") or cfg.get("keep_l4_ckpt"):
        left = [p for p in left if not any(part in ("l4", "l4_archive") for part in p.relative_to(root).parts)]
    assert not left, f"{where}: left behind: {sorted(str(p.relative_to(root)) for p in left)}"


@pytest.mark.parametrize("name", ["async-cow-dcp", "async-zarr", "icp-dcp", "keep-l4-dcp"])  # the rest: slow
def test_killed_at_random_events(tmp_path, name):
    campaign(tmp_path, name, seed=0)


@pytest.mark.parametrize("name", ["sync-zarr-dcp"])
def test_killed_at_random_calls_of_os_functions(tmp_path, name):
    campaign(tmp_path, name, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(2, 14), 3))  # odd seeds: kills at calls of os functions only
@pytest.mark.parametrize("name", [n for n in CASES if n not in MORE_CASES and n not in SMALL_CASES])
def test_killed_at_random_events_many_seeds(tmp_path, name, seed):
    campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(2, 14), [2]))
@pytest.mark.parametrize("name", list(MORE_CASES))
def test_more_combinations_killed_at_random_events(tmp_path, name, seed):
    campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(2, 14), [2]))
@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_many_small_or_compressed_variables_killed_at_random_events(tmp_path, name, seed):
    campaign(tmp_path, name, seed)


# --- killed during the restart's recovery (verified pages moved under fresh arrays), again and again ---------------

RECOVER_CASES = {  # the newest checkpoint (4): differential at L4 (read block by block), or at L1 (its pages moved)
    "dcp-l4": dict(levels=[8, 4, 5, 1], cfg=dict(enable_dcp=1, dcp_block_size=4096)),
    "zarr-l4": dict(levels=[1, 4], cfg=dict(l4_format="zarr")),
    # the first run finalized: the last checkpoint kept at L4 (a differential one flushed, a Zarr store written)
    "keep-last-dcp": dict(levels=[5, 8, 5, 5], cfg=dict(DCP, keep_last_ckpt=1), finalize=True),
    "keep-last-zarr": dict(levels=[1, 4, 1, 1], cfg=dict(l4_format="zarr", keep_last_ckpt=1), finalize=True),
    # compressed (zstd): fresh arrays decoded into a few frames at a time; thousands of small variables
    "zstd-l1": dict(levels=[1], compressor="zstd", cfg=dict()),
    "zstd-l4": dict(levels=[4, 1], compressor="zstd", cfg=dict()),
    "many-zstd-l4": dict(levels=[4, 1], compressor="zstd", many=500, cfg=dict()),
    "many-dcp-l4": dict(levels=[8, 4, 5, 1], many=SMALL, cfg=dict(DCP)),
}


def recover_campaign(tmp_path: Path, name: str, seed: int, kills: int = 3) -> None:
    case = dict(RECOVER_CASES[name])
    first = dict(mode="sync", steps=4, finalize=case.pop("finalize", False), **case)
    root = tmp_path / "run"
    proc = child(root, first, 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, status = expected(root)
    assert want == 4
    spec = dict(mode="sync", steps=0, finalize=False, scope="recover", only_os=seed % 2 == 1, **case)
    calibration = child(root, spec, 0)
    if status == 2:  # finalized, kept: the calibration restarted the run; the kills restart the finalized one
        shutil.rmtree(root)
        assert child(root, first, 0).returncode == 0 and expected(root) == (want, status)
    check_recovery(calibration, want, f"{name}: an unkilled restart")
    if name == "zarr-l4":  # a whole L1 file: the recovery moves the verified pages under the fresh array
        assert int(lines(calibration, "P")[0][1]) > 0, "the recovery copied instead of moving pages"
    total = int(lines(calibration, "events")[0][1])
    rng = random.Random(f"recover-{name}-{seed}")
    for crash in range(kills):
        nth = rng.randint(1, total)
        proc = child(root, spec, nth)
        where = f"{name} seed {seed}: restart {crash + 1} killed at event {nth} of {total} (init to recovery)"
        assert proc.returncode in (0, -9), f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        check_recovery(proc, want, where)
        assert expected(root) in ((want, 1), (want, status)), where  # killed before the restart claimed the run
    proc = child(root, {**spec, "mode": "verify", "scope": "", "finalize": True}, 0)
    check_recovery(proc, want, f"{name} seed {seed}: the last restart")
    assert lines(proc, "R"), proc.stderr[-3000:]
    assert_no_leftovers(root, case["cfg"], f"{name} seed {seed}")


@pytest.mark.parametrize("name", ["dcp-l4"])  # zarr-l4: slow
def test_restarts_killed_during_their_recovery(tmp_path, name):
    recover_campaign(tmp_path, name, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 9), 4))
@pytest.mark.parametrize("name", ["dcp-l4", "zarr-l4"])
def test_restarts_killed_during_their_recovery_many_seeds(tmp_path, name, seed):
    recover_campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 9), [1]))
@pytest.mark.parametrize("name", ["keep-last-dcp", "keep-last-zarr"])
def test_restarts_of_a_run_finalized_with_keep_last_killed_during_their_recovery(tmp_path, name, seed):
    recover_campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 9), [1]))
@pytest.mark.parametrize("name", ["zstd-l1", "zstd-l4", "many-zstd-l4", "many-dcp-l4"])
def test_restarts_of_compressed_or_many_variables_killed_during_their_recovery(tmp_path, name, seed):
    recover_campaign(tmp_path, name, seed)


# --- over MPI: 4 ranks, asynchronous differential checkpoints; the restart on 2 ranks (redistributed) killed ------

MPI_STAGES = [  # (ranks, spec): each stage a restart of the one before, one of its ranks killed
    (4, dict(mode="async", levels=[5, 6, 7, 8], steps=4, finalize=False,
             cfg=dict(enable_dcp=1, dcp_block_size=4096, max_inflight=3))),
    (2, dict(mode="sync", levels=[6, 5, 8], steps=3, finalize=True, cfg=dict(enable_dcp=1, dcp_block_size=4096))),
    (2, dict(mode="async", levels=[8, 6], steps=3, finalize=True,
             cfg=dict(enable_dcp=1, dcp_block_size=4096, async_snapshot="copy", max_inflight=2))),
    (2, dict(mode="icp", levels=[6, 5, 8], steps=3, finalize=True, cfg=dict(enable_dcp=1, dcp_block_size=4096))),
]
_mpi_counts: dict[tuple[int, bool], dict[int, int]] = {}  # (stage, only_os) -> rank -> events of an unkilled run


def mpi_job(ranks: int, base: Path, spec: dict, kill: dict[int, int]) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPTS / "crash_campaign_job.py"), str(base),
           json.dumps({**spec, "kill": {str(r): n for r, n in kill.items()}})]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)


def mpi_calibrate(tmp_path: Path, only_os: bool) -> None:
    if (0, only_os) in _mpi_counts:
        return
    for i, (ranks, spec) in enumerate(MPI_STAGES):
        proc = mpi_job(ranks, tmp_path / f"calibration{i}", {**spec, "finalize": False, "only_os": only_os}, {})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _mpi_counts[i, only_os] = {r: int((tmp_path / f"calibration{i}" / f"events-{r}").read_text())
                                   for r in range(ranks)}


def mpi_campaign(tmp_path: Path, stages: list[int], seed: int) -> None:
    only_os = seed % 2 == 1
    mpi_calibrate(tmp_path, only_os)
    rng = random.Random(f"mpi-{stages}-{seed}")
    root = tmp_path / "run"
    for i, stage in enumerate(stages):
        ranks, spec = MPI_STAGES[stage]
        want, _status = expected(root)
        victim = rng.randrange(ranks)
        nth = rng.randint(1, _mpi_counts[stage, only_os][victim])
        proc = mpi_job(ranks, root, {**spec, "only_os": only_os}, {victim: nth})
        where = f"MPI stage {stage} ({ranks} ranks) seed {seed}: rank {victim} killed at event {nth}"
        if i:
            check_recovery(proc, want, where)
    want, _status = expected(root)
    proc = mpi_job(3, root, dict(mode="verify", levels=[5, 8], cfg=dict(enable_dcp=1, dcp_block_size=4096)), {})
    check_last_restart(proc, root, want, f"MPI {stages} seed {seed}: the last restart on 3 ranks (want {want})")


def check_last_restart(proc, root: Path, want, where: str) -> None:
    """The last, unkilled restart of an MPI campaign recovered ``want`` exactly (None: said there is nothing), then
    finalized, leaving no run to restart and nothing behind."""
    assert proc.returncode == 0, f"{where}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    got = lines(proc, "R")
    if want is None:
        assert got and got[0][1] == "none" and got[0][2].endswith("Error"), f"{where}: {got}"
    else:
        assert got and got[0][1:3] == [str(want), "exact"], f"{where}: {got}\n{proc.stderr[-3000:]}"
    assert expected(root) == (None, 0), f"{where}: finalize left a run to restart"
    assert_no_leftovers(root, {}, where)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(6), 3))
@pytest.mark.parametrize("stages", [pytest.param([0, 1], marks=need_mpi(), id="then-sync-on-2"),
                                    pytest.param([0, 2], marks=need_mpi(), id="then-async-on-2"),
                                    pytest.param([0, 3], marks=need_mpi(), id="then-icp-on-2")])
def test_mpi_killed_at_random_events_then_restarted_on_other_ranks(tmp_path, stages, seed):
    mpi_campaign(tmp_path, stages, seed)


# --- staging: the application killed anywhere while its mover (thread or process) copies; the restart stages again --

def stage_campaign(tmp_path: Path, mover: str, seed: int) -> None:
    from _crash_campaign_child import staged

    spec = dict(mode="sync", levels=[1], steps=1, stage=3, finalize=True, only_os=seed % 2 == 1,
                cfg=dict(enable_staging=1, exec_id="stagecamp", stage_mover=mover))
    total = calibrate(f"stage-{mover}-{spec['only_os']}", spec, tmp_path)
    rng = random.Random(f"stage-{mover}-{seed}")
    root = tmp_path / "run"
    out = root / "G" / "out"
    nth = rng.randint(1, total)
    proc = child(root, spec, nth)
    where = f"staging ({mover}) seed {seed}: killed at event {nth} of {total}"
    assert proc.returncode in (0, -9), f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    for k in range(3):  # published whole or not at all
        path = out / f"f{k}.bin"
        assert not path.exists() or path.read_bytes() == staged(k), f"{where}: {path.name} torn"
    want, _status = expected(root)
    proc = child(root, {**spec, "mode": "verify"}, 0)
    assert proc.returncode == 0, f"{where}, the restart: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    check_recovery(proc, want, where)
    assert all(w[2] == "0" for w in lines(proc, "S")), f"{where}: the restart's transfers: {lines(proc, 'S')}"
    assert sorted(p.name for p in out.iterdir()) == ["f0.bin", "f1.bin", "f2.bin"], f"{where}: leftovers"
    for k in range(3):
        assert (out / f"f{k}.bin").read_bytes() == staged(k), f"{where}: f{k}.bin"
    assert_no_leftovers(root, {}, where, outside=out)


@pytest.mark.parametrize("mover", ["thread"])  # process: slow
def test_staging_killed_at_a_random_event_then_staged_again(tmp_path, mover):
    stage_campaign(tmp_path, mover, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 16), 6))  # the others: -m campaign (CI's budget)
@pytest.mark.parametrize("mover", ["thread", "process"])
def test_staging_killed_at_random_events_many_seeds(tmp_path, mover, seed):
    stage_campaign(tmp_path, mover, seed)
