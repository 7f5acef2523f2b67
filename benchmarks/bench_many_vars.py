"""Many small protected arrays (a model's parameters, a notebook's variables): what a state of thousands of
variables costs to protect, checkpoint and recover, against writing and loading the same arrays with NumPy.

    python benchmarks/bench_many_vars.py [--counts 1000,10000] [--kib 1] [--repeat 5]

For each count: that many float64 arrays of ``--kib`` KiB each, in one process, level 1. Timed (best of
``--repeat``, page cache warm): ``protect`` of every array; ``checkpoint`` (after a first one, as in a run); ``recover`` into the arrays in use; and
in the same run, as baselines, every array written with ``tofile`` into one file then ``fsync`` (raw), ``np.savez``
of them all plus an fsync, and loading them back with ``np.load`` of that archive (each array read). Prints seconds,
microseconds per variable, and ratios to the baselines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import ftidask


def best(fn, repeat: int) -> float:
    """The best of ``repeat`` timings of ``fn()``."""
    out = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - start)
    return out


def measure(count: int, kib: int, repeat: int, root: str) -> dict[str, float]:
    """Seconds of each operation for ``count`` arrays of ``kib`` KiB."""
    arrays = [np.random.default_rng(i).random(kib * 128) for i in range(count)]
    dirs = {"ckpt_dir": f"{root}/L", "glbl_dir": f"{root}/G", "meta_dir": f"{root}/M"}
    out: dict[str, float] = {}
    ids = iter(range(1, 10**6))
    with ftidask.init(verbosity=3, progress="off", **dirs) as ctx:
        def protect_all() -> None:
            for i, a in enumerate(arrays):
                ctx.protect(i, a)

        out["protect"] = best(protect_all, repeat)
        ctx.checkpoint(next(ids), 1)  # the first one plans every container; the others reuse its layout
        out["checkpoint"] = best(lambda: ctx.checkpoint(next(ids), 1), repeat)
        out["recover"] = best(ctx.recover, repeat)
    raw = os.path.join(root, "raw.bin")

    def raw_write() -> None:
        with open(raw, "wb") as fh:
            for a in arrays:
                a.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())

    npz = os.path.join(root, "state.npz")

    def savez() -> None:
        with open(npz, "wb") as fh:
            np.savez(fh, *arrays)
            fh.flush()
            os.fsync(fh.fileno())

    def load() -> None:
        with np.load(npz) as z:
            for name in z.files:
                z[name]

    out["raw write"] = best(raw_write, repeat)
    out["np.savez"] = best(savez, repeat)
    out["np.load"] = best(load, repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1000,10000")
    ap.add_argument("--kib", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"float64 arrays of {args.kib} KiB, level 1, best of {args.repeat}, warm cache, {os.cpu_count()} cores")
    for count in (int(c) for c in args.counts.split(",")):
        root = tempfile.mkdtemp(prefix="ftidask-many-vars-")
        try:
            t = measure(count, args.kib, args.repeat, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"\n{count} arrays ({count * args.kib / 1024:.1f} MiB)")
        for name, seconds in t.items():
            print(f"  {name:<11} {seconds * 1e3:9.1f} ms  {seconds / count * 1e6:7.1f} us/array")
        print(f"  checkpoint: {t['checkpoint'] / t['raw write']:.2f}x raw write, {t['checkpoint'] / t['np.savez']:.2f}x "
              f"np.savez; recover: {t['recover'] / t['np.load']:.2f}x np.load")


if __name__ == "__main__":
    main()
