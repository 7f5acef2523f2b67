"""A lost worker with the lineage cut by ftidask checkpoints, against Dask's own recomputation.

An iterative computation whose steps are expensive (each block of each step costs ``--cost`` seconds:
a stencil, then a sleep standing for the rest of a real model's work) runs on a LocalCluster of worker
processes. Before step ``--kill-at`` one worker is killed (SIGKILL). The time measured is the time to
get back to the point of failure: from the kill until the state of the last step is complete again.

* Dask alone: the scheduler recomputes the lost chunks from their graph, i.e. from step 0.
* ftidask: a checkpoint every ``--every`` steps (``--level``, L2 by default) cut the lineage; the lost
  chunks are read back from the last checkpoint and only the steps after it are recomputed.

Run: ``python benchmarks/bench_dask_lineage.py [--workers 4 --steps 40 --every 10 --kill-at 35]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import numpy as np


def _block(block: np.ndarray, cost: float = 0.0) -> np.ndarray:
    out = np.empty_like(block)
    c = block[1:-1, 1:-1]
    mean = 0.25 * (block[:-2, 1:-1] + block[2:, 1:-1] + block[1:-1, :-2] + block[1:-1, 2:])
    out[1:-1, 1:-1] = 0.5 * c + 0.5 * mean + 0.01 * np.sin(c)
    time.sleep(cost)  # the rest of an expensive step (a sleep: the figures do not depend on free cores)
    return out


def step(x: Any, cost: float) -> Any:
    return x.map_overlap(_block, depth=1, boundary="periodic", dtype=x.dtype, cost=cost)


def _kill(client: Any, address: str) -> None:
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
    while address in client.sync(client.scheduler.identity, n_workers=-1)["workers"]:
        time.sleep(0.02)


def run(client: Any, args: argparse.Namespace, with_ftidask: bool) -> dict[str, float]:
    """The computation up to step ``kill_at``, the kill, then the time until that step's state is back."""
    import dask.array as da
    import distributed

    import ftidask

    ctx = None
    if with_ftidask:
        tmp = tempfile.mkdtemp(prefix="run-", dir=args.root)  # removed after the run; args.root by main() at exit
        ctx = ftidask.init(client=client, ckpt_dir=f"{tmp}/local", glbl_dir=f"{tmp}/global", meta_dir=f"{tmp}/meta",
                           verbosity=3)
    x = client.persist(da.random.default_rng(0).random((args.size, args.size), chunks=args.chunk))
    ckpt_seconds = first_steps = 0.0
    start = time.perf_counter()
    for s in range(1, args.kill_at):
        x = client.persist(step(x, args.cost))
        distributed.wait(x)
        if s == args.every - 1:
            first_steps = time.perf_counter() - start  # before any checkpoint: the same work in both runs
        if ctx is not None and s % args.every == 0:
            t = time.perf_counter()
            ctx.protect(1, x, name="state")
            ctx.checkpoint(s // args.every, args.level)
            x = ctx.protected[1]
            ckpt_seconds += time.perf_counter() - t
    run_seconds = time.perf_counter() - start
    victim = sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])[1]
    _kill(client, victim)
    t = time.perf_counter()
    back = float(client.compute(x.sum()).result())  # every chunk of the state of step kill_at-1, again
    recover_seconds = time.perf_counter() - t
    if ctx is not None:
        ctx.finalize()  # the checkpoints go, not the directories
        shutil.rmtree(tmp, ignore_errors=True)
    client.wait_for_workers(args.workers, timeout=120)  # the nanny's replacement, for the next run
    return {"run": run_seconds, "first": first_steps, "checkpoints": ckpt_seconds, "back": recover_seconds,
            "sum": back}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="(the run stops at the kill)")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=36, help="the worker dies before this step")
    parser.add_argument("--cost", type=float, default=0.02, help="seconds per block and step")
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each, alternated; the fastest is shown")
    args = parser.parse_args()
    args.kill_at = min(args.kill_at, args.steps)
    args.root = tempfile.mkdtemp(prefix="bench-lineage-")  # every run's directories under it, removed on any exit
    try:
        report(args)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


def report(args: argparse.Namespace) -> None:
    import distributed

    cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                       dashboard_address=":0", silence_logs=50)
    with cluster, distributed.Client(cluster) as client:
        blocks = (args.size // args.chunk) ** 2
        print(f"{args.workers} workers, {args.size}x{args.size} float64 in {blocks} chunks, {args.cost:.3f} s per "
              f"block and step ({args.cost * blocks / args.workers:.2f} s per step), a worker killed before step "
              f"{args.kill_at}; ftidask checkpoints every {args.every} steps at level {args.level}")
        warm = argparse.Namespace(**{**vars(args), "kill_at": args.every + 2, "cost": 0.0})
        run(client, warm, with_ftidask=True)  # the workers import and warm up what both runs use
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.repeat):
            for with_ftidask in (False, True):
                runs[with_ftidask].append(run(client, args, with_ftidask))
                r = runs[with_ftidask][-1]
                print(f"  {'ftidask' if with_ftidask else 'Dask alone'}: run {r['run']:.2f} s (steps 1-{args.every - 1} "
                      f"{r['first']:.2f} s, checkpoints {r['checkpoints']:.2f} s), back after the loss {r['back']:.2f} s")
    sums = {r["sum"] for rs in runs.values() for r in rs}
    assert len(sums) == 1, f"the runs differ: {sums}"
    dask_only, cut = (min(runs[w], key=lambda r: r["back"]) for w in (False, True))
    print(f"back to step {args.kill_at - 1} after the loss (fastest of {args.repeat}): Dask recomputation "
          f"{dask_only['back']:.2f} s, lineage cut by ftidask {cut['back']:.2f} s; "
          f"ratio {dask_only['back'] / cut['back']:.1f}x")


if __name__ == "__main__":
    main()
