"""Side runs killed before their first commit: what they wrote is removed by a later start of any run.

A run started beside a live one gets an exec_id of its own and never becomes the run a restart without exec_id
finds (``current_exec_id``, see ftidask/engine/claim.py). Killed before its first commit it has nothing to
restart, and nothing ever looked at its directories again: its partial checkpoint (the size of the state) stayed
for good. A start of any run now sweeps the dead runs that never committed anything; a live run, a run with a
commit record (restartable by its exec_id) and a run whose finalize archived its level-4 checkpoints stay.
"""

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
from test_run_isolation import Holder

import ftidask
from ftidask.storage.files import find_paths

# A run that writes checkpoint 1 at ``level``: ``kill`` dies in its commit (its file written, no commit record),
# ``commit`` commits it and exits without finalize, ``live`` writes its file, then waits alive (its lock held, its
# checkpoint not committed) until its stdin is closed; ``stage`` stages a file (enable_staging) and dies before its
# mover thread publishes it (its temporary file written at the destination), with no checkpoint.
SIDE = r"""
import json, sys, numpy as np, ftidask
from ftidask.engine.runstate import RunState
sys.path.insert(0, sys.argv[3])
import crashpoints
cfg, mode = json.loads(sys.argv[1]), sys.argv[2]
level = cfg.pop("level", 1)
ctx = ftidask.init(**cfg)
a = np.arange(100_000, dtype=np.float64)
ctx.protect(1, a)
if mode == "kill":
    crashpoints.kill_at_call(RunState, "write_record", 1)  # the file whole, no commit record
elif mode == "live":
    RunState.write_record = lambda self, record: sys.stdin.read()  # holds on, its checkpoint uncommitted
elif mode == "stage":
    from ftidask.staging import copy
    crashpoints.kill_at_call(copy, "_publish", 1)
    local = ctx.stage_dir() / "out.bin"
    local.write_bytes(b"x" * 100_000)
    ctx.send_file(local, "out/out.bin")
    ctx.wait_staged(timeout=60)
ctx.checkpoint(1, level)
print(json.dumps({"exec_id": ctx.exec_id}), flush=True)
"""


def side(dirs: dict, mode: str, **cfg: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", SIDE, json.dumps({**dirs, **cfg}), mode, str(ROOT / "tests")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_ids(dirs: dict) -> set[str]:
    return {p.name for p in Path(dirs["meta_dir"]).iterdir() if p.is_dir()}


def files_of(dirs: dict, exec_id: str) -> list[Path]:
    return [p for d in ("ckpt_dir", "glbl_dir") for p in find_paths(Path(dirs[d]), "*")
            if p.is_file() and exec_id in p.parts]


def test_a_side_run_killed_before_its_first_commit_is_swept_by_the_next_start(dirs):
    """The live run (current_exec_id) is restarted and finalized: the side run killed during its first checkpoint
    (at L4: its file in glbl_dir) leaves nothing once that is over (its files stayed for good)."""
    holder = Holder(dirs, 3.0)
    try:
        first = holder.info["exec_id"]
        proc = side(dirs, "kill", level=4)
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        (dead,) = run_ids(dirs) - {first}
        assert any(p.name == "Ckpt1-Rank0.fti" for p in files_of(dirs, dead)), "killed before its file was written"
    finally:
        holder.stop()
    ctx = ftidask.init(**dirs)  # the live run is dead now: restarted
    assert (ctx.exec_id, ctx.status()) == (first, 1)
    a = np.zeros(8)
    ctx.protect(1, a)
    ctx.recover()
    assert a[0] == 3.0
    ctx.checkpoint(2, 1)
    ctx.finalize()
    assert run_ids(dirs) == {first}, "the dead side run's state was left"
    left = [p for d in ("ckpt_dir", "glbl_dir") for p in find_paths(Path(dirs[d]), "*") if p.is_file()]
    assert not left, sorted(map(str, left))


def test_live_runs_and_runs_with_a_commit_are_never_swept(dirs):
    """Beside the start that sweeps: a live side run with its checkpoint not yet committed, a dead side run with a
    committed checkpoint (restartable by its exec_id), and a dead one that never committed (swept)."""
    holder = Holder(dirs, 3.0)
    live = side(dirs, "live")
    try:
        committed = side(dirs, "commit")
        committed.communicate(timeout=120)
        assert committed.returncode == 0
        killed = side(dirs, "kill")
        killed.communicate(timeout=120)
        assert killed.returncode == -signal.SIGKILL
        others = run_ids(dirs) - {holder.info["exec_id"]}
        assert len(others) == 3
        for _ in range(6000):  # the live one has written its file (bounded: a failure, never a hang)
            if all(files_of(dirs, run) for run in others):
                break
            time.sleep(0.01)
        before = {run: files_of(dirs, run) for run in others}
        assert all(before.values()), before  # each wrote its checkpoint file
        ctx = ftidask.init(**dirs)  # a side run too: the holder is live
        ctx.finalize()
        kept = run_ids(dirs)
        assert {holder.info["exec_id"], ctx.exec_id} <= kept
        swept = others - kept
        assert len(swept) == 1 and not files_of(dirs, swept.pop())
        for run in others & kept:  # the live one and the committed one: untouched
            assert files_of(dirs, run) == before[run]
    finally:
        live.stdin.close()
        live.wait(60)
        holder.stop()


@pytest.mark.slow
def test_a_side_run_killed_before_its_first_commit_restarted_by_its_exec_id_starts_afresh(dirs):
    """Restarted by its exec_id (the live run still live), the side run starts afresh and its start removes what its
    interrupted checkpoint left."""
    holder = Holder(dirs, 3.0)
    try:
        proc = side(dirs, "kill", exec_id="side-a")
        proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL and files_of(dirs, "side-a")
        ctx = ftidask.init(exec_id="side-a", **dirs)
        assert ctx.status() == 0 and not files_of(dirs, "side-a")
        ctx.finalize()
        assert files_of(dirs, holder.info["exec_id"])  # the live run: untouched
    finally:
        holder.stop()


@pytest.mark.slow
def test_a_dead_side_runs_staging_leftovers_go_and_its_stage_files_stay(dirs):
    """A run killed while its mover thread stages a file, before any commit: the next start of another run removes
    the temporary file at the destination, never the application's file in the stage directory."""
    proc = side(dirs, "stage", enable_staging=1)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (dead,) = run_ids(dirs)
    out = Path(dirs["glbl_dir"]) / "out"
    assert [p.name for p in out.iterdir()] and not (out / "out.bin").exists()  # its temporary file only
    (staged,) = find_paths(Path(dirs["ckpt_dir"]), "out.bin")
    ctx = ftidask.init(exec_id="other", **dirs)
    ctx.finalize()
    assert run_ids(dirs) == {"other"} and list(out.iterdir()) == []
    assert staged.read_bytes() == b"x" * 100_000


@pytest.mark.slow
def test_a_dead_run_whose_last_holder_was_on_another_host_is_kept(dirs):
    """On a file system whose locks are node-local (Lustre's localflock) a live run on another node holds a lock this
    host can take: a run whose lock file names another host is never swept from here; once a start on its own host
    finds it dead, it is."""
    proc = side(dirs, "kill")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (run,) = run_ids(dirs)
    lock = Path(dirs["meta_dir"], run, "run.lock")
    record = json.loads(lock.read_text())
    lock.write_text(json.dumps({**record, "host": "another-node"}))
    before = files_of(dirs, run)
    assert before
    ftidask.init(exec_id="other", **dirs).finalize()
    assert run in run_ids(dirs) and files_of(dirs, run) == before  # kept: its holder may be alive over there
    lock.write_text(json.dumps(record))  # the record of this host's dead process
    ftidask.init(exec_id="third", **dirs).finalize()
    assert run not in run_ids(dirs) and not files_of(dirs, run)
