"""Process script of tests/test_crash_heads.py: a run with heads (``head = 1``), SIGKILLed at a chosen event.

usage: heads_crash_job.py BASE JSON. JSON: ``cfg`` (init keywords: ``node_size``, ``group_size``, ``inline_lN``...),
``mode`` (``sync``; ``async``: ``wait=False``, the handle waited for at the next step; ``verify``: recover, one
checkpoint, finalize), ``levels``, ``steps``, ``finalize``, ``stage`` (output files each application rank stages
through its head, asked for after its first checkpoint and waited for at the end; those already at their
destination are not staged again), ``only_os`` and ``kill``
({world rank: n}: that process, an application rank or a head, kills itself at the n-th event of ftidask's code,
see ``_crash_campaign_child.KillAt``), ``point`` ([world rank, "module:function", n]: a crash point of
``crashpoints`` in that process), ``error`` (the application ranks end with an uncaught exception instead of
finalize). Heads count their events too: ``init`` serves there until the application
ends (SystemExit).

Each application rank protects an array whose value at step ``s`` is a function of the rank and ``s`` (a few
blocks change from one step to the next: the heads update an L3 parity from the differences) and a step counter.
Rank 0 of the application prints ``R <id> exact|MIX <id recovered from>`` after a recovery (every rank's check,
agreed; ``R none <error>``: nothing to recover), ``C <id>`` once a checkpoint is committed (at L1: its head raises
it) and ``S <rank> <request> <state>`` per staged file. At exit every process writes its count of events to
``BASE/events-<world rank>``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _crash_campaign_child import KillAt  # noqa: E402

import ftidask  # noqa: E402

N = 1 << 17  # float64 per rank: 1 MiB
WORLD = MPI.COMM_WORLD.rank


def values(rank: int, step: int) -> np.ndarray:
    """The array of ``rank`` at ``step``: a base, with 4 KiB blocks that each step since the first rewrote."""
    out = np.random.default_rng(1000 + rank).integers(-1000, 1000, N).astype(np.float64)
    for s in range(1, step + 1):
        for j in np.random.default_rng(s * 31 + rank).integers(0, N // 512, 3):
            out[j * 512:(j + 1) * 512] = s + 0.5 * rank
    return out


def staged(rank: int, k: int) -> bytes:
    """The bytes of output file ``k`` of ``rank`` (staged to the global directory by the node's head)."""
    return np.random.default_rng(5000 + 10 * rank + k).bytes((1 << 20) + 4096 * k + 17)


def main() -> None:
    base, spec = sys.argv[1], json.loads(sys.argv[2])
    killer = KillAt(int(spec.get("kill", {}).get(str(WORLD), 0)), spec.get("only_os", False))

    def count() -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        with open(f"{base}/events-{WORLD}", "w") as fh:  # not on stdout: the lines of the ranks interleave there
            fh.write(str(killer.count))

    os.makedirs(base, exist_ok=True)
    if spec.get("point") and spec["point"][0] == WORLD:
        import crashpoints

        crashpoints.install(spec["point"][1], spec["point"][2])
    atexit.register(count)  # a head leaves init by SystemExit
    threading.setprofile(killer)
    sys.setprofile(killer)
    ctx = ftidask.init(comm=MPI.COMM_WORLD, ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M",
                       local_test=1, head=1, **{"verbosity": 4, **spec["cfg"]})
    comm, rank = ctx.comm, ctx.comm.rank
    a, step = np.zeros(N), np.zeros(1, np.int64)
    ctx.protect(1, a)
    ctx.protect(2, step)

    def say(*words: Any) -> None:
        if rank == 0:
            print(*words, flush=True)

    if ctx.status() != 0:
        ctx.recover()
        s = int(step[0])
        exact = comm.allreduce(a.tobytes() == values(rank, s).tobytes(), MPI.LAND)
        say("R", s, "exact" if exact else "MIX", ctx.recovered_from[0], ctx.recovered_from[1])
    elif spec["mode"] == "verify":
        try:
            ctx.recover()
            say("R", "none", "recovered-from-nothing")
        except ftidask.FTIError as exc:
            say("R", "none", type(exc).__name__)
    levels, mode = spec["levels"], spec["mode"]
    requests: list[int] = []
    handle: Any = None
    first = int(step[0]) + 1
    for s in range(first, first + (1 if mode == "verify" else spec["steps"])):
        a[:] = values(rank, s)
        step[0] = s
        level = levels[s % len(levels)]
        if mode == "async":
            if handle is not None:
                handle.result()
                say("C", s - 1)
            handle = ctx.checkpoint(s, level, wait=False)
            a[:] = -1.0  # the checkpoint holds the values of the call
        else:
            ctx.checkpoint(s, level)
            say("C", s)
        if s == first and spec.get("stage"):
            requests += stage(ctx, base, rank, spec["stage"])
    if handle is not None:
        handle.result()
        say("C", first + spec["steps"] - 1)
    if requests:
        ctx.wait_staged(timeout=120)
        for req in requests:
            print("S", rank, req, ctx.stage_status(req), flush=True)
    if spec.get("error"):  # the application dies of an uncaught error, without finalize
        raise RuntimeError("the application failed")
    if spec.get("finalize", True):
        ctx.finalize()
    else:
        ctx.wait_post_processing()
        ctx.transport.close()  # no finalize: the checkpoints stay for the restart


def stage(ctx: Any, base: str, rank: int, count: int) -> list[int]:
    """Stage this rank's output files that are not at their destination yet (a restart stages the rest again)."""
    requests = []
    for k in range(count):
        local = ctx.stage_dir() / f"r{rank}-f{k}.bin"
        if os.path.exists(f"{base}/G/out/r{rank}-f{k}.bin"):  # published; the kill may have come before the
            local.unlink(missing_ok=True)  # local copy went
            continue
        with open(local, "wb") as fh:
            fh.write(staged(rank, k))
        requests.append(ctx.send_file(local, f"out/r{rank}-f{k}.bin"))
    return requests


if __name__ == "__main__":
    main()
