"""A crash-consistency campaign of the Dask backend: its client or one of its workers SIGKILLed at any event of
ftidask's code, then a restart on a new cluster that must recover the newest COMMITTED checkpoint bit for bit (or
say there is nothing to recover), never hang, never trip on the leftovers, and leave no file once it has finalized.

The child (``_dask_crash_child.py``) starts its own LocalCluster and client, and kills at the n-th event of ftidask's
code (a call or a return of a Python function, or of a C function called from one), n drawn with a fixed seed from
a calibration run's count:

* the client process (its LocalCluster dies with it): during ``init``'s start and garbage collection, the
  checkpoints at levels 1-4 (and differential, incremental, asynchronous ones), their commit, the lineage cut, the
  retiring of older checkpoints, and ``finalize`` (keep_last_ckpt's flush to L4 too). Each case kills a run, then
  kills its restart (which recovers, checkpoints on and finalizes), then a last restart verifies and finalizes;
* a worker process (its nanny restarts it, the run goes on): its write, partner, parity and flush tasks, its removal
  thread, the channel handlers of its event loop, the garbage collection at init and a restart's checks and reads.
  A checkpoint it takes down fails and the previous one stays the newest; a recovery it takes down says so. Then a
  restart on a new cluster recovers the newest committed checkpoint.

The expected checkpoint is read from the disk after the kill: the newest commit record of the current run, unless
the run was marked finalized (``test_crash_campaign.expected``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from campaign import kept  # noqa: E402
from conftest import ROOT  # noqa: E402
from test_crash_campaign import assert_no_leftovers, expected  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(1800)]
CHILD = Path(__file__).with_name("_dask_crash_child.py")
HANG = 420  # seconds a child may take before the test calls it a hang (seconds unloaded; a loaded machine)
_counts: dict[str, tuple[int, int]] = {}  # (client events, worker events) of a whole unkilled run, per case

CASES = {
    # a short run at L3 and L2 (the default run's)
    "short": dict(mode="sync", levels=[3, 2], cfg=dict(group_size=3)),
    # every level once, in rotation, on 3 workers (one group: partner ring and Reed-Solomon)
    "levels": dict(mode="sync", levels=[1, 2, 3, 4], cfg=dict(group_size=3)),
    # asynchronous checkpoints, two in flight
    "async": dict(mode="async", levels=[2, 4, 3, 1], cfg=dict(group_size=3)),
    # differential checkpoints: spares, fallbacks
    "dcp": dict(mode="sync", levels=[5, 8, 6, 7], cfg=dict(group_size=3, enable_dcp=1, dcp_block_size=1024)),
    # incremental checkpoints
    "icp": dict(mode="icp", levels=[3, 1, 4], cfg=dict(group_size=3)),
    # finalize flushes the last checkpoint to L4 and keeps it
    "keep-last": dict(mode="sync", levels=[2, 1], cfg=dict(group_size=3, keep_last_ckpt=1)),
    # compressed containers, L4 archived at finalize
    "zstd-keep-l4": dict(mode="sync", levels=[4, 3], cfg=dict(group_size=3, compressor="zstd", keep_l4_ckpt=1)),
}


def child(root: Path, spec: dict, timeout: float = HANG) -> subprocess.CompletedProcess:
    """Run the child; past ``timeout`` its threads' stacks are dumped (SIGUSR1: faulthandler) and it is called a hang."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, str(CHILD), str(root), json.dumps(spec)]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"a hang: the child ran past {timeout} s ({spec})\nstdout: {out}\nstderr: {err[-8000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def lines(proc: subprocess.CompletedProcess, tag: str) -> list[list[str]]:
    return [w for w in (line.split() for line in proc.stdout.splitlines()) if w and w[0] == tag]


def check_recovery(proc: subprocess.CompletedProcess, want: int | None, where: str, may_fail: bool = False) -> None:
    """The run's recovery, if it got that far: exactly the newest committed checkpoint (``may_fail``: or an error
    that says the recovery failed, a worker having been killed in it)."""
    got = lines(proc, "R")
    if not got:
        return
    words = got[0]
    if may_fail and words[1] == "failed":
        return
    if want is None:
        assert words[1] == "none", f"{where}: recovered {words} with nothing committed\n{proc.stderr[-3000:]}"
        return
    assert words[1:3] == [str(want), "exact"], f"{where}: recovered {words}, want {want}\n{proc.stderr[-3000:]}"


def calibrate(key: str, root: Path, spec: dict) -> tuple[int, int]:
    if key not in _counts:
        proc = child(root / f"calibration-{key}", {**spec, "kill": 0, "wkill": 0})
        assert proc.returncode == 0, proc.stderr[-3000:]
        client_events, worker_events = (int(n) for n in lines(proc, "events")[0][1:3])
        assert client_events > 0 and worker_events > 0, proc.stdout
        _counts[key] = client_events, worker_events
    return _counts[key]


def last_restart(root: Path, spec: dict, where: str) -> None:
    """A restart that recovers the newest committed checkpoint, checkpoints once more and finalizes; then no file
    of the run is left but what finalize keeps."""
    want, _status = expected(root)
    proc = child(root, {**spec, "mode": "verify", "kill": 0, "finalize": True})
    where = f"{where}, the last restart (want {want})"
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    got = lines(proc, "R")
    assert got, f"{where}: no recovery\n{proc.stdout}"
    if want is None:
        assert got[0][1] == "none" and got[0][2].endswith("Error"), f"{where}: {got}"
    else:
        assert got[0][1:3] == [str(want), "exact"], f"{where}: {got}\n{proc.stderr[-3000:]}"
    assert not lines(proc, "F"), f"{where}: {proc.stdout}\n{proc.stderr[-3000:]}"
    if not spec["cfg"].get("keep_last_ckpt"):
        assert expected(root) == (None, 0), f"{where}: finalize left a run to restart"
    assert_no_leftovers(root, spec["cfg"], where)


def client_campaign(tmp_path: Path, name: str, seed: int, kills: int = 2, steps: int = 4) -> None:
    """The client killed at random events of a run, then of its restart; a last restart verifies."""
    spec = {"steps": steps, "finalize": True, "only_os": seed % 2 == 1, "nworkers": 3, **CASES[name]}
    total, _ = calibrate(f"{name}-{spec['only_os']}-{steps}", tmp_path, spec)
    rng = random.Random(f"dask-client-{name}-{seed}")
    root = tmp_path / "run"
    for crash in range(kills):
        want, _status = expected(root)
        nth = rng.randint(1, total)
        proc = child(root, {**spec, "kill": nth})
        where = f"{name} seed {seed}, client killed {crash + 1} at event {nth} of {total}"
        assert proc.returncode in (0, -9), f"{where}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        assert not lines(proc, "F"), f"{where}: {proc.stdout}\n{proc.stderr[-3000:]}"
        check_recovery(proc, want, where)
    last_restart(root, spec, f"{name} seed {seed}")


def worker_campaign(tmp_path: Path, name: str, seed: int, kills: int = 2, steps: int = 4) -> None:
    """A worker killed at a random event of a run, then of its restart (its recovery too); a last restart on a new
    cluster verifies."""
    spec = {"steps": steps, "finalize": True, "only_os": seed % 2 == 1, "nworkers": 3, **CASES[name]}
    _, total = calibrate(f"{name}-{spec['only_os']}-{steps}", tmp_path, spec)
    rng = random.Random(f"dask-worker-{name}-{seed}")
    root = tmp_path / "run"
    for crash in range(kills):
        want, _status = expected(root)
        nth, rank = rng.randint(1, total), rng.randrange(3)
        proc = child(root, {**spec, "wkill": nth, "wrank": rank})
        where = f"{name} seed {seed}, worker of rank {rank} killed {crash + 1} at event {nth} of {total}"
        assert proc.returncode in (0, 3), f"{where}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        check_recovery(proc, want, where, may_fail=True)
    last_restart(root, spec, f"{name} seed {seed}")


# The default run: one kill of each kind in a short run at L2 and L3 (a child starts a cluster: seconds each); the
# matrix below is slow.

def test_dask_client_killed_at_a_random_event(tmp_path):
    client_campaign(tmp_path, "short", seed=0, kills=1, steps=2)


def test_dask_worker_killed_at_a_random_event(tmp_path):
    worker_campaign(tmp_path, "short", seed=0, kills=1, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 7), 1))  # odd seeds: kills at calls of os functions only
@pytest.mark.parametrize("name", kept([n for n in CASES if n != "short"], ("dcp", "icp", "zstd-keep-l4")))
def test_dask_client_killed_at_random_events_many_seeds(tmp_path, name, seed):
    client_campaign(tmp_path, name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", kept(range(1, 7), 1))
@pytest.mark.parametrize("name", kept([n for n in CASES if n != "short"], ("async",)))
def test_dask_worker_killed_at_random_events_many_seeds(tmp_path, name, seed):
    worker_campaign(tmp_path, name, seed)


# --- a worker killed during a lineage cut: as it aliases a chunk under its new key, or once it has --------------------

LINEAGE_POINTS = ["ftidask.backends.dask.lineage:_alias", "ftidask.backends.dask.lineage:_alias:after"]


def lineage_campaign(tmp_path: Path, name: str, point: str, nth: int, rank: int) -> None:
    """The worker of ``rank`` killed at the ``nth`` call of ``point`` (a crash point of ``crashpoints``): the run goes
    on (its arrays, cut or not, give the next states exactly), then a restart on a new cluster recovers the newest
    committed checkpoint."""
    spec = {"steps": 4, "finalize": True, "nworkers": 3, **CASES[name]}
    root = tmp_path / "run"
    proc = child(root, {**spec, "wpoint": [point, nth], "wrank": rank, "kill": 0})
    where = f"{name}: worker of rank {rank} killed at call {nth} of {point}"
    assert proc.returncode in (0, 3), f"{where}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    before, after = lines(proc, "W")
    assert before[2:] != after[2:], f"{where}: no worker was killed: {proc.stdout}"
    last_restart(root, spec, where)


@pytest.mark.slow
@pytest.mark.parametrize("point", kept(LINEAGE_POINTS, 1))
@pytest.mark.parametrize("name,nth,rank", kept([("async", 1, 0), ("levels", 2, 1), ("dcp", 3, 2)], 1))
def test_dask_worker_killed_during_a_lineage_cut(tmp_path, name, point, nth, rank):
    lineage_campaign(tmp_path, name, point, nth, rank)
