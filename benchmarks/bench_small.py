"""Small states checkpointed often (a notebook's arrays, a solver's state every few steps): what a checkpoint costs
beyond its raw write, where the fixed costs of the commit dominate.

    python benchmarks/bench_small.py [--sizes-kib 4,64,1024,8192] [--checkpoints 300] [--level 1]

For each size (4 float64 arrays together of that size), ``--checkpoints`` checkpoints at ``--level`` (each retires
the one before, as a run does), interleaved with two baselines measured in the same run on the same disk: a raw
``tofile`` + ``fsync`` into a new file, and the same made durable under its name as a checkpoint is (a temporary
name, fsync, rename, fsync of the directory). Prints medians of the wall time, the process's CPU time (user and
system, per checkpoint: Python's share and the kernel's), and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import ftidask


def raw_write(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as fh:
        for a in arrays:
            a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


def raw_durable(path: str, arrays: list[np.ndarray]) -> None:
    tmp = path + ".tmp"
    raw_write(tmp, arrays)
    os.rename(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def measure(size_kib: int, checkpoints: int, level: int, base: str) -> dict[str, tuple[float, float, float]]:
    """Median wall, user and system seconds of one checkpoint and of each baseline."""
    n = max(1, size_kib * 1024 // 8 // 4)
    arrays = [np.random.default_rng(i).random(n) for i in range(4)]
    root = tempfile.mkdtemp(dir=base)
    ctx = ftidask.init(ckpt_dir=f"{root}/L", glbl_dir=f"{root}/G", meta_dir=f"{root}/M", verbosity=3,
                       progress="off")
    for i, a in enumerate(arrays):
        ctx.protect(i, a)
    raw_dir = os.path.join(root, "raw")
    os.mkdir(raw_dir)
    times: dict[str, list[tuple[float, float, float]]] = {"ftidask": [], "raw": [], "raw durable": []}

    def timed(name: str, fn) -> None:
        cpu, start = os.times(), time.perf_counter()
        fn()
        wall, after = time.perf_counter() - start, os.times()
        times[name].append((wall, after.user - cpu.user, after.system - cpu.system))

    for k in range(1, 4):  # the run's directories made, the first retirement done
        ctx.checkpoint(k, level)
    for k in range(checkpoints):
        arrays[0][0] = k
        timed("ftidask", lambda k=k: ctx.checkpoint(k + 10, level))
        timed("raw", lambda k=k: raw_write(os.path.join(raw_dir, f"r{k}"), arrays))
        timed("raw durable", lambda k=k: raw_durable(os.path.join(raw_dir, f"d{k}"), arrays))
        if k % 50 == 49:  # as the checkpoints do, keep the baselines' files few
            for name in os.listdir(raw_dir):
                os.unlink(os.path.join(raw_dir, name))
    ctx.finalize()
    shutil.rmtree(root, ignore_errors=True)
    # CPU times come in clock ticks (10 ms): the mean over the run, not the median, tells them
    return {name: (statistics.median(t[0] for t in ts), statistics.fmean(t[1] for t in ts),
                   statistics.fmean(t[2] for t in ts)) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="4,64,1024,8192")
    ap.add_argument("--checkpoints", type=int, default=300)
    ap.add_argument("--level", type=int, default=1)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ftidask-small-")
    try:
        print(f"level {args.level}, {args.checkpoints} checkpoints per size, {os.cpu_count()} cores; "
              "wall: median ms, CPU: mean ms per checkpoint")
        print(f"{'size':>9} {'ftidask':>8} {'user':>6} {'sys':>6} {'raw':>7} {'durable':>8} {'x raw':>6} "
              f"{'x durable':>9}")
        for size in (int(s) for s in args.sizes_kib.split(",")):
            r = measure(size, args.checkpoints, args.level, base)
            ours, raw, durable = r["ftidask"], r["raw"], r["raw durable"]
            print(f"{size:>6} KiB {ours[0] * 1e3:>8.2f} {ours[1] * 1e3:>6.2f} {ours[2] * 1e3:>6.2f} "
                  f"{raw[0] * 1e3:>7.2f} {durable[0] * 1e3:>8.2f} {ours[0] / raw[0]:>6.2f} {ours[0] / durable[0]:>9.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
