"""Child process of tests/test_dask_crash_campaign.py: one run of a Dask program, its client or a worker SIGKILLed.

Usage: python _dask_crash_child.py ROOT JSON. The child starts its own LocalCluster (worker processes, one thread
each) and client, then runs ``ftidask.init(client=...)`` on ROOT's directories. JSON holds ``cfg`` (the init
keywords), ``nworkers``, ``mode`` (``sync``; ``async``: ``wait=False`` with the handles kept, two in flight;
``icp``: incremental; ``verify``: recover, print what came back, checkpoint once more and finalize), ``levels``,
``steps``, ``finalize``, and where the kill lands:

* ``kill``: the n-th event of ftidask's code in the client process (every thread: the client's own, the event loop's
  and the async checkpoints'), at which the client kills itself (its LocalCluster dies with it); 0: never;
* ``wkill``: the n-th event of ftidask's code in the worker process of rank ``wrank`` (its event loop, where the
  level channels run, its task threads, its removal thread), counted from just before ``init``, at which that
  worker kills itself; its nanny restarts it, and the run goes on (a checkpoint that fails says so: ``F <id>``).
* ``wpoint``: ``["module:function[:after]", n]``, a named crash point (``crashpoints.install``) on the worker of rank
  ``wrank``; ``W before <pids>`` and ``W after <pids>`` give the workers' process ids before and after the run.

An event is a call or a return of one of ftidask's functions, or of a C function (``os.replace``, ``os.fsync``...)
called from one; with ``only_os``, only the calls of os functions and their returns count.

The state of step ``s`` is a function of ``s``, computed from the array a checkpoint handed back (its lineage cut:
``ctx.protected``) or a recovery returned: what a restart recovers is checked bit for bit. Prints ``R <id> exact|MIX``
after a recovery (``R none <error>`` when there was nothing to recover), ``C <id>`` once a checkpoint is committed,
``F <id> <error>`` for a checkpoint that failed, ``events <client events> <worker events>`` at the end.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import sys
import threading
from typing import Any

import numpy as np

SHAPE, CHUNKS = (120, 100), (40, 50)  # 6 chunks of float64
N_B, CHUNK_B = 77, 20  # 4 chunks of int32


class KillAt:
    """A profiler that kills this process at the n-th event of ftidask's code (every thread)."""

    EVENTS = ("call", "return", "c_call", "c_return")

    def __init__(self, nth: int, only_os: bool = False) -> None:
        self.nth, self.counter = nth, itertools.count(1)  # next() is atomic: safe across threads
        self.count, self.only_os = 0, only_os

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.only_os and (event not in ("c_call", "c_return") or getattr(arg, "__module__", None) != "posix"):
            return
        if event in self.EVENTS and (frame.f_globals.get("__name__") or "").startswith("ftidask"):
            self.count = next(self.counter)
            if self.count == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def arm(nth: int, only_os: bool) -> int:
    """On a worker (``client.run``: its event loop thread): count its events from now, in every thread."""
    killer = KillAt(nth, only_os)
    sys.modules["builtins"].__dict__["_dask_crash_killer"] = killer  # found again by arm_thread and count_events
    threading.setprofile(killer)
    sys.setprofile(killer)
    return os.getpid()


def arm_thread() -> None:
    """A task on the worker: its task thread counts too."""
    sys.setprofile(sys.modules["builtins"].__dict__["_dask_crash_killer"])


def count_events() -> int:
    killer = sys.modules["builtins"].__dict__.get("_dask_crash_killer")
    return killer.count if killer is not None else -1


def initial() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 1000, SHAPE).astype(np.float64), rng.integers(0, 99, N_B).astype(np.int32)


def values(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The state after step ``step`` (exact: small integers)."""
    a, b = initial()
    for s in range(1, step + 1):
        a, b = (a * 3 + s) % 1000003, (b + s) % 1009
    return a, b


def say(*words: Any) -> None:
    print(*words, flush=True)


def main() -> None:
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps the stacks of a child it calls hung
    import dask.array as da
    import distributed

    import ftidask

    cluster = distributed.LocalCluster(n_workers=spec.get("nworkers", 3), threads_per_worker=1, processes=True,
                                       dashboard_address=":0", silence_logs=50)
    client = distributed.Client(cluster)
    client.wait_for_workers(spec.get("nworkers", 3), timeout=60)
    victim = None
    if "wkill" in spec:
        victim = sorted(client.run(os.getpid))[spec.get("wrank", 0)]
        client.run(arm, spec["wkill"], spec.get("only_os", False), workers=[victim])
        client.submit(arm_thread, workers=[victim], allow_other_workers=False, pure=False).result(timeout=60)
    if spec.get("wpoint"):  # ["module:function[:after]", n]: a named crash point on the worker of rank wrank
        import crashpoints

        victim = sorted(client.run(os.getpid))[spec.get("wrank", 0)]
        client.run(crashpoints.install, *spec["wpoint"], workers=[victim])
        say("W", "before", *sorted(client.run(os.getpid).values()))
    killer = KillAt(spec.get("kill", 0), spec.get("only_os", False))
    threading.setprofile(killer)
    sys.setprofile(killer)
    ctx = ftidask.init(client=client, ckpt_dir=root + "/L", glbl_dir=root + "/G", meta_dir=root + "/M", verbosity=4,
                       **spec["cfg"])
    a0, b0 = initial()
    x, y = da.from_array(a0, chunks=CHUNKS), da.from_array(b0, chunks=CHUNK_B)
    step = np.zeros(1, np.int64)
    ctx.protect(1, x, name="field")
    ctx.protect(2, y, name="counts")
    ctx.protect(3, step)
    if ctx.status() != 0:
        try:
            arrays = ctx.recover()
        except ftidask.FTIError as exc:  # a worker killed during the recovery: said, never a mix
            say("R", "failed", type(exc).__name__, str(exc).replace("\n", " ")[:300])
            raise SystemExit(3) from None
        s = int(step[0])
        want = values(s)
        ra, rb = client.compute([arrays[1], arrays[2]], sync=True)
        exact = ra.tobytes() == want[0].tobytes() and rb.tobytes() == want[1].tobytes()
        say("R", s, "exact" if exact else "MIX", ctx.recovered_from[0])
        x, y = arrays[1], arrays[2]
        ctx.protect(1, x)
        ctx.protect(2, y)
    elif spec["mode"] == "verify":
        try:
            ctx.recover()
            say("R", "none", "recovered-from-nothing")
        except ftidask.FTIError as exc:
            say("R", "none", type(exc).__name__)
    levels, mode = spec["levels"], spec["mode"]
    steps = 1 if mode == "verify" else spec["steps"]
    handles: list[Any] = []
    first = int(step[0]) + 1
    for s in range(first, first + steps):
        x, y = (x * 3 + s) % 1000003, (y + s) % 1009
        step[0] = s
        ctx.protect(1, x)
        ctx.protect(2, y)
        level = levels[s % len(levels)]
        try:
            if mode == "icp":
                with ctx.incremental(s, level) as icp:
                    for vid in (2, 3, 1):
                        icp.add(vid)
                say("C", s)
            elif mode == "async":
                handles.append((s, ctx.checkpoint(s, level, wait=False)))
                while len(handles) > 2:
                    done, h = handles.pop(0)
                    h.result()
                    say("C", done)
            else:
                ctx.checkpoint(s, level)
                say("C", s)
        except ftidask.CheckpointError as exc:
            say("F", s, type(exc).__name__, str(exc).replace("\n", " ")[:300])
        x, y = ctx.protected[1], ctx.protected[2]  # the lineage cut there (or the arrays as they were)
    for done, h in handles:
        try:
            h.result()
            say("C", done)
        except ftidask.CheckpointError as exc:
            say("F", done, type(exc).__name__, str(exc).replace("\n", " ")[:300])
    if spec.get("finalize", True):
        ctx.finalize()
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    worker_events = -1
    # Only a victim still listed: the scheduler dials an address it is given until its connect timeout (30 s), and a
    # killed worker's is gone from its own list within milliseconds.
    if victim is not None and victim in client.sync(client.scheduler.identity)["workers"]:
        try:
            worker_events = client.run(count_events, workers=[victim]).get(victim, -1)
        except Exception:  # noqa: BLE001 - killed, restarted under another address
            worker_events = -1
    if spec.get("wpoint"):
        say("W", "after", *sorted(client.run(os.getpid).values()))
    say("events", killer.count, worker_events)
    client.close()
    cluster.close()


if __name__ == "__main__":
    main()
