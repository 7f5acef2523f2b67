"""A Dask cluster that outlives its client: the client SIGKILLed while its checkpoint's tasks run on the workers.

A real deployment (``dask scheduler`` / ``dask worker``, dask-jobqueue) survives the program that drives it. When
the client dies, distributed releases its keys, but a task already running on a worker thread runs to its end: an
orphan. The restarted program connects to the SAME cluster, recovers, cleans up and checkpoints again while the
orphans may still write, rename or delete. Here the test starts the cluster itself (scheduler and workers as
processes of the venv's ``dask`` CLI, with this tree on their path), a child client (``_dask_orphan_child.py``)
whose checkpoint tasks are slowed on every worker and that is SIGKILLed while they sleep; a second client recovers
and checkpoints the same ids again; the orphans are let finish; a third client must recover the newest committed
checkpoint bit for bit, checkpoint, finalize and leave no file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from conftest import ROOT  # noqa: E402
from test_crash_campaign import assert_no_leftovers  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(600)]
CHILD = Path(__file__).with_name("_dask_orphan_child.py")
DASK = Path(sys.executable).with_name("dask")
NWORKERS = 3


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, DASK_DISTRIBUTED__LOGGING__DISTRIBUTED="warning")


@pytest.fixture
def external_cluster(tmp_path):
    """A scheduler and NWORKERS worker processes of two threads (an orphan holds one), none of them a child of a
    client: the scheduler file to connect to."""
    sched_file = tmp_path / "scheduler.json"
    logs = tmp_path / "cluster-logs"
    logs.mkdir()
    procs = []

    def start(args: list[str], name: str) -> None:
        with open(logs / name, "w") as log:
            procs.append(subprocess.Popen([str(DASK), *args], env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                          cwd=tmp_path, start_new_session=True))

    start(["scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0",
           "--scheduler-file", str(sched_file)], "scheduler.log")
    deadline = time.monotonic() + 60
    while not sched_file.exists():
        assert time.monotonic() < deadline, "the scheduler did not start: " + (logs / "scheduler.log").read_text()
        time.sleep(0.2)
    for i in range(NWORKERS):
        start(["worker", "--scheduler-file", str(sched_file), "--nthreads", "2", "--nworkers", "1",
               "--no-nanny", "--dashboard-address", ":0", "--host", "127.0.0.1"], f"worker{i}.log")
    try:
        yield sched_file
    finally:
        for p in reversed(procs):  # workers first (nothing of theirs is kept)
            with _suppress():
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)  # type: ignore[arg-type]


def _start(root: Path, sched: Path, spec: dict) -> subprocess.Popen:
    args = [sys.executable, str(CHILD), str(root), str(sched), json.dumps(spec)]
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(root: Path, sched: Path, spec: dict, timeout: float = 240) -> tuple[list[list[str]], str]:
    proc = _start(root, sched, spec)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a hang: {spec}\nstdout: {out}\nstderr: {err[-6000:]}")
    assert proc.returncode == 0, f"{spec}: exit {proc.returncode}\nstdout: {out}\nstderr: {err[-6000:]}"
    return [line.split() for line in out.splitlines()], err


def _wait_marks(marks: Path, prefix: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(list(marks.glob(prefix + "-*"))) < n:
        assert time.monotonic() < deadline, f"only {sorted(p.name for p in marks.iterdir())} of {n} {prefix} marks"
        time.sleep(0.05)


def _no_leftovers(root: Path, cfg: dict, where: str, timeout: float = 120) -> None:
    """:func:`assert_no_leftovers` once the orphans' own clean-up is over. An orphan removes its checkpoint's
    directories in ``fence.call``'s ``finally``, after its ``done`` mark: on a loaded 2-core machine that can take
    longer than the second the test waits after the marks, so the check is retried until it passes or ``timeout``
    seconds have passed (a file left for good still fails it, with the same message)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_no_leftovers(root, cfg, where)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def orphan_case(root: Path, sched: Path, cfg: dict, levels: list[int], what: str = "write_rank",
                delay: float = 60.0) -> None:
    # 1. Two checkpoints committed; the third one's tasks sleep on every worker; the client dies meanwhile.
    marks = kill_during_checkpoint_3(root, sched, cfg, levels, what, delay)
    # 2. The program restarted on the same cluster while the orphans sleep: it recovers 2 and writes 3 again (from
    # other values: a restarted program need not compute what the dead one did).
    lines, err = _run(root, sched, dict(cfg=cfg, levels=levels, steps=1, salt=1))
    assert [w[:4] for w in lines if w[0] == "R"] == [["R", "2", "exact", "2"]], f"{lines}\n{err[-6000:]}"
    committed = [w for w in lines if w[:2] == ["C", "3"]]
    assert committed, f"{lines}\n{err[-6000:]}"
    assert not list(marks.glob("done-*")), "the restarted run waited for the dead client's tasks"
    # 3. The orphans go on and end (whatever they do).
    (marks / "release").touch()
    _wait_marks(marks, "done", NWORKERS, timeout=delay + 120)
    time.sleep(1)
    # 4. A third run recovers the newest committed checkpoint, 3, bit for bit, and finalizes: no file left.
    lines, err = _run(root, sched, dict(cfg=cfg, levels=levels, steps=1, finalize=True))
    assert [w for w in lines if w[0] == "R"] == [["R", "3", "other", "3", committed[0][2]]], (
        f"not what the restarted run committed ({committed[0]}): {lines}\n{err[-6000:]}")
    assert [w[:2] for w in lines if w[0] in ("C", "FINALIZED")] == [["C", "4"], ["FINALIZED"]], (
        f"{lines}\n{err[-6000:]}")
    _no_leftovers(root, cfg, "after the orphans ended and the run was finalized")


def kill_during_checkpoint_3(root: Path, sched: Path, cfg: dict, levels: list[int], what: str,
                             delay: float) -> Path:
    """Two checkpoints committed, the third one's tasks sleeping on every worker, the client SIGKILLed."""
    marks = root / "marks"
    marks.mkdir(parents=True)
    spec = dict(cfg=cfg, levels=levels, steps=3, slow=dict(ckpt=3, delay=delay, marks=str(marks), what=what))
    proc = _start(root, sched, spec)
    try:
        _wait_marks(marks, "start", NWORKERS)
    finally:
        proc.kill()
        out, err = proc.communicate()
    assert "C 2" in out and "C 3" not in out, f"stdout: {out}\nstderr: {err[-4000:]}"
    return marks


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 3])
def test_orphans_that_outlive_the_finalize_of_the_restart(tmp_path, external_cluster, level):
    """The restarted program recovers, checkpoints and finalizes while the dead client's tasks still run: once they
    end, no file is left (they wrote a checkpoint that no client will ever collect)."""
    root, cfg, levels = tmp_path / "run", dict(group_size=3), [level]
    marks = kill_during_checkpoint_3(root, external_cluster, cfg, levels, "write_rank", 60.0)
    lines, err = _run(root, external_cluster, dict(cfg=cfg, levels=levels, steps=1, salt=1, finalize=True))
    assert [w[:2] for w in lines if w[0] in ("R", "C", "FINALIZED")] == [["R", "2"], ["C", "3"], ["FINALIZED"]], (
        f"{lines}\n{err[-6000:]}")
    (marks / "release").touch()
    _wait_marks(marks, "done", NWORKERS, timeout=180)
    time.sleep(1)
    _no_leftovers(root, cfg, "after the orphans of the dead client ended, the run finalized")


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_orphan_writes_of_a_dead_client(tmp_path, external_cluster, level):
    orphan_case(tmp_path / "run", external_cluster, dict(group_size=3), [level])


@pytest.mark.slow
@pytest.mark.parametrize("level", [5, 8])
def test_orphaned_differential_writes(tmp_path, external_cluster, level):
    """Differential checkpoints patch a spare in place, a file of the run that outlives every checkpoint: the dead
    client's write tasks are held with their spare open (inside the patch), and the restart writes its differential
    checkpoint 3 meanwhile, on the same workers. The orphans, let go, patch what they claimed before the take-over
    (in their own checkpoint's directory, removed), never the restart's checkpoint 3: a third run recovers it bit for
    bit, and nothing is left. (Before, the orphan and the restart patched one file, the spare: the restart renamed it
    into its checkpoint 3 and committed it, and the orphan's blocks and metadata went on into it.)"""
    orphan_case(tmp_path / "run", external_cluster, dict(group_size=3, enable_dcp=True), [level],
                what="ftidask.dcp.files.write_dcp_file")


@pytest.mark.slow
@pytest.mark.parametrize(("level", "what"), [(6, "ftidask.levels.partner_delta.protect"),
                                             (7, "ftidask.levels.rs_delta.update")])
def test_orphaned_differential_partner_and_parity_steps(tmp_path, external_cluster, level, what):
    """The L2/L3 step of a differential checkpoint patches a spare too (the partner copy a worker holds, its parity):
    the dead client's step is held on every worker once it claimed it (inside the level code, before its first
    collective), and the restart writes its checkpoint 3 at the same level meanwhile (the spares gone: whole files,
    parity encoded anew). The orphans, let go, finish in their own directories: the restart's checkpoint 3 comes
    back bit for bit, and nothing is left."""
    orphan_case(tmp_path / "run", external_cluster, dict(group_size=3, enable_dcp=True), [level], what=what)


def test_a_spare_is_claimed_by_one_client_only(tmp_path):
    """On a worker: a task claims a spare (renames it into its checkpoint's directory) under the fence lock. Once the
    run is taken over, a task of the dead client claims nothing (its directory goes, the spare stays for the new
    client's task); a take-over waits for a claim in progress."""
    import threading

    from ftidask.backends.dask import fence

    run = str(tmp_path / "M" / "run")
    spare = tmp_path / "dcp" / "SpareRSed-Rank0.fti"
    spare.parent.mkdir()
    spare.write_bytes(b"parity")
    record = spare.with_name(spare.name + ".hash")
    record.write_text("{}")

    def claim(into: Path) -> list[bool]:
        into.mkdir(exist_ok=True)
        return fence.claim([(spare, into / spare.name), (record, into / record.name)])

    old, new = tmp_path / "ckpt3.s3", tmp_path / "ckpt3.s65"
    fence.take_over(run, "dead")
    inside, leave = threading.Event(), threading.Event()

    def held() -> None:  # the dead client's task, in the fence lock when its client dies
        with fence.exclusive():
            inside.set()
            leave.wait()

    orphan = threading.Thread(target=fence.call, args=(held, run, "dead", ()))
    orphan.start()
    inside.wait()
    taking = threading.Thread(target=fence.take_over, args=(run, "restart"))
    taking.start()
    taking.join(0.2)
    assert taking.is_alive(), "the take-over did not wait for the claim in progress"
    leave.set()
    orphan.join()
    taking.join()
    with pytest.raises(fence.OrphanedTask):
        fence.call(claim, run, "dead", [str(old)], old)
    assert not old.exists() and spare.read_bytes() == b"parity" and record.exists()
    assert fence.call(claim, run, "restart", [str(new)], new) == [True, True]
    assert (new / spare.name).read_bytes() == b"parity" and not spare.exists() and not record.exists()
    assert fence.call(claim, run, "restart", [str(new)], new) == [False, False]  # none left: written in full
    assert fence.owner() is None


def test_sequence_numbers_of_a_dead_client_are_never_used_again(tmp_path):
    """The numbers a client took (durably reserved before its tasks are submitted) are never taken again by the
    client of a restart, committed or not, nor twice by one client (a failed checkpoint's are not reused)."""
    from ftidask.engine.runstate import SEQ_BLOCK, RunState, SeqReservation

    state = RunState(tmp_path, "run1")
    state.write_run(state="running")
    first = SeqReservation(state)
    taken = [first.take() for _ in range(3)]  # none committed: three failed checkpoints, say
    assert taken == [1, 2, 3]
    restart = SeqReservation(RunState(tmp_path, "run1"))  # the client killed, the run restarted
    again = restart.take()
    assert again > max(taken) and again == SEQ_BLOCK + 1
    assert restart.take() == again + 1
    assert first.take() == 4  # an older Context of the run still checkpointing: within its own block
    for _ in range(SEQ_BLOCK - 4):
        first.take()
    assert first.take() == 2 * SEQ_BLOCK + 1  # its block used up: the next one lies past the restart's
