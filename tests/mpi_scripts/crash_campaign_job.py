"""Rank script of tests/test_crash_campaign.py: a run on P ranks, one of them SIGKILLed at a chosen event.

usage: crash_campaign_job.py BASE JSON. JSON: ``mode`` (``async``: ``wait=False``, several in flight; ``sync``; ``icp``;
``verify``: recover, checkpoint once, finalize), ``levels``, ``steps``, ``cfg`` (init keywords), ``kill``
({rank: n}: that rank kills itself at the n-th event of ftidask's code, see ``_crash_campaign_child.KillAt``),
``point`` ([rank, "module:function", n]: a crash point of ``crashpoints`` on that rank), ``stripe`` (bytes of each
member's deltas a differential L3 exchanges at once, ``rs_delta.STRIPE``: small, a checkpoint takes many stripes),
``xor_in_memory`` (bytes of a member's delta held in memory, ``dcp.files.XOR_IN_MEMORY``: past them, in a scratch file).
Each rank protects its block of a global 1-D float64 array and of a global int32 array (``global_shape`` /
``offset``: a restart on another number of ranks redistributes them) and a replicated step counter. The state of
step ``s`` is a function of ``s``. Rank 0 prints ``R <id> exact|MIX`` (every rank's check, agreed) after a
recovery (``R none <error>``: nothing to recover), ``C <id>`` once a checkpoint is committed; at the end each rank
writes its count of events to ``BASE/events-<rank>``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ftidask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _crash_campaign_child import KillAt  # noqa: E402

N_A, N_B = 1 << 20, 60_001


def values(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.integers(-1000, 1000, N_A).astype(np.float64), rng.integers(0, 99, N_B).astype(np.int32)


def main() -> None:
    base, spec = sys.argv[1], json.loads(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    killer = KillAt(int(spec.get("kill", {}).get(str(rank), 0)), spec.get("only_os", False))
    threading.setprofile(killer)
    sys.setprofile(killer)
    if spec.get("point") and spec["point"][0] == rank:  # [rank, "module:function", n]: a crash point there
        import crashpoints

        crashpoints.install(spec["point"][1], spec["point"][2])
    if spec.get("stripe"):  # a test seam: the module's constant
        from ftidask.levels import rs_delta

        rs_delta.STRIPE = int(spec["stripe"])
    if "xor_in_memory" in spec:  # a test seam: the module's constant
        from ftidask.dcp import files

        files.XOR_IN_MEMORY = int(spec["xor_in_memory"])
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", local_test=1,
                       node_size=1, group_size=size, verbosity=4, **spec["cfg"])
    la, ha = N_A * rank // size, N_A * (rank + 1) // size
    lb, hb = N_B * rank // size, N_B * (rank + 1) // size
    a, b, step = np.zeros(ha - la), np.zeros(hb - lb, np.int32), np.zeros(1, np.int64)
    ctx.protect(1, a, global_shape=(N_A,), offset=(la,))
    ctx.protect(2, b, global_shape=(N_B,), offset=(lb,))
    ctx.protect(3, step, replicated=True)

    def fill(s: int) -> None:
        va, vb = values(s)
        a[:], b[:] = va[la:ha], vb[lb:hb]
        step[0] = s

    def say(*words: Any) -> None:
        if rank == 0:
            print(*words, flush=True)

    if ctx.status() != 0:
        ctx.recover()
        s = int(step[0])
        va, vb = values(s)
        exact = comm.allreduce(a.tobytes() == va[la:ha].tobytes() and b.tobytes() == vb[lb:hb].tobytes(), MPI.LAND)
        say("R", s, "exact" if exact else "MIX", ctx.recovered_from[0])
    elif spec["mode"] == "verify":
        try:
            ctx.recover()
            say("R", "none", "recovered-from-nothing")
        except ftidask.FTIError as exc:
            say("R", "none", type(exc).__name__)
    levels, mode = spec["levels"], spec["mode"]
    handles: list[Any] = []
    first = int(step[0]) + 1
    for s in range(first, first + (1 if mode == "verify" else spec["steps"])):
        fill(s)
        level = levels[s % len(levels)]
        if mode == "icp":  # incremental: the arrays changed between adds, the checkpoint holds them as added
            with ctx.incremental(s, level) as icp:
                for vid in (2, 1, 3):
                    icp.add(vid)
                    if vid == 1:
                        a[::3] = -7.0
            fill(s)
            say("C", s)
        elif mode == "async":
            handles.append((s, ctx.checkpoint(s, level, wait=False)))
            a[:] = -1.0  # the checkpoint holds the values of the call
            b[::5] = -1
            while len(handles) > 2:
                done, h = handles.pop(0)
                h.result()
                say("C", done)
        else:
            ctx.checkpoint(s, level)
            say("C", s)
    for done, h in handles:
        h.result()
        say("C", done)
    if spec.get("finalize", True):
        ctx.finalize()
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    with open(f"{base}/events-{rank}", "w") as fh:  # not on stdout: the ranks' lines may be interleaved there
        fh.write(str(killer.count))


if __name__ == "__main__":
    main()
