"""Child process of tests/test_crash_campaign.py: one run of a checkpointing program, SIGKILLed at a chosen event.

Usage: python _crash_campaign_child.py ROOT JSON. JSON holds ``cfg`` (the init keywords), ``mode`` (``sync``,
``async``: ``wait=False`` with the handles kept, several in flight; ``icp``: incremental, the arrays changed
between adds; ``verify``: recover, print what came back, checkpoint once more and finalize), ``levels``,
``steps``, ``finalize``, ``stage`` (output files to stage), ``many`` (that many small variables protected beside
the others, of several dtypes and sizes), ``compressor`` (every array's, e.g. ``zstd``), ``rollback`` (after the
checkpoints, the arrays in use overwritten and recovered again in the run, ``B <id> exact|MIX`` printed) and
``kill`` (the n-th event of ftidask's code, counted in every thread, at which the process kills itself; 0: never).
An event is a call or a return of one of ftidask's functions, or a call or a return of a C function
(``os.replace``, ``os.fsync``...) from one: the kill lands anywhere, between two renames too; with ``only_os``,
only the calls of os functions and their returns count. The state of step ``s`` is a function of ``s``: what a
restart recovers is checked bit for bit.

Prints ``R <id> exact|MIX`` after a recovery (``R none <error>`` when there was nothing to recover),
``C <id>`` once a checkpoint is committed, and ``events <n>`` at the end.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
from typing import Any

import numpy as np

import ftidask

N_A, N_B = 3 << 20, 70_001  # a: 24 MiB of float64 (fresh: recovered by moving pages), b: int32


class KillAt:
    """A profiler that kills this process at the n-th event of ftidask's code (every thread)."""

    EVENTS = ("call", "return", "c_call", "c_return")

    def __init__(self, nth: int, only_os: bool = False) -> None:
        self.nth, self.counter = nth, itertools.count(1)  # next() is atomic: safe across threads
        self.count, self.only_os = 0, only_os

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.only_os and (event not in ("c_call", "c_return") or getattr(arg, "__module__", None) != "posix"):
            return  # only the calls of os functions (open, write, fsync, replace, link, unlink...) and their returns
        if event in self.EVENTS and (frame.f_globals.get("__name__") or "").startswith("ftidask"):
            self.count = next(self.counter)
            if self.count == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def values(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.integers(-1000, 1000, N_A).astype(np.float64), rng.integers(0, 99, N_B).astype(np.int32)


SMALL_DTYPES = (np.float64, np.int32, np.uint8, np.float32, np.int16)


def small_arrays(count: int) -> list[np.ndarray]:
    """``count`` small arrays (0 to 96 elements, several dtypes), protected as variables 10...: their shapes and
    dtypes are the same at every step, their values a function of the step (:func:`fill_small`)."""
    return [np.zeros(k % 97, SMALL_DTYPES[k % len(SMALL_DTYPES)]) for k in range(count)]


def fill_small(arrays: list[np.ndarray], step: int) -> None:
    for k, x in enumerate(arrays):
        x[:] = (np.arange(x.size) * 7 + k * 31 + step * 1009) % 101


def small_exact(arrays: list[np.ndarray], step: int) -> bool:
    want = [x.copy() for x in arrays]
    fill_small(want, step)
    return all(x.tobytes() == w.tobytes() for x, w in zip(arrays, want))


def staged(k: int) -> bytes:
    """The bytes of output file ``k`` (staged to the global directory)."""
    return np.random.default_rng(1000 + k).bytes((2 << 20) + 4096 * k + 17)


def stage_files(ctx: Any, root: str, count: int) -> None:
    """Stage output files 0..count-1 that are not at their destination yet (a restart stages the rest again)."""
    requests = []
    for k in range(count):
        local = ctx.stage_dir() / f"f{k}.bin"
        if os.path.exists(f"{root}/G/out/f{k}.bin"):  # published; a kill may have come before the local copy went
            local.unlink(missing_ok=True)
            continue
        with open(local, "wb") as fh:
            fh.write(staged(k))
        requests.append(ctx.send_file(local, f"out/f{k}.bin"))
    ctx.wait_staged(timeout=120)
    for req in requests:
        say("S", req, ctx.stage_status(req))


def say(*words: Any) -> None:
    print(*words, flush=True)


def main() -> None:
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    killer = KillAt(spec.get("kill", 0), spec.get("only_os", False))
    threading.setprofile(killer)
    sys.setprofile(killer)
    from ftidask.engine import pagemove
    ctx = ftidask.init(ckpt_dir=root + "/L", glbl_dir=root + "/G", meta_dir=root + "/M", verbosity=4, **spec["cfg"])
    a, b, step = np.zeros(N_A), np.zeros(N_B, np.int32), np.zeros(1, np.int64)
    state = ftidask.State({"step": 0})
    compressor = spec.get("compressor")
    for vid, x in enumerate((a, b, step, state)):
        ctx.protect(vid + 1, x, compressor=compressor if vid < 2 else None)
    small = small_arrays(spec.get("many", 0))
    for k, x in enumerate(small):
        ctx.protect(10 + k, x, compressor=compressor)

    def exact_at(s: int) -> bool:
        want = values(s)
        return (a.tobytes() == want[0].tobytes() and b.tobytes() == want[1].tobytes() and state["step"] == s
                and small_exact(small, s))

    if ctx.status() != 0:
        ctx.recover()
        s = int(step[0])
        exact = exact_at(s)
        say("R", s, "exact" if exact else "MIX", ctx.recovered_from[0])
        say("P", pagemove.stats["moved_bytes"])  # the recovery moved verified pages under the fresh array
        if spec.get("scope") == "recover":  # only the start and the recovery are killed
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            say("events", killer.count)
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
        a[:], b[:] = values(s)
        fill_small(small, s)
        step[0] = state["step"] = s
        level = levels[s % len(levels)]
        if mode == "icp":
            with ctx.incremental(s, level) as icp:
                for vid in (2, 1, 4, 3, *range(10, 10 + len(small))):
                    icp.add(vid)
                    if vid == 1:
                        a[::3] = -7.0  # written: the checkpoint holds the values at the add
                    elif vid >= 10:
                        small[vid - 10][:] = 3  # likewise
                a[:], b[:] = values(s)
                fill_small(small, s)
            say("C", s)
        elif mode == "async":
            handles.append((s, ctx.checkpoint(s, level, wait=False)))
            a[:] = -1.0  # the checkpoint holds the values of the call
            b[::5] = -1
            for x in small[::3]:
                x[:] = 5
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
    if spec.get("rollback") and steps:  # recovered again into the arrays in use, overwritten first
        a[:], b[::7], step[0] = 3.0, 9, -1
        state["step"] = -1
        for x in small:
            x[:] = 1
        ctx.recover()
        s = int(step[0])
        say("B", s, "exact" if exact_at(s) else "MIX")
    if spec.get("stage"):
        stage_files(ctx, root, spec["stage"])
    if spec.get("finalize", True):
        ctx.finalize()
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    say("events", killer.count)


if __name__ == "__main__":
    main()
