"""How long does ``send_file`` block the caller, against the time of the copy itself?

For each file size, files are written into the stage directory first (not timed), then sent one
after another; every ``send_file`` call is timed (median, p99, max). The baseline, measured in the
same run on the same disks, is a plain synchronous copy of one file of that size
(``storage.copy_file_atomic``: copy + fsync + rename), i.e. what the application would wait for
without staging. Also printed: the end-to-end staging throughput (all requests of the size done).

    PYTHONPATH=. python benchmarks/bench_staging.py [--quick] [--mover thread|process] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ftidask
from ftidask import SI_SCES
from ftidask.storage import files as storage

KiB, MiB = 1 << 10, 1 << 20
SIZES = [(1 * KiB, 200), (64 * KiB, 200), (1 * MiB, 100), (16 * MiB, 20), (256 * MiB, 3)]
QUICK = [(1 * KiB, 100), (1 * MiB, 30), (16 * MiB, 5), (256 * MiB, 1)]


def fill(path: Path, size: int, block: bytes) -> None:
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n


def baseline_copy(root: Path, size: int, block: bytes) -> float:
    src, dst = root / "baseline.src", root / "baseline_out" / "baseline.dst"
    fill(src, size, block)
    start = time.perf_counter()
    storage.copy_file_atomic(src, dst)
    elapsed = time.perf_counter() - start
    os.unlink(src)
    os.unlink(dst)
    return elapsed


def compute(steps: int = 8) -> float:
    """A fixed NumPy workload (the application computing); its wall time."""
    a = np.random.default_rng(0).random((256, 256))
    start = time.perf_counter()
    for _ in range(steps):
        a = np.tanh(a @ a.T / 256.0)
    return time.perf_counter() - start


def overlap(ctx: ftidask.Context, stage: Path, block: bytes) -> None:
    """The application keeps computing while a 256 MiB file is sent: its compute time, alone and during staging."""
    alone = min(compute() for _ in range(3))
    src = stage / "overlap.dat"
    fill(src, 256 * MiB, block)
    req = ctx.send_file(src, "overlap/overlap.dat")
    during = []
    while ctx.stage_status(req) not in (ftidask.SI_SCES, ftidask.SI_FAIL):
        during.append(compute())
    print(f"compute step alone (best of 3): {fmt(alone)}; during a 256 MiB transfer: "
          f"{len(during)} steps, median {fmt(statistics.median(during)) if during else '   n/a'} "
          f"({statistics.median(during) / alone if during else float('nan'):.2f}x)")


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer files (a short run)")
    parser.add_argument("--mover", choices=["thread", "process"], default="thread")
    parser.add_argument("--dir", default=None, help="where to put the local and global directories")
    opts = parser.parse_args()
    block = os.urandom(16 * MiB)
    with tempfile.TemporaryDirectory(dir=opts.dir, prefix="bench_staging_") as tmp:
        root = Path(tmp)
        ctx = ftidask.init(ckpt_dir=root / "local", glbl_dir=root / "global", meta_dir=root / "meta",
                           enable_staging=1, stage_mover=opts.mover, verbosity=3)
        stage = ctx.stage_dir()
        print(f"staging benchmark: mover={opts.mover}, dir={root}, load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs")
        print(f"{'size':>10} {'n':>4} | send_file blocks: {'median':>12} {'p99':>12} {'max':>12} |"
              f" {'sync copy':>12} {'ratio':>8} | staging MiB/s")
        worst = 0.0
        for size, count in (QUICK if opts.quick else SIZES):
            names = [stage / f"s{size}_{i}" for i in range(count)]
            for name in names:
                fill(name, size, block)
            base = baseline_copy(root, size, block)
            blocked = []
            start = time.perf_counter()
            ids = []
            cpu = []
            for i, name in enumerate(names):
                c0, t0 = time.thread_time(), time.perf_counter()
                ids.append(ctx.send_file(name, f"out{size}/f{i}"))
                blocked.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            states = ctx.wait_staged(timeout=3600)
            total = time.perf_counter() - start
            bad = [i for i in ids if states.get(i) != SI_SCES]
            for i in ids:
                ctx.stage_status(i)
            if bad:
                print(f"  {len(bad)} requests failed", file=sys.stderr)
            blocked.sort()
            p99 = blocked[min(len(blocked) - 1, int(0.99 * len(blocked)))]
            med = statistics.median(blocked)
            worst = max(worst, blocked[-1])
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
            print(f"{label:>10} {count:>4} | {'':17} {fmt(med)} {fmt(p99)} {fmt(blocked[-1])} |"
                  f" {fmt(base)} {base / med:8.0f}x | {size * count / MiB / total:10.1f}"
                  f" | caller CPU per call: median {fmt(statistics.median(cpu))}, max {fmt(max(cpu))}")
            storage.remove_tree(root / "global" / f"out{size}")
        overlap(ctx, stage, block)
        ctx.finalize()
        print(f"largest blocking time of any send_file: {worst * 1e3:.3f} ms (target: under 1 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
