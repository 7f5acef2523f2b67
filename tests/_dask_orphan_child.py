"""Child client of tests/test_dask_orphans.py: one program run on an EXTERNAL Dask cluster that outlives it.

Usage: python _dask_orphan_child.py ROOT SCHEDULER_FILE JSON. The child connects a client to the scheduler that the
test started (``dask scheduler`` / ``dask worker``: the cluster survives this process), runs ``ftidask.init(client=
...)`` on ROOT's directories, recovers when there is something to recover (prints
``R <step> exact|other <ckpt id> <digest>``), then checkpoints ``steps`` steps (``C <id> <digest>`` once
committed, ``F <id> <error>`` when one failed).

JSON: ``cfg`` (init keywords), ``levels`` (the level of step s: ``levels[s % len(levels)]``), ``steps``,
``finalize``, and ``slow``: ``{"ckpt": N, "delay": D, "marks": DIR, "what": NAME}``: on every worker, the first
call of NAME (a function of the worker's task module, or a dotted ``module.function``, see :func:`install`) for
checkpoint N sleeps first, until the test makes ``DIR/release`` or D seconds have passed (``DIR/start-<pid>`` is
made as it starts sleeping, ``DIR/done-<pid>`` when the call has returned or raised): the test SIGKILLs this child
while those tasks sleep, so that they go on running as orphans of a dead client, and releases them when it chooses.
Prints ``ARMED`` just before the checkpoint whose tasks are slowed.

The state of step ``s`` is a function of ``s`` (``_dask_crash_child.values``) and of ``salt`` (added at each step
from the first this run writes: a restarted program need not compute what the dead one did). ``R`` says ``exact``
when the recovered arrays are ``values(s)``, and prints their digest, as ``C`` prints the digest of what it
committed: the test compares them, bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _dask_crash_child import CHUNK_B, CHUNKS, initial, say, values

_SLOWED: dict[str, Any] = {}


def install(what: str, ckpt: int, delay: float, marks: str) -> int:
    """On a worker (``client.run``): the first call of ``tasks.<what>`` (or of ``module.function``, a dotted name)
    whose arguments (one of its first four, a string or a path) name checkpoint ``ckpt``'s directory (or pass its metadata: a dict whose ``ckpt_id`` is ``ckpt``)
    waits for ``marks/release`` (at most ``delay`` seconds) before it runs; returns the worker's pid."""
    from ftidask.backends.dask import dcp_tasks, tasks

    if "." in what:  # e.g. ftidask.dcp.files.write_dcp_file: a differential write, its spare open
        module_name, what = what.rsplit(".", 1)
        module = importlib.import_module(module_name)
    else:
        module = dcp_tasks if hasattr(dcp_tasks, what) and not hasattr(tasks, what) else tasks
    original = _SLOWED.setdefault(f"{module.__name__}.{what}", getattr(module, what))
    state = {"hit": False}
    needle = f"ckpt{ckpt}."

    def names(args: tuple[Any, ...]) -> bool:  # a path of the checkpoint (the level code passes Paths) or its meta
        return (any(isinstance(a, (str, os.PathLike)) and needle in os.fspath(a) for a in args[:4])
                or any(isinstance(a, dict) and a.get("ckpt_id") == ckpt for a in args))

    @functools.wraps(original)
    def slowed(*args: Any, **kwargs: Any) -> Any:
        if state["hit"] or not names(args):
            return original(*args, **kwargs)
        state["hit"] = True
        Path(marks, f"start-{os.getpid()}").touch()
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not Path(marks, "release").exists():
            time.sleep(0.05)
        try:
            return original(*args, **kwargs)
        finally:
            Path(marks, f"done-{os.getpid()}").touch()

    setattr(module, what, slowed)
    return os.getpid()


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()[:16]


def main() -> None:
    root, scheduler_file, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    import dask.array as da
    import distributed

    import ftidask

    client = distributed.Client(scheduler_file=scheduler_file, timeout=60)
    client.wait_for_workers(spec.get("nworkers", 3), timeout=60)
    ctx = ftidask.init(client=client, ckpt_dir=root + "/L", glbl_dir=root + "/G", meta_dir=root + "/M", verbosity=2,
                       **spec["cfg"])
    a0, b0 = initial()
    x, y = da.from_array(a0, chunks=CHUNKS), da.from_array(b0, chunks=CHUNK_B)
    step = np.zeros(1, np.int64)
    ctx.protect(1, x, name="field")
    ctx.protect(2, y, name="counts")
    ctx.protect(3, step)
    if ctx.status() != 0:
        arrays = ctx.recover()
        s = int(step[0])
        want = values(s)
        ra, rb = client.compute([arrays[1], arrays[2]], sync=True)
        exact = ra.tobytes() == want[0].tobytes() and rb.tobytes() == want[1].tobytes()
        say("R", s, "exact" if exact else "other", ctx.recovered_from[0], digest(ra, rb))
        x, y = arrays[1], arrays[2]
        ctx.protect(1, x)
        ctx.protect(2, y)
    levels, slow, salt = spec["levels"], spec.get("slow"), spec.get("salt", 0)
    first = int(step[0]) + 1
    for s in range(first, first + spec["steps"]):
        x, y = (x * 3 + s + salt) % 1000003, (y + s) % 1009
        step[0] = s
        ctx.protect(1, x)
        ctx.protect(2, y)
        if slow and slow["ckpt"] == s:
            client.run(install, slow.get("what", "write_rank"), s, slow["delay"], slow["marks"])
            say("ARMED", s)
        try:
            ctx.checkpoint(s, levels[s % len(levels)])
            say("C", s, digest(*client.compute([ctx.protected[1], ctx.protected[2]], sync=True)))
        except ftidask.CheckpointError as exc:
            say("F", s, type(exc).__name__, str(exc).replace("\n", " ")[:300])
        x, y = ctx.protected[1], ctx.protected[2]
    if spec.get("finalize", False):
        ctx.finalize()
        say("FINALIZED")
    client.close()


if __name__ == "__main__":
    main()
