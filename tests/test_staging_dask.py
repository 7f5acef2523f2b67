"""Staging on a real Dask LocalCluster: each transfer is a task on the worker that holds the file."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask import SI_ACTV, SI_FAIL, SI_NINI, SI_PEND, SI_SCES  # noqa: E402
from ftidask.backends.dask import fence  # noqa: E402
from ftidask.backends.dask.staging import DaskMover, worker_by_node_dir  # noqa: E402
from ftidask.staging.stager import Stager  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # also on the workers' path (the nanny passes it on)
import slowcopy  # noqa: E402

pytestmark = pytest.mark.dask
MiB = 1 << 20


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster of 2 worker processes (conftest.py)


@pytest.fixture
def slow_workers(client):
    """Slow each piece the module's workers copy by ``delay`` seconds, and hold it until the file ``gate`` exists if
    one is named (undone after the test)."""
    yield lambda delay, gate=None: client.run(slowcopy.install, delay, gate)
    client.run(slowcopy.uninstall)


def worker_stager(tmp_path: Path, client):
    """A stager whose stage dir has one ``node{k}`` directory per worker k (its node-local disk)."""
    workers = sorted(client.scheduler_info()["workers"])
    stage = tmp_path / "local" / "stage"
    for i in range(len(workers)):
        (stage / f"node{i}").mkdir(parents=True, exist_ok=True)
    (tmp_path / "global").mkdir(exist_ok=True)
    mover = DaskMover(client, worker_by_node_dir(lambda: workers))
    return Stager(stage, tmp_path / "global", mover), workers, mover


def test_many_files_each_on_its_worker(tmp_path, client):
    stager, workers, _ = worker_stager(tmp_path, client)
    expected, ids = {}, {}
    for i in range(60):
        data = os.urandom([0, 10, 5000, 300_000][i % 4])
        src = stager.stage_dir / f"node{i % 2}" / f"f{i}"
        src.write_bytes(data)
        expected[f"f{i}"] = data
        ids[f"f{i}"] = stager.send(src, f"out/f{i}")
    states = stager.wait(timeout=120)
    assert set(states.values()) == {SI_SCES}
    for name, req in ids.items():
        assert stager.table.query(req) == SI_SCES and stager.table.query(req) == SI_NINI
        assert (tmp_path / "global" / "out" / name).read_bytes() == expected[name]
    assert not any(p.is_file() for p in find_paths(stager.stage_dir, "*"))
    assert stager.close(30) == []


def test_state_sequence_on_dask(tmp_path, client, slow_workers):
    active = tmp_path / "seen-active"  # the copy held after its first piece until the test has seen it active
    slow_workers(0.2, str(active))  # (a delay alone, 0.6 s in all, could pass unseen on a loaded machine)
    stager, workers, _ = worker_stager(tmp_path, client)
    src = stager.stage_dir / "node0" / "big"
    src.write_bytes(os.urandom(24 * MiB))
    gate = tmp_path / "gate"  # node0's worker kept busy: the transfer stays queued until the test has seen it so
    holder = client.submit(slowcopy.hold, str(gate), workers=[workers[0]], allow_other_workers=False, pure=False)
    req = stager.send(src, "big")
    assert stager.table.query(req) == SI_PEND
    gate.touch()
    holder.result(timeout=60)
    seen = [SI_PEND]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = stager.table.query(req)
        if not seen or seen[-1] != state:
            seen.append(state)
        if state == SI_ACTV:
            active.touch()
        if state in (SI_SCES, SI_FAIL):
            break
        time.sleep(0.002)
    assert seen == [SI_PEND, SI_ACTV, SI_SCES]
    assert stager.table.query(req) == SI_NINI
    stager.close(30)


@pytest.mark.slow
def test_256_mib_on_a_worker(tmp_path, client):
    stager, _, _ = worker_stager(tmp_path, client)
    src = stager.stage_dir / "node1" / "big"
    hasher = xxhash.xxh3_128()
    with open(src, "wb") as fh:
        for _ in range(16):
            block = os.urandom(16 * MiB)
            hasher.update(block)
            fh.write(block)
    req = stager.send(src, "big")
    assert stager.wait(req, 300) == SI_SCES
    with open(tmp_path / "global" / "big", "rb") as fh:
        check = xxhash.xxh3_128()
        while chunk := fh.read(16 * MiB):
            check.update(chunk)
    assert check.hexdigest() == hasher.hexdigest() and not src.exists()
    stager.close(30)


def _open_once_cancelled(mover: DaskMover, gate: Path) -> None:
    """Create ``gate`` once the mover's finalize has set its cancel event (at most 120 s)."""
    deadline = time.monotonic() + 120
    while not mover._cancel.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.touch()


def test_finalize_timeout_cancels_running_task(tmp_path, client, slow_workers):
    gate = tmp_path / "gate"  # the copy's first piece held until the finalize has cancelled it, whatever the load
    slow_workers(0.2, str(gate))
    stager, _, mover = worker_stager(tmp_path, client)
    src = stager.stage_dir / "node0" / "f"
    src.write_bytes(os.urandom(32 * MiB))
    req = stager.send(src, "f")
    while stager.table.info(req).state == SI_PEND:
        time.sleep(0.002)
    opener = threading.Thread(target=_open_once_cancelled, args=(mover, gate), daemon=True)
    opener.start()
    failed = stager.close(0.2)
    opener.join()
    assert [f.request.id for f in failed] == [req] and "stage_timeout" in failed[0].reason
    # The task noticed the cancel event at its next piece and removed its temporary file before it reported.
    assert list((tmp_path / "global").iterdir()) == [] and src.exists()


def test_worker_killed_mid_transfer(tmp_path, dask_client):
    c = dask_client  # the shared cluster: the killed worker is restarted after the test (conftest.py)
    stager, workers, _ = worker_stager(tmp_path, c)
    # Worker 1's copy is held at its first piece by a gate never opened: it is killed mid-transfer, whatever the load
    # (with a copy merely slowed, a late SI_ACTV could let it finish first). Its successor is a fresh process.
    c.run(slowcopy.install, 0.05, str(tmp_path / "never"), workers=[workers[1]])
    pids = c.run(os.getpid)
    src = stager.stage_dir / "node1" / "big"
    src.write_bytes(os.urandom(64 * MiB))
    req = stager.send(src, "big")
    while stager.table.info(req).state == SI_PEND:
        time.sleep(0.002)
    os.kill(pids[workers[1]], signal.SIGKILL)
    assert stager.wait(req, 60) == SI_FAIL
    assert "mover died (worker" in stager.table.info(req).reason
    assert stager.table.query(req) == SI_FAIL
    assert list((tmp_path / "global").iterdir()) == []  # no partial file, no temporary
    assert src.exists()
    # Later requests work (on the surviving worker).
    other = stager.stage_dir / "node0" / "small"
    other.write_bytes(b"still working")
    req2 = stager.send(other, "small")
    assert stager.wait(req2, 60) == SI_SCES
    assert (tmp_path / "global" / "small").read_bytes() == b"still working"
    assert stager.close(30) == []


def test_worker_by_node_dir_runs_the_copy_on_that_worker(tmp_path, client):
    stager, workers, _ = worker_stager(tmp_path, client)
    srcs = {k: stager.stage_dir / f"node{k}" / "sub" / f"from{k}" for k in range(2)}
    ids = {}
    for k, src in srcs.items():
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_bytes(b"x" * k)
        ids[k] = stager.send(src, f"from{k}")
    assert set(stager.wait(timeout=60).values()) == {SI_SCES}
    # The worker that announced SI_ACTV ran the copy: the one that holds node{k}.
    for k, req in ids.items():
        assert stager.mover.ran_on[req] == workers[k]
        assert (tmp_path / "global" / f"from{k}").read_bytes() == b"x" * k
    stager.close(30)


# --- through ftidask.init(client=...): the Dask backend picks the mover ----------------------------

def test_context_staging_on_dask_backend(tmp_path, client):
    ctx = ftidask.init(client=client, ckpt_dir=tmp_path / "local", glbl_dir=tmp_path / "global",
                       meta_dir=tmp_path / "meta", enable_staging=1)
    stage = ctx.stage_dir()
    assert stage.parent.name == "node0"  # the client's stage dir is worker 0's node directory
    mover = ctx._stager.mover
    assert isinstance(mover, DaskMover)
    ids = {}
    for i in range(10):
        (stage / f"f{i}").write_bytes(bytes([i]) * (i * 1000))
        ids[i] = ctx.send_file(stage / f"f{i}", f"out/f{i}")
    states = ctx.wait_staged(timeout=120)
    assert set(states.values()) == {SI_SCES}
    workers = sorted(client.scheduler_info()["workers"])
    for i, req in ids.items():
        assert ctx.stage_status(req) == SI_SCES and ctx.stage_status(req) == SI_NINI
        assert mover.ran_on[req] == workers[0]
        assert (tmp_path / "global" / "out" / f"f{i}").read_bytes() == bytes([i]) * (i * 1000)
    ctx.finalize()


def test_a_copy_of_a_client_whose_run_was_taken_over_never_publishes(tmp_path, client, slow_workers):
    """A restarted program's client takes the run over (its init tells every worker: ``fence.take_over``) while a
    copy of the first client runs on a worker (an orphan: its client died): the copy stops, publishes nothing and
    leaves no temporary file; a copy of the first client's not started yet is refused. The destination stays free
    for the new client's copy (before, the dead client's older file was published there, and the new client's copy
    of it then failed: "destination appeared during the transfer")."""
    slow_workers(0.2)
    ctx = ftidask.init(client=client, ckpt_dir=tmp_path / "local", glbl_dir=tmp_path / "global",
                       meta_dir=tmp_path / "meta", enable_staging=1)
    src = ctx.stage_dir() / "big"
    src.write_bytes(os.urandom(32 * MiB))
    req = ctx.send_file(src, "out/big")
    table = ctx._stager.table  # (the stager starts with the first request)
    deadline = time.monotonic() + 60
    while table.info(req).state == SI_PEND:
        assert time.monotonic() < deadline, "the copy did not start"
        time.sleep(0.01)
    run = ctx.cluster.run_id
    client.run(fence.take_over, run, "the-restarted-programs-client")
    try:
        assert ctx.wait_staged(req, timeout=60) == SI_FAIL
        assert "is written by another client now" in table.info(req).reason
        assert not (tmp_path / "global" / "out" / "big").exists()
        assert [p for p in find_paths(tmp_path / "global", "*") if p.is_file()] == []
        assert src.exists()  # the source stays for the run that goes on
        late = ctx.send_file(src, "out/late")
        assert ctx.wait_staged(late, timeout=60) == SI_FAIL
        assert "this copy was not started" in table.info(late).reason
        assert [ctx.stage_status(r) for r in (req, late)] == [SI_FAIL, SI_FAIL]  # read: not raised at finalize
    finally:
        client.run(fence.take_over, run, client.id)  # the test's client writes the run again: finalize runs
    slow_workers(0)
    again = ctx.send_file(src, "out/big")
    assert ctx.wait_staged(again, timeout=60) == SI_SCES
    assert (tmp_path / "global" / "out" / "big").stat().st_size == 32 * MiB
    ctx.finalize()
