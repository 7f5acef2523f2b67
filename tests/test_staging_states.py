"""A staging request's final state tells the truth (docs/staging.md, States): SI_SCES, the file is at its destination
and the local file is removed; SI_FAIL, the destination holds nothing of it and the local file is kept. Here for the
movers that die (killed after they published, before their answer), an MPI head past ``stage_timeout``, a Dask job
killed whole, and a node-local disk full when a transfer is noted."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ftidask
from ftidask import SI_FAIL, SI_SCES
from ftidask.staging import journal, settle
from ftidask.staging import process as staging_process
from ftidask.staging.copy import StageRequest, temp_name
from ftidask.staging.process import ProcessMover
from ftidask.staging.stager import Stager

sys.path.insert(0, str(Path(__file__).parent))  # also on the Dask workers' path (the nanny passes it on)
import slowcopy  # noqa: E402

MiB = 1 << 20


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.005)


def make_stager(tmp_path: Path, mover) -> Stager:
    stage = tmp_path / "local" / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    (tmp_path / "global").mkdir(exist_ok=True)
    return Stager(stage, tmp_path / "global", mover)


# --- settle: what a dead mover's transfer left behind -----------------------------------------------------------


def request(tmp_path: Path, data: bytes) -> StageRequest:
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "global").mkdir(exist_ok=True)
    src, dst = tmp_path / "local" / "f", tmp_path / "global" / "f"
    src.write_bytes(data)
    return StageRequest(7, str(src), str(dst), temp_name(str(dst), "0123456789ab-7"), len(data))


def test_settle_a_temporary_file_linked_to_the_destination_was_published(tmp_path):
    req = request(tmp_path, b"published")  # killed between the link and the unlink of the temporary name
    Path(req.dst).write_bytes(b"published")
    os.link(req.dst, req.tmp)
    assert settle.settle(req) == SI_SCES
    assert Path(req.dst).read_bytes() == b"published"
    assert not Path(req.tmp).exists() and not Path(req.src).exists()  # finished as the mover would have


def test_settle_a_temporary_file_alone_was_not_published(tmp_path):
    req = request(tmp_path, b"whole file")
    Path(req.tmp).write_bytes(b"whole")  # killed mid-copy
    assert settle.settle(req) == SI_FAIL
    assert list((tmp_path / "global").iterdir()) == [] and Path(req.src).read_bytes() == b"whole file"


def test_settle_no_source_and_the_destination_whole_was_published(tmp_path):
    req = request(tmp_path, b"moved")  # killed after it removed the source
    Path(req.dst).write_bytes(b"moved")
    os.unlink(req.src)
    assert settle.settle(req) == SI_SCES


def test_settle_the_source_and_the_same_bytes_at_the_destination_was_published(tmp_path):
    req = request(tmp_path, b"same bytes")  # killed before it removed the source
    Path(req.dst).write_bytes(b"same bytes")
    assert settle.settle(req) == SI_SCES
    assert not Path(req.src).exists() and Path(req.dst).read_bytes() == b"same bytes"


@pytest.mark.parametrize("foreign", [b"other bytes", b"other", b""])
def test_settle_a_foreign_destination_is_not_the_copy(tmp_path, foreign):
    req = request(tmp_path, b"mine bytes!")  # a file that appeared meanwhile: the copy refused to replace it
    Path(req.dst).write_bytes(foreign)
    assert settle.settle(req) == SI_FAIL
    assert Path(req.dst).read_bytes() == foreign and Path(req.src).read_bytes() == b"mine bytes!"


def test_settle_nothing_there_was_not_published(tmp_path):
    req = request(tmp_path, b"queued")
    assert settle.settle(req) == SI_FAIL and Path(req.src).exists()
    shutil.rmtree(tmp_path / "global")  # its directory not even created
    assert settle.settle(req) == SI_FAIL and Path(req.src).exists()


# --- a mover process killed after it published ------------------------------------------------------------------


def hold_mover_process(monkeypatch, marker: Path, when: str) -> None:
    """The mover processes started from now on stop (touch ``marker``, then sleep) ``after-transfer`` (published,
    the source removed, before the answer) or ``before-source-removed`` (published, the source still there)."""
    if when == "after-transfer":
        seam = ("import time, ftidask.staging.process as _p\n_real = _p.transfer\n"
                "def _held(*a, **k):\n    r = _real(*a, **k)\n"
                f"    open({str(marker)!r}, 'w').close()\n    time.sleep(120)\n    return r\n"
                "_p.transfer = _held\n")
    else:
        seam = ("import os, time\n_real = os.unlink\n"
                "def _held(path, *a, dir_fd=None, **k):\n"
                "    if path == 'out' and dir_fd is not None:\n"
                f"        open({str(marker)!r}, 'w').close()\n        time.sleep(120)\n"
                "    return _real(path, *a, dir_fd=dir_fd, **k)\n"
                "os.unlink = _held\n")
    popen = subprocess.Popen

    def popen_held(args, *rest, **kwargs):
        i = args.index("-c") + 1
        return popen([*args[:i], seam + args[i], *args[i + 1:]], *rest, **kwargs)

    monkeypatch.setattr(staging_process.subprocess, "Popen", popen_held)


@pytest.mark.parametrize("when", ["after-transfer", "before-source-removed"])
def test_process_mover_killed_after_it_published_reports_success(tmp_path, monkeypatch, when):
    marker = tmp_path / "published"
    hold_mover_process(monkeypatch, marker, when)
    mover = ProcessMover()
    stager = make_stager(tmp_path, mover)
    src, data = stager.stage_dir / "out", os.urandom(MiB)
    src.write_bytes(data)
    req = stager.send(src, "out")
    wait_for(marker)
    os.kill(mover.pid, signal.SIGKILL)
    assert stager.wait(req, 30) == SI_SCES, stager.table.info(req).reason
    assert (tmp_path / "global" / "out").read_bytes() == data and not src.exists()
    assert sorted(p.name for p in (tmp_path / "global").iterdir()) == ["out"]  # no temporary file
    assert stager.close(10) == []  # nothing for finalize to raise


# --- a Dask worker killed after it published ----------------------------------------------------------------------


def hold_after_transfer(marker: str) -> None:
    """On a Dask worker: its copies stop after they published and removed the source, before their answer."""
    from ftidask.backends.dask import staging as dask_staging

    real = dask_staging.transfer

    def held(*args, **kwargs):
        result = real(*args, **kwargs)
        Path(marker).touch()
        time.sleep(120)
        return result

    dask_staging.transfer = held


@pytest.mark.dask
def test_dask_worker_killed_after_it_published_reports_success(tmp_path, dask_client):
    pytest.importorskip("distributed")
    from ftidask.backends.dask.staging import DaskMover, worker_by_node_dir

    c = dask_client  # the shared cluster: the killed worker (the one with the seam) is restarted after the test
    workers = sorted(c.scheduler_info()["workers"])
    stage = tmp_path / "local" / "stage"
    for i in range(len(workers)):
        (stage / f"node{i}").mkdir(parents=True)
    (tmp_path / "global").mkdir()
    stager = Stager(stage, tmp_path / "global", DaskMover(c, worker_by_node_dir(lambda: workers)))
    marker = tmp_path / "published"
    c.run(hold_after_transfer, str(marker), workers=[workers[1]])
    pids = c.run(os.getpid)
    src, data = stage / "node1" / "out", os.urandom(MiB)
    src.write_bytes(data)
    req = stager.send(src, "out")
    wait_for(marker)
    os.kill(pids[workers[1]], signal.SIGKILL)
    assert stager.wait(req, 60) == SI_SCES, stager.table.info(req).reason
    assert (tmp_path / "global" / "out").read_bytes() == data and not src.exists()
    assert stager.close(30) == []


# --- a Dask job killed whole during a copy: its restart removes the temporary file --------------------------------

_DASK_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
from distributed import Client
import ftidask
client = Client({address!r})
ctx = ftidask.init(client=client, ckpt_dir={root!r} + "/local", glbl_dir={root!r} + "/global",
                   meta_dir={root!r} + "/meta", enable_staging=1)
src = ctx.stage_dir() / "out.bin"
src.write_bytes(os.urandom(4 << 20))
ctx.send_file(src, "out.bin")
print(ctx.exec_id, flush=True)
time.sleep(600)
"""


@pytest.mark.dask
def test_dask_job_killed_mid_copy_leaves_nothing_after_its_restart(tmp_path, dask_client):
    pytest.importorskip("distributed")
    c = dask_client
    workers = sorted(c.scheduler_info()["workers"])
    gate = tmp_path / "never"  # the copy waits after its first piece: killed mid-transfer, whatever the load
    c.run(slowcopy.install, 0.0, str(gate), workers=[workers[0]])  # the client's stage dir is node0: worker 0
    pids = c.run(os.getpid)
    code = _DASK_CHILD.format(tests=str(Path(__file__).parent), address=c.scheduler.address, root=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        exec_id = child.stdout.readline().strip()
        assert exec_id, "the child did not start its copy"
        deadline = time.monotonic() + 60
        while not list((tmp_path / "global").glob(".*.tmp")):
            assert time.monotonic() < deadline, "no temporary file"
            time.sleep(0.01)
    finally:
        child.kill()  # the whole job: its client and the worker copying
        child.wait()
    os.kill(pids[workers[0]], signal.SIGKILL)
    assert [p.name for p in (tmp_path / "global").iterdir() if p.name.endswith(".tmp")]  # left by the kill
    ctx = ftidask.init(client=c, ckpt_dir=tmp_path / "local", glbl_dir=tmp_path / "global",
                       meta_dir=tmp_path / "meta", enable_staging=1, exec_id=exec_id)
    try:
        assert list((tmp_path / "global").iterdir()) == []  # removed by the restart, as the note named it
    finally:
        ctx.finalize()


@pytest.mark.dask
def test_dask_copies_are_noted_until_their_task_ends(tmp_path, dask_client):
    pytest.importorskip("distributed")
    c = dask_client
    workers = sorted(c.scheduler_info()["workers"])
    gate = tmp_path / "gate"
    c.run(slowcopy.install, 0.0, str(gate), workers=[workers[0]])
    try:
        ctx = ftidask.init(client=c, ckpt_dir=tmp_path / "local", glbl_dir=tmp_path / "global",
                           meta_dir=tmp_path / "meta", enable_staging=1)
        src = ctx.stage_dir() / "out.bin"
        src.write_bytes(os.urandom(MiB))
        req = ctx.send_file(src, "out.bin")
        tmp = ctx.stage_info(req).request.tmp
        wait_for(Path(tmp))
        notes = journal.notes_dir(ctx.stage_dir())
        assert [json.loads(p.read_text()) for p in notes.iterdir()] == [{"tmp": tmp}]
        gate.touch()
        assert ctx.wait_staged(req, 60) == SI_SCES
        assert list(notes.iterdir()) == []
        ctx.finalize()
    finally:
        c.run(slowcopy.uninstall)


# --- a note on a full node-local disk -------------------------------------------------------------------------------


@pytest.mark.parametrize("short", [False, True])
def test_a_note_that_cannot_be_written_leaves_no_file(tmp_path, monkeypatch, short):
    notes = tmp_path / ".rank0-transfers"
    req = StageRequest(1, str(tmp_path / "a"), str(tmp_path / "g" / "a"), temp_name(str(tmp_path / "g" / "a"),
                                                                                      "0123456789ab-1"), 1)
    real = os.write

    def full(fd, data):
        if short:
            return real(fd, bytes(data)[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(journal.os, "write", full)
        journal.begin(notes, req)  # the transfer goes on: only its note is lost
    assert list(notes.iterdir()) == []


# --- an MPI head past stage_timeout --------------------------------------------------------------------------------

_HEAD_JOB = """
import json, os, sys
sys.path.insert(0, {tests!r})
from mpi4py import MPI
import slowcopy
import ftidask
base = {root!r}
slowcopy.install(0.5)  # each 8 MiB piece the head writes takes 0.5 s more: finalize comes mid-copy
ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=base + "/Local", glbl_dir=base + "/Global", meta_dir=base + "/Meta",
                   enable_staging=1, local_test=1, node_size=2, head=1, inline_l4=0, stage_timeout=1)
stage = ctx.stage_dir()
ids = {{}}
for i in range(3):
    (stage / f"f{{i}}").write_bytes(os.urandom(16 << 20))
    ids[f"f{{i}}"] = ctx.send_file(stage / f"f{{i}}", f"out/f{{i}}")
try:
    ctx.finalize()
    failed = []
except ftidask.StagingError as exc:
    failed = [name for name, req in ids.items() if f"#{{req}} " in str(exc)]
print("STAGED", json.dumps({{"names": sorted(ids), "failed": failed, "stage": str(stage)}}), flush=True)
"""


@pytest.mark.mpi
def test_head_past_stage_timeout_publishes_nothing_reported_failed(tmp_path):
    pytest.importorskip("mpi4py")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is None:
        pytest.skip("no mpiexec")
    script = tmp_path / "job.py"
    script.write_text(_HEAD_JOB.format(tests=str(Path(__file__).parent), root=str(tmp_path)))
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STAGED "))
    report = json.loads(line[len("STAGED "):])
    stage, out = Path(report["stage"]), tmp_path / "Global" / "out"
    assert "f2" in report["failed"], report  # the timeout did cut the queue short
    for name in report["names"]:  # the job is over: the head copies nothing more
        if name in report["failed"]:  # SI_FAIL: nothing of it at the destination, the local file kept
            assert not (out / name).exists() and (stage / name).stat().st_size == 16 * MiB, name
        else:  # SI_SCES
            assert (out / name).stat().st_size == 16 * MiB and not (stage / name).exists(), name
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")] if out.is_dir() else True


# --- the source removed by the application during its copy -----------------------------------------------------------


def test_a_source_removed_during_its_copy_is_published_and_reported_so(tmp_path, monkeypatch):
    from ftidask.staging.threadmover import ThreadMover

    gate = tmp_path / "gate"  # the copy waits after its first piece until the source is gone
    slowcopy.slow_movers(0, monkeypatch.setattr, gate)
    stager = make_stager(tmp_path, ThreadMover())
    src, data = stager.stage_dir / "out", os.urandom(MiB)
    src.write_bytes(data)
    req = stager.send(src, "out")
    wait_for(Path(stager.table.info(req).request.tmp))
    src.unlink()  # the copy reads on from its open descriptor
    gate.touch()
    assert stager.wait(req, 30) == SI_SCES, stager.table.info(req).reason
    assert (tmp_path / "global" / "out").read_bytes() == data
    assert stager.close(10) == []
