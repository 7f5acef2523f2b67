"""Runs that share directories: a live run is never adopted, exec_ids never leave their directories,
and a run's directories do not follow a later ``os.chdir`` (issue 12, items 1-3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths
from ftidask.tools.cli import main as cli_main

# A second process that starts a run (optionally named), commits one checkpoint of ``value``, reports
# itself on stdout and then waits, alive, until its stdin is closed (or it is killed).
HOLDER = r"""
import json, os, sys
import numpy as np
import ftidask
dirs, value = json.loads(sys.argv[1]), float(sys.argv[2])
ctx = ftidask.init(**dirs)
a = np.full(8, value)
ctx.protect(1, a)
ctx.checkpoint(1, 1)
print(json.dumps({"exec_id": ctx.exec_id, "status": ctx.status(), "pid": os.getpid()}), flush=True)
sys.stdin.read()
"""

# One of two runs sharing the directories: 200 checkpoints while the other run writes its own.
WORKER = r"""
import json, os, sys, time
import numpy as np
import ftidask
dirs, tag, base = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctx = ftidask.init(**dirs)
a = np.full(64, tag * 1000.0)
ctx.protect(1, a)
ctx.checkpoint(1, 1)
open(os.path.join(base, f"ready{tag}"), "w").close()
deadline = time.monotonic() + 60
while not all(os.path.exists(os.path.join(base, f"ready{t}")) for t in (1, 2)):
    assert time.monotonic() < deadline, "the other run never started"
    time.sleep(0.005)
for i in range(1, 201):
    a[:] = tag * 1000 + i
    ctx.checkpoint(i % 5 + 1, 1)  # ids reused, as loops do
b = np.zeros(64)
ctx.protect(1, b)
ctx.recover()
print(json.dumps({"exec_id": ctx.exec_id, "status": ctx.status(), "first": float(b[0]),
                  "uniform": bool((b == b[0]).all())}))
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Holder:
    """A live run in another process."""

    def __init__(self, dirs: dict, value: float = 1.0, **config: object) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, json.dumps({**dirs, **config}), str(value)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=_env())
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"holder failed: {self.proc.stderr.read()}")
        self.info = json.loads(line)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Exit without finalize (the run stays restartable)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


@pytest.fixture
def holder_factory():
    made: list[Holder] = []

    def make(*args, **kw) -> Holder:
        made.append(Holder(*args, **kw))
        return made[-1]

    yield make
    for h in made:
        if h.proc.poll() is None:
            h.kill()


# --- item 1: runs sharing a meta_dir ----------------------------------------------------------------

def test_two_live_runs_in_one_directory_never_share_data(tmp_path, dirs):
    def start(tag: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(dirs), str(tag), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())

    first = start(1)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready1").exists():  # the first run has committed a checkpoint: adoptable if dead
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)
    second = start(2)
    results = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["exec_id"] != results[1]["exec_id"]
    assert [r["status"] for r in results] == [0, 0]  # the second never adopted the live first run
    assert [(r["first"], r["uniform"]) for r in results] == [(1200.0, True), (2200.0, True)]


def test_second_writer_of_a_live_exec_id_is_refused(dirs, holder_factory):
    holder = holder_factory(dirs, 7.0, exec_id="job-a")
    with pytest.raises(ftidask.RunInUseError, match=rf"job-a.*pid {holder.info['pid']}") as raised:
        ftidask.init(exec_id="job-a", **dirs)
    assert isinstance(raised.value, ftidask.FTIError)
    records = sorted(p.name for p in Path(dirs["meta_dir"]).glob("job-a/commits/*.json"))
    assert records == ["s00000001.json"]  # nothing of the live run touched
    holder.stop()
    ctx = ftidask.init(exec_id="job-a", **dirs)  # its writer is gone: a restart
    assert ctx.status() == 1
    b = np.zeros(8)
    ctx.protect(1, b)
    ctx.recover()
    assert b[0] == 7.0


@pytest.mark.parametrize("left", [b'{"pid": 1, "host": "an-old-holder"}', b'{"pid": 1, "host": "' + b"h" * 900 + b'"}'])
def test_the_lock_file_names_its_holder_over_any_record_left_before(dirs, holder_factory, left):
    """The holder's record is written over the previous one without truncating the file first: a shorter or a
    longer record left there never garbles the pid the refused writer is told."""
    run = Path(dirs["meta_dir"], "job-b")
    run.mkdir(parents=True)
    (run / "run.lock").write_bytes(left)
    holder = holder_factory(dirs, 7.0, exec_id="job-b")
    with pytest.raises(ftidask.RunInUseError, match=rf"job-b.*pid {holder.info['pid']} on host "):
        ftidask.init(exec_id="job-b", **dirs)
    holder.stop()


def test_killed_run_is_adopted_and_a_side_run_never_takes_its_place(dirs, holder_factory):
    holder = holder_factory(dirs, 3.0)
    first = holder.info["exec_id"]
    side = ftidask.init(**dirs)  # the first run is alive: a run of its own
    assert side.status() == 0 and side.exec_id != first
    a = np.full(8, 5.0)
    side.protect(1, a)
    side.checkpoint(1, 1)
    current = json.loads((Path(dirs["meta_dir"]) / "current_exec_id").read_text())
    assert current["exec_id"] == first  # a restart without exec_id still finds the first run
    holder.kill()
    assert Path(dirs["meta_dir"], first, "commits", "s00000001.json").is_file()

    again = ftidask.init(**dirs)  # the first run is dead: adopted
    assert (again.exec_id, again.status()) == (first, 1)
    b = np.zeros(8)
    again.protect(1, b)
    again.recover()
    assert b[0] == 3.0
    side_again = ftidask.init(exec_id=side.exec_id, **dirs)  # the side run: restarted by its name
    assert side_again.status() == 1
    side_again.protect(1, b)
    side_again.recover()
    assert b[0] == 5.0


def _lock_is_free(dirs, exec_id) -> bool:
    import fcntl

    with open(Path(dirs["meta_dir"], exec_id, "run.lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def test_inits_of_one_run_in_one_process_share_its_lock(dirs, holder_factory):
    ctx = ftidask.init(**dirs)
    a = np.full(4, 2.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    again = ftidask.init(**dirs)  # a re-init in the same process (a notebook's init cell run again): a restart
    assert (again.exec_id, again.status()) == (ctx.exec_id, 1)
    b = np.zeros(4)
    again.protect(1, b)
    again.recover()
    assert b[0] == 2.0
    again._close()
    assert not _lock_is_free(dirs, ctx.exec_id)  # still held: ctx is open
    # another process is refused meanwhile
    other = subprocess.run([sys.executable, "-c", HOLDER, json.dumps({**dirs, "exec_id": ctx.exec_id}), "1"],
                           capture_output=True, text=True, env=_env(), timeout=120, input="")
    assert other.returncode != 0 and "RunInUseError" in other.stderr
    ctx.checkpoint(2, 1)
    ctx._close()
    assert _lock_is_free(dirs, ctx.exec_id)


def test_lock_is_released_at_finalize_and_when_the_context_is_dropped(dirs, holder_factory):
    import fcntl

    ctx = ftidask.init(exec_id="rel", keep_last_ckpt=1, **dirs)
    lock = Path(dirs["meta_dir"], "rel", "run.lock")
    with open(lock, "a") as fh, pytest.raises(BlockingIOError):
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    ctx.protect(1, np.zeros(3))
    ctx.checkpoint(1, 1)
    ctx.finalize()
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free
    ctx = ftidask.init(exec_id="rel", **dirs)
    assert ctx.status() == 2
    del ctx
    import gc

    gc.collect()
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_clean_keeps_a_live_run(tmp_path, holder_factory, capsys):
    base = tmp_path / "base"
    dirs = {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta")}
    holder = holder_factory(dirs, 1.0)
    dead = ftidask.init(exec_id="dead", **dirs)
    dead.protect(1, np.zeros(2))
    dead.checkpoint(1, 1)
    dead._close()
    assert cli_main(["clean", str(base), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "in use" in out and holder.info["exec_id"] in out
    assert (base / "Meta" / holder.info["exec_id"] / "commits" / "s00000001.json").is_file()
    assert not (base / "Meta" / "dead").exists()


# --- item 2: exec_id validation, deletions stay inside ------------------------------------------------

@pytest.mark.parametrize("bad", ["../..", "..", ".", "a/b", "/abs", "x" * 200, "a\0b", "\u00e9t\u00e9", "-rf"])
def test_bad_exec_id_refused_in_config(dirs, bad):
    with pytest.raises(ftidask.ConfigError, match="exec_id"):
        ftidask.init(exec_id=bad, **dirs)
    assert not Path(dirs["meta_dir"]).exists()


@pytest.mark.parametrize("which", ["../..", "abs"])
def test_clean_refuses_an_exec_id_outside_the_directories(tmp_path, capsys, which):
    base = tmp_path / "work" / "base"
    for sub in ("Local/node0/r1", "Global/r1", "Meta/r1"):
        (base / sub).mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    exec_id = str(victim) if which == "abs" else "../.."
    rc = cli_main(["clean", str(base), "--exec-id", exec_id, "--yes"])
    assert rc != 0
    assert "exec_id" in capsys.readouterr().err
    assert (victim / "keep.txt").read_text() == "precious"
    assert all((base / sub).is_dir() for sub in ("Local/node0/r1", "Global/r1", "Meta/r1"))


def test_remove_inside_refuses_paths_that_resolve_elsewhere(tmp_path):
    from ftidask.storage import files as storage

    parent, outside = tmp_path / "parent", tmp_path / "outside"
    (parent / "run").mkdir(parents=True)
    outside.mkdir()
    (outside / "f").write_text("x")
    (parent / "link").symlink_to(outside)
    for path in (parent / ".." / "outside", parent / "link", parent, Path("/")):
        assert storage.remove_inside(path, parent) is False
    assert (outside / "f").is_file()
    assert storage.remove_inside(parent / "run", parent) is True
    assert not (parent / "run").exists()


def test_current_exec_id_outside_the_run_is_not_adopted(tmp_path, caplog):
    base = tmp_path / "a" / "base"
    dirs = {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta")}
    outside = tmp_path / "a" / "outside" / "run"  # {meta_dir}/../../outside/run, {glbl_dir}/../../outside/run
    for sub in ("commits", "l1/ckpt9.s9", "l4/ckpt9.s9"):
        (outside / sub).mkdir(parents=True)
    record = {"seq": 1, "ckpt_id": 1, "level": 1, "timestamp": 0.0, "nranks": 1,
              "files": [{"rank": 0, "node": 0, "size": 10, "fb_hash": "00"}]}
    (outside / "commits" / "s00000001.json").write_text(json.dumps(record))
    (base / "Meta").mkdir(parents=True)
    (base / "Meta" / "current_exec_id").write_text(json.dumps({"exec_id": "../../outside/run"}))
    before = sorted(str(p) for p in find_paths(tmp_path / "a" / "outside", "*"))
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 0 and ".." not in ctx.exec_id
    assert sorted(str(p) for p in find_paths(tmp_path / "a" / "outside", "*")) == before
    assert "current_exec_id" in caplog.text
    # run.json naming another run is not this run's: ignored
    ctx.protect(1, np.zeros(2))
    ctx.checkpoint(1, 1)
    run_json = Path(dirs["meta_dir"], ctx.exec_id, "run.json")
    run_json.write_text(json.dumps({"exec_id": "../../outside/run", "state": "finalized"}))
    ctx._close()
    again = ftidask.init(**dirs)
    assert (again.exec_id, again.status()) == (ctx.exec_id, 1)


# --- item 3: relative directories -------------------------------------------------------------------

def test_relative_directories_do_not_follow_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = {"ckpt_dir": "Local", "glbl_dir": "./Global", "meta_dir": "Meta", "verbosity": 3}
    ctx = ftidask.init(**rel)
    a = np.full(4, 1.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    a[:] = 2.0
    ctx.checkpoint(2, 4)
    a[:] = 3.0
    ctx.checkpoint(3, 1)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    os.chdir(tmp_path)
    again = ftidask.init(**rel)
    assert again.status() == 1
    b = np.zeros(4)
    again.protect(1, b)
    again.recover()
    assert (again.recovered_from, b[0]) == ((3, 1), 3.0)
    assert all(os.path.isabs(getattr(ctx.config, k)) for k in ("ckpt_dir", "glbl_dir", "meta_dir"))


def test_stage_dir_does_not_follow_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = ftidask.init(ckpt_dir="Local", glbl_dir="Global", meta_dir="Meta", enable_staging=1, verbosity=3)
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")
    assert ctx.stage_dir().is_relative_to(tmp_path / "Local")
    ctx.finalize()
    assert list((tmp_path / "elsewhere").iterdir()) == []


# --- every backend goes through the same lock -------------------------------------------------------

@pytest.mark.dask
def test_dask_client_holds_the_run_lock(dirs, holder_factory):
    distributed = pytest.importorskip("distributed")
    holder = holder_factory(dirs, 1.0, exec_id="busy")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        with pytest.raises(ftidask.RunInUseError, match=rf"busy.*pid {holder.info['pid']}"):
            ftidask.init(client=client, exec_id="busy", **dirs)
        ctx = ftidask.init(client=client, **dirs)  # the holder's run is current and live: a run of its own
        assert ctx.status() == 0 and ctx.exec_id != "busy"
        other = subprocess.run([sys.executable, "-c", HOLDER, json.dumps({**dirs, "exec_id": ctx.exec_id}), "1"],
                               capture_output=True, text=True, env=_env(), timeout=120, input="")
        assert other.returncode != 0 and "RunInUseError" in other.stderr  # the Dask client holds it
        ctx.finalize()


def test_mpi_rank0_holds_the_run_lock_and_every_rank_gets_the_error(tmp_path, holder_factory):
    from mpi_util import mpiexec, run

    if mpiexec() is None:
        pytest.skip("needs mpiexec")
    pytest.importorskip("mpi4py")
    base = tmp_path / "run"
    dirs = {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}
    holder = holder_factory(dirs, 1.0, exec_id="busy")
    run(2, "levels_job.py", "probe", json.dumps({"local_test": 1, "exec_id": "busy"}), str(base), "1", timeout=120)
    results = [json.loads((base / f"result-{r}.json").read_text()) for r in range(2)]
    assert [r["error"] for r in results] == ["RunInUseError"] * 2, results
    assert all(f"pid {holder.info['pid']}" in r["message"] for r in results)
    assert (base / "Meta" / "busy" / "commits" / "s00000001.json").is_file()
    holder.stop()
    run(2, "levels_job.py", "probe", json.dumps({"local_test": 1, "exec_id": "busy"}), str(base), "1", timeout=120)
    assert [json.loads((base / f"result-{r}.json").read_text())["status"] for r in range(2)] == ["ok"] * 2


@pytest.mark.parametrize("damage", [b"", b"{\"exec_id\": \"2026-11-2", b"\xff\xfe garbage", b"{\"exec_id\": 7}",
                                    "dangling-record"])
def test_a_damaged_current_exec_id_restarts_the_run_committed_last(tmp_path, caplog, damage):
    """("dangling-record": a dangling link among the run's commit records as well: the run was passed over, and
    the restart started fresh.)"""
    dirs = {k: str(tmp_path / k) for k in ("ckpt_dir", "glbl_dir", "meta_dir")}
    older = ftidask.init(**dirs, exec_id="older-run")  # an unfinished side run, committed first
    older.protect(1, np.zeros(3))
    older.checkpoint(1, 1)
    older._close()
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a := np.arange(5.0))
    ctx.checkpoint(1, 1)
    ctx.checkpoint(2, 1)
    ctx._close()  # dies
    if damage == "dangling-record":
        (Path(dirs["meta_dir"]) / ctx.exec_id / "commits" / "s00000099.json").symlink_to(tmp_path / "nowhere")
        damage = b"garbage"
    (Path(dirs["meta_dir"]) / "current_exec_id").write_bytes(damage)
    again = ftidask.init(**dirs)
    assert (again.exec_id, again.status()) == (ctx.exec_id, 1)
    again.protect(1, out := np.zeros(5))
    again.recover()
    assert np.array_equal(out, a) and again.recovered_from[0] == 2
    assert "current_exec_id" in caplog.text
    again.finalize()


@pytest.mark.parametrize("removed", ["run-dir", "meta-dir", "lock"])
def test_a_live_runs_lock_removed_under_it_is_taken_again_at_its_next_commit(tmp_path, removed):
    """A cleaner of /tmp removed the live run's lock file (with its meta directory): another program's init then
    found no lock, adopted the live run (status 1), and its finalize marked it finished while the first one went on
    committing into it. The run's next commit locks the file again: the other init is refused."""
    import shutil

    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4}
    ctx = ftidask.init(exec_id="x", **dirs)
    a = np.arange(10.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    meta = tmp_path / "M"
    {"run-dir": lambda: shutil.rmtree(meta / "x"), "meta-dir": lambda: shutil.rmtree(meta),
     "lock": lambda: (meta / "x" / "run.lock").unlink()}[removed]()
    a += 1
    ctx.checkpoint(2, 1)  # re-creates what it needs, the lock included
    code = (f"import ftidask\ntry:\n    ftidask.init(exec_id='x', **{dirs!r})\n    print('adopted')\n"
            "except ftidask.RunInUseError as exc:\n    print('refused', exc)\n")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert other.stdout.startswith("refused"), other.stdout + other.stderr
    ctx._close()
    again = ftidask.init(exec_id="x", **dirs)
    again.protect(1, b := np.zeros(10))
    assert again.status() == 1
    again.recover()
    assert again.recovered_from == (2, 1) and (b == np.arange(10.0) + 1).all()
    again.finalize()


@pytest.mark.parametrize("planted", ["directory", "link"])
def test_a_lock_file_replaced_under_a_live_run_fails_no_checkpoint(tmp_path, planted, caplog):
    """Its lock file replaced by a directory or a link loop: every later checkpoint failed at the lock taken again
    (after its record was written). Said once; the checkpoints go on."""
    import logging

    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4}
    ctx = ftidask.init(exec_id="x", **dirs)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    lock = tmp_path / "M" / "x" / "run.lock"
    lock.unlink()
    lock.mkdir() if planted == "directory" else lock.symlink_to(lock)
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        assert [ctx.checkpoint(i, 1).id for i in (2, 3)] == [2, 3]
    assert sum("cannot be locked again" in r.getMessage() for r in caplog.records) == 1
    ctx.finalize()
