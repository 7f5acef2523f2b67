"""A long run that keeps every L4 checkpoint (``keep_l4_ckpt = 1``): does a checkpoint's cost grow with the
number of checkpoints kept?

    python benchmarks/bench_many_records.py [--checkpoints 1000] [--kib 64] [--every 200]

Each checkpoint writes one small array (``--kib``) at level 4; the raw baseline, measured in the same run,
writes the same bytes with ``tofile`` + ``fsync`` into a new directory (as an L4 checkpoint's file goes into its
own). Prints, for each stretch of ``--every`` checkpoints, the median checkpoint time, the median raw write and
their ratio: flat when nothing is read again per checkpoint kept (before session 43, records were parsed three
times and each kept directory listed at every checkpoint: 0.45 ms more per checkpoint kept).
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


def raw_write(root: str, k: int, a: np.ndarray) -> float:
    start = time.perf_counter()
    d = os.path.join(root, f"raw{k}")
    os.mkdir(d)
    with open(os.path.join(d, "f.bin"), "wb") as fh:
        a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--every", type=int, default=200)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ftidask-many-")
    try:
        a = np.random.default_rng(0).random(args.kib * 128)
        raw_root = os.path.join(base, "raw")
        os.mkdir(raw_root)
        ctx = ftidask.init(ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", verbosity=3,
                           keep_l4_ckpt=1)
        ctx.protect(0, a)
        print(f"{args.checkpoints} L4 checkpoints of {args.kib} KiB, every one kept; medians per stretch")
        print(f"{'kept':>6} {'checkpoint ms':>14} {'raw ms':>8} {'x raw':>6}")
        ours: list[float] = []
        raw: list[float] = []
        for k in range(1, args.checkpoints + 1):
            a[0] = k
            start = time.perf_counter()
            ctx.checkpoint(k, 4)
            ours.append(time.perf_counter() - start)
            raw.append(raw_write(raw_root, k, a))
            if k % args.every == 0:
                o, r = statistics.median(ours), statistics.median(raw)
                print(f"{k:>6} {o * 1e3:>14.2f} {r * 1e3:>8.2f} {o / r:>6.2f}")
                ours, raw = [], []
        ctx.finalize()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
