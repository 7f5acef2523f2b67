"""Rank script of the heads fault tests: checkpoints post-processed by heads, processes killed, restarts.

usage: heads_fault_job.py write CONFIG_JSON DIR LEVELS [KILL]    (checkpoints 1, 2, ... at LEVELS, "2,3,...")
       heads_fault_job.py recover CONFIG_JSON DIR

CONFIG_JSON: the config (``head``, ``node_size``, ``inline_lN``, ...); ``"wait": false`` writes asynchronously,
``"finalize": true`` ends the write with ``finalize`` (no wait for the heads first), else the job ends without one;
``"resume": true`` recovers first (on a restart) and numbers the checkpoints on from the one recovered;
``"rollback": true`` calls ``recover()`` right after the last checkpoint (its head still raising it), with two
seams that open the race: the heads' root holds the last commit until a moment after the application asks to recover, and an
application rank that checks an L1 file waits until it is gone (a head removed it); it prints
``ROLLBACK <rank> <recovered_from> <same>``;
``"damage": "corrupt"|"truncate"``: application rank 0 damages its L1 file of the last checkpoint (a byte flipped in
its data, or the file cut short) before its head raises it (a seam holds each head's raise of it until then);
``"poll": true`` polls ``post_processing_done`` after each checkpoint call (the handle not waited for), then prints
``POLL <rank> <ckpt> <its level in the commit records when done said so> <done before the first poll's answer>``
(a seam holds each background checkpoint until that first poll has answered: the checkpoint is then still in flight).
KILL: ``W:module:function[:after][@N]`` installs a crash point (tests/crashpoints.py) in world rank W: the process is
SIGKILLed at the N-th call (the job is torn down); ``app:K`` kills the last application rank right after
checkpoint K returns (its head still working). Each checkpoint c holds ``data(rank, c)``.
The write prints ``WROTE <rank> <ckpt> <level written> <reply>`` per checkpoint; the recover writes
``DIR/result-<world rank>.json``: {"status", "source", "same", "error"} (application ranks only).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: crashpoints
import crashpoints  # noqa: E402

import ftidask  # noqa: E402

WORLD = MPI.COMM_WORLD.rank


def data(rank: int, c: int) -> np.ndarray:
    return np.arange(30000 + 1000 * rank, dtype=np.float64) * (rank + 1) + c


def dirs(base: str) -> dict[str, str]:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}


def level_on_disk(base: str, ckpt_id: int) -> int | None:
    """The level of checkpoint ``ckpt_id`` in the commit records now (None: not committed)."""
    for path in Path(base, "Meta").glob("*/commits/s*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced while read: the head rewrites it
            continue
        if record["ckpt_id"] == ckpt_id:
            return int(record["level"])
    return None


def wait_for(done: Callable[[], bool], seconds: float) -> None:
    """Poll ``done`` for at most ``seconds`` (a seam that waits in vain lets the job go on, it never hangs it)."""
    for _ in range(int(seconds * 100)):
        if done():
            return
        time.sleep(0.01)


def race_seams(base: Path, last: int) -> None:
    """The seams of ``rollback``: see the usage above."""
    from ftidask.engine import recovering, runstate

    if WORLD == 0:  # the heads' root (a head: init never returns there)
        write_record = runstate.RunState.write_record

        def held(self: Any, record: Any) -> Any:
            if record.ckpt_id == last:  # raising the last checkpoint: once the application calls recover(),
                wait_for((base / "recovering").exists, 20)  # give it a moment to read the records first
                time.sleep(1)
            return write_record(self, record)

        runstate.RunState.write_record = held  # type: ignore[method-assign]
    check_file = recovering.check_file

    def checked(path: Path, *args: Any, **kwargs: Any) -> Any:
        if "/l1/" in str(path):  # an L1 file while a head raises its checkpoint: wait until the head removed it
            wait_for(lambda: not Path(path).exists(), 20)
        return check_file(path, *args, **kwargs)

    recovering.check_file = checked  # type: ignore[assignment]


def damage_seam(base: Path, last: int) -> None:
    """The heads' seam of ``damage``: each head raises checkpoint ``last`` only once rank 0 has damaged its file."""
    from ftidask.backends.mpi import heads

    raise_ = heads._raise

    def held(cfg: Any, t: Any, job: Any, state: Any) -> Any:
        if job.record.ckpt_id == last:
            wait_for((base / "damaged").exists, 30)
        return raise_(cfg, t, job, state)

    heads._raise = held  # type: ignore[assignment]


def damage(base: Path, ckpt_id: int, how: str) -> None:
    """Application rank 0's L1 file of ``ckpt_id``: a byte flipped in its middle, or cut to 100 bytes."""
    (path,) = Path(base).glob(f"Local/node*/*/l1/ckpt{ckpt_id}.*/Ckpt{ckpt_id}-Rank0.fti")
    if how == "truncate":
        os.truncate(path, 100)
    else:
        with open(path, "r+b") as fh:
            fh.seek(path.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    Path(base, "damaged").touch()


def poll_gate() -> threading.Semaphore:
    """The seam of ``poll``: each checkpoint's background job waits for a permit, released after the first poll."""
    from ftidask.engine import commit

    permits = threading.Semaphore(0)
    checkpoint = commit.Committer.checkpoint

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():  # the background thread's checkpoint
            permits.acquire(timeout=60)  # bounded: a poll that never comes fails the test, it never hangs it
        return checkpoint(self, *args, **kwargs)

    commit.Committer.checkpoint = held  # type: ignore[method-assign]
    return permits


def write(cfg: dict, base: str, levels: list[int], kill: str) -> None:
    app_kill = 0
    if kill.startswith("app:"):
        app_kill = int(kill[4:])
    elif kill:
        who, point = kill.split(":", 1)
        point, _, nth = point.partition("@")
        if int(who) == WORLD:
            crashpoints.install(point, int(nth or 1))
    wait, finalize, poll = cfg.pop("wait", True), cfg.pop("finalize", False), cfg.pop("poll", False)
    resume, rollback = cfg.pop("resume", False), cfg.pop("rollback", False)
    how = cfg.pop("damage", "")
    if how:
        damage_seam(Path(base), len(levels))
    if rollback:
        race_seams(Path(base), len(levels))
    permits = poll_gate() if poll else None
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg, **dirs(base))
    rank = ctx.comm.rank
    a = data(rank, 0)
    ctx.protect(1, a)
    start = 0
    if resume and ctx.status():  # a restart: go on after the checkpoint recovered
        ctx.recover()
        start = ctx.recovered_from[0]
        assert np.array_equal(a, data(rank, start)), "recovered arrays differ"
    for c, level in enumerate(levels, start + 1):
        a[:] = data(rank, c)
        info = ctx.checkpoint(c, level, wait=wait)
        if poll:
            first = ctx.post_processing_done()
            permits.release()
            for _ in range(200_000):  # bounded: a done that never comes fails the test, not hangs it
                if ctx.post_processing_done():
                    break
                time.sleep(0.001)
            print(f"POLL {ctx.comm.rank} {c} {level_on_disk(base, c)} {first}", flush=True)
        if not wait:
            a[:] = -1.0
            info = info.result()
            a[:] = data(rank, c)
        if how and c == start + len(levels) and rank == 0:
            damage(Path(base), c, how)
        if c == app_kill and rank == ctx.comm.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the head of its node is raising checkpoint c now
        reply = None if (finalize or rollback) and c == start + len(levels) else ctx.wait_post_processing()
        print(f"WROTE {rank} {c} {info.level} {json.dumps(reply)}", flush=True)
    if rollback:
        Path(base, "recovering").touch()
        ctx.recover()
        c = ctx.recovered_from[0]
        print(f"ROLLBACK {rank} {list(ctx.recovered_from)} {np.array_equal(a, data(rank, c))}", flush=True)
    if finalize:
        ctx.finalize()
    else:
        ctx.transport.close()  # no finalize: the checkpoints stay for the restart


def recover(cfg: dict, base: str) -> None:
    for key in ("wait", "finalize", "poll", "resume", "rollback", "damage"):
        cfg.pop(key, None)
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **cfg, **dirs(base))
    rank = ctx.comm.rank
    a = np.zeros_like(data(rank, 0))
    ctx.protect(1, a)
    out: dict = {"status": "ok", "rank": rank}
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        out.update(status="fail", error=f"{type(exc).__name__}: {exc}", untouched=not a.any())
    else:
        c = ctx.recovered_from[0]
        out.update(source=list(ctx.recovered_from), same=bool(np.array_equal(a, data(rank, c))))
    Path(base, f"result-{WORLD}.json").write_text(json.dumps(out))
    ctx.transport.close()


def main() -> None:
    mode, cfg, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if mode == "write":
        write(cfg, base, [int(x) for x in sys.argv[4].split(",")], sys.argv[5] if len(sys.argv) > 5 else "")
    else:
        recover(cfg, base)


if __name__ == "__main__":
    main()
