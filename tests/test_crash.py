"""A process killed (SIGKILL) in the middle of a checkpoint: the next run recovers the previous one."""

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

CHILD = r"""
import sys, numpy as np, ftidask
dirs = dict(ckpt_dir=sys.argv[1] + '/Local', glbl_dir=sys.argv[1] + '/Global', meta_dir=sys.argv[1] + '/Meta',
            verbosity=3)
ctx = ftidask.init(**dirs)
arrays = [np.zeros(4_000_000), np.zeros(3_000_000, np.int32)]
for vid, a in enumerate(arrays):
    ctx.protect(vid + 1, a)
for i in range(1, 100000):
    for a in arrays:
        a[:] = i
    ctx.checkpoint(i, 4 if i % 3 == 0 else 1)
    print(i, flush=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.29, 0.41, 0.77])
def test_sigkill_mid_checkpoint(tmp_path, delay):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env)
    # Wait for at least one committed checkpoint, then kill at a point that varies with `delay`.
    first = proc.stdout.readline()
    assert first.strip() == "1", first
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    dirs = dict(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                meta_dir=str(tmp_path / "Meta"), verbosity=3)
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    a, b = np.full(4_000_000, -1.0), np.full(3_000_000, -1, np.int32)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.recover()
    ckpt_id, _level = ctx.recovered_from
    assert (a == ckpt_id).all() and (b == ckpt_id).all()
    # The run continues: a new checkpoint commits and the stale temporary files do not get in the way.
    ctx.checkpoint(ckpt_id + 1000, 1)
    leftovers = find_paths(tmp_path, ".*.tmp-*")  # not rglob: the retired checkpoint is deleted meanwhile
    leftovers += [p for p in find_paths(tmp_path, "ckpt*.s*") if p.is_dir()
                  and not (tmp_path / "Meta" / ctx.exec_id / "commits" / f"s{int(p.name.split('.s')[1]):08d}.json").exists()]
    ctx2 = ftidask.init(**dirs)
    ctx2.protect(1, a)
    ctx2.protect(2, b)
    ctx2.recover()
    assert ctx2.recovered_from[0] == ckpt_id + 1000
    assert leftovers == []


FINALIZE_CHILD = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
dirs = dict(ckpt_dir=sys.argv[1] + '/Local', glbl_dir=sys.argv[1] + '/Global', meta_dir=sys.argv[1] + '/Meta',
            verbosity=4)
ctx = ftidask.init(**dirs)
a = np.zeros(100_000)
ctx.protect(1, a)
for ckpt_id, level in ((1, 4), (2, 1)):   # the L1 checkpoint does not retire the older L4 one
    a[:] = ckpt_id
    ctx.checkpoint(ckpt_id, level)
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "delete_record", 1, after=True)
ctx.finalize()   # killed once it has removed the first checkpoint's commit record
"""


def test_sigkill_in_finalize_keeps_the_newest_checkpoint(tmp_path):
    """finalize removes the run's checkpoints oldest first: a process killed part-way leaves the newest one
    recoverable, never only an older one (the restart would silently go back further than its last checkpoint)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FINALIZE_CHILD, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), verbosity=4)
    assert ctx.status() == 1
    a = np.full(100_000, -1.0)
    ctx.protect(1, a)
    ctx.recover()
    assert ctx.recovered_from == (2, 1) and (a == 2).all()
    ctx.finalize()


ARCHIVE_CHILD = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(exec_id="arch", keep_l4_ckpt=1, ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global",
                   meta_dir=sys.argv[1] + "/Meta", verbosity=4)
a = np.zeros(100_000)
ctx.protect(1, a)
for ckpt_id, level in ((1, 4), (2, 1), (3, 4)):
    a[:] = ckpt_id
    ctx.checkpoint(ckpt_id, level)
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "delete_record", 2)
ctx.finalize()   # killed once checkpoint 3, the newest, is archived, before its commit record goes
"""


def test_sigkill_in_finalize_after_archiving_the_newest_checkpoint_keeps_it_recoverable(tmp_path):
    """keep_l4_ckpt: finalize archives level-4 checkpoints (oldest first). Killed between archiving the newest and
    dropping its commit record, the restart (status 1) recovered nothing: the record named a directory moved to
    l4_archive. The checkpoint stays whole where its record points until the record goes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", ARCHIVE_CHILD, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dirs = dict(exec_id="arch", keep_l4_ckpt=1, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                meta_dir=str(tmp_path / "Meta"), verbosity=4)
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    a = np.full(100_000, -1.0)
    ctx.protect(1, a)
    ctx.recover()
    assert ctx.recovered_from == (3, 4) and (a == 3).all()
    ctx.finalize()  # archives it again: one copy of each checkpoint in the archive, whole
    archive = tmp_path / "Global" / "arch" / "l4_archive"
    assert sorted(p.name for p in archive.iterdir()) == ["ckpt1.s1", "ckpt3.s3"]
    for ckpt_id in (1, 3):
        ctx = ftidask.init(**{**dirs, "exec_id": f"read{ckpt_id}"})
        b = np.zeros(100_000)
        ctx.protect(1, b)
        ctx.recover_file(next(archive.glob(f"ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-Rank0.fti")))
        ctx.finalize()
        assert (b == ckpt_id).all()


DCP_FINALIZE_CHILD = r"""
import sys, numpy as np, ftidask
sys.path.insert(0, sys.argv[2])
import crashpoints
ctx = ftidask.init(exec_id="dcp", enable_dcp=1, ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global",
                   meta_dir=sys.argv[1] + "/Meta", verbosity=4)
a = np.zeros(100_000)
ctx.protect(1, a)
for ckpt_id in (1, 2, 3):
    a[:] = ckpt_id
    ctx.checkpoint(ckpt_id, int(sys.argv[3]))
from ftidask.engine.runstate import RunState
crashpoints.kill_at_call(RunState, "delete_record", 1)
ctx.finalize()   # killed as it drops the commit record of checkpoint 3, the only one left
"""


@pytest.mark.parametrize("level", [5, 8])
def test_sigkill_in_finalize_of_differential_checkpoints_keeps_the_newest(tmp_path, level):
    """finalize with differential checkpoints: the newest checkpoint's file was moved to the spare (which finalize
    then clears) before its commit record was dropped; killed in between, the restart recovered nothing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", DCP_FINALIZE_CHILD, str(tmp_path), str(ROOT / "tests"), str(level)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ctx = ftidask.init(exec_id="dcp", enable_dcp=1, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), verbosity=4)
    assert ctx.status() == 1
    a = np.full(100_000, -1.0)
    ctx.protect(1, a)
    ctx.recover()
    assert ctx.recovered_from == (3, level - 4) and (a == 3).all()
    ctx.finalize()


STAGING_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
import slowcopy
slowcopy.slow_movers(0.3)   # each 8 MiB piece the mover process writes takes 0.3 s more
import ftidask
ctx = ftidask.init(ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global", meta_dir=sys.argv[1] + "/Meta",
                   enable_staging=1, stage_mover="process", verbosity=4)
for name in ("first", "second"):
    (ctx.stage_dir() / name).write_bytes(bytes(range(256)) * (96 << 12))   # 24 MiB
    ctx.send_file(ctx.stage_dir() / name, name)
import os, time
deadline = time.monotonic() + 60
while not (os.path.isdir(sys.argv[1] + "/Global") and os.listdir(sys.argv[1] + "/Global")):  # the first has begun:
    assert time.monotonic() < deadline, "the mover never started"  # a process mover starting late on a busy machine
    time.sleep(0.005)                                                  # was killed with its owner before any copy
print(ctx._stager.mover.pid, flush=True)
sys.stdin.read()   # until killed
"""


def test_an_application_killed_while_its_mover_process_copies_leaves_no_traceback_and_no_torn_file(tmp_path):
    """The process mover outlives an application killed during a transfer: it finished that transfer, then its reply
    to the dead owner raised BrokenPipeError, a raw traceback on the application's stderr. It now stops quietly (nobody
    is left to learn the states), after the transfer under way, before any other."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", STAGING_CHILD, str(tmp_path), str(ROOT / "tests")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    mover = int(proc.stdout.readline())
    proc.kill()  # during the first transfer (3 pieces, about 1 s; the child waits until it has begun)
    _out, err = proc.communicate(timeout=60)  # until the mover, which shares the pipes, has exited too
    # Its pipes close while it exits: it is then gone, or a zombie its new parent has not reaped yet, soon after.
    deadline = time.monotonic() + 30
    while True:
        try:
            state = Path(f"/proc/{mover}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        assert time.monotonic() < deadline, f"the mover still runs (state {state})"
        time.sleep(0.05)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    published = sorted(p.name for p in (tmp_path / "Global").iterdir())
    assert published == ["first"]  # the transfer under way, whole; the next one never started
    assert (tmp_path / "Global" / "first").read_bytes() == bytes(range(256)) * (96 << 12)


STAGE_KILL_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
import crashpoints
import ftidask
ctx = ftidask.init(exec_id="stage", ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global",
                   meta_dir=sys.argv[1] + "/Meta", enable_staging=1, stage_mover="thread", verbosity=4)
(ctx.stage_dir() / "frame").write_bytes(bytes(range(256)) * 4096)   # 1 MiB: one piece
crashpoints.kill_at_call("ftidask.staging.copy", "_write_all", 1, after=True)   # the copy written, not published
ctx.send_file(ctx.stage_dir() / "frame", "out/frame")
ctx.wait_staged()
"""


def test_a_staging_copy_killed_with_its_thread_mover_leaves_no_temporary_file_after_the_restart(tmp_path):
    """The mover thread dies with the application: killed during a copy, its temporary file stayed at the
    destination (a hidden 1 MiB file under glbl_dir) for good, as nothing else knew its name. The transfer is noted
    in the stage directory before it starts, and the restart of the run removes what the notes name; the local file
    is kept, and sending it again publishes it whole."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", STAGE_KILL_CHILD, str(tmp_path), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    out = tmp_path / "Global" / "out"
    (left,) = out.iterdir()  # what the kill left: the temporary copy, complete, never published
    assert left.name.startswith(".frame.ftidask-stage-") and left.stat().st_size == 1 << 20
    ctx = ftidask.init(exec_id="stage", ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), enable_staging=1, stage_mover="thread", verbosity=4)
    assert list(out.iterdir()) == []
    local = ctx.stage_dir() / "frame"
    assert local.read_bytes() == bytes(range(256)) * 4096
    ctx.send_file(local, "out/frame")
    ctx.finalize()
    assert [p.name for p in out.iterdir()] == ["frame"]
    assert (out / "frame").read_bytes() == bytes(range(256)) * 4096


STAGE_KILL_RANKS_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
import crashpoints
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
cfg = load_config(None, exec_id="stage", ckpt_dir=sys.argv[1] + "/Local", glbl_dir=sys.argv[1] + "/Global",
                  meta_dir=sys.argv[1] + "/Meta", enable_staging=1, stage_mover="thread", local_test=1, node_size=1,
                  verbosity=4)
crashpoints.kill_at_call("ftidask.staging.copy", "_write_all", 1, after=True)   # the copy written, not published

def program(t):
    ctx = Context(cfg, t)
    if t.rank == int(sys.argv[3]):   # only this rank sends a file
        (ctx.stage_dir() / "frame").write_bytes(bytes(range(256)) * 4096)
        ctx.send_file(ctx.stage_dir() / "frame", "out/frame")
        ctx.wait_staged()
    t.barrier()

run_ranks(cfg, 2, program, wait=60)
"""


@pytest.mark.parametrize("restart", ["one process", "two ranks on one node"])
def test_a_staging_copy_killed_on_a_rank_that_the_restart_does_not_have_leaves_no_temporary_file(tmp_path, restart):
    """Two ranks on two nodes (threads of one process); rank 1's mover thread is killed during a copy (the process
    dies). The run restarts as one process (rank 1 gone), or as two ranks on one node (rank 1 on node 0 now, its
    notes on node 1). Each restarted rank sweeps the notes of its own number on every node it sees, and rank 0 those
    of the ranks this run does not have: the temporary copy goes. Before, each rank swept its own stage directory on
    its own node only: a rank gone (a restart on fewer ranks) or moved left its 1 MiB temporary file under glbl_dir
    for good."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", STAGE_KILL_RANKS_CHILD, str(tmp_path), str(ROOT / "tests"), "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    out = tmp_path / "Global" / "out"
    (left,) = out.iterdir()
    assert left.name.startswith(".frame.ftidask-stage-") and left.stat().st_size == 1 << 20
    notes = [str(p.relative_to(tmp_path / "Local" / "stage" / "stage")) for p in find_paths(tmp_path / "Local", "*")
             if p.name.endswith("-transfers")]
    assert notes == ["node1/.rank1-transfers"], notes
    dirs = {"exec_id": "stage", "ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "enable_staging": 1, "stage_mover": "thread", "verbosity": 4}
    if restart == "one process":
        ftidask.init(**dirs).finalize()
    else:
        cfg = load_config(None, local_test=1, node_size=2, **dirs)
        assert run_ranks(cfg, 2, lambda t: Context(cfg, t).finalize(), wait=60)[1] == []
    assert list(out.iterdir()) == []
    assert list(find_paths(tmp_path / "Local", ".rank*-transfers/*")) == []
