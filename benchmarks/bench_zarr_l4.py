"""Level 4 written as Zarr (``l4_format = zarr``): a verified restart against a plain Zarr read of the same store.

    python benchmarks/bench_zarr_l4.py [--size-mib 512] [--arrays 4] [--repeat 3] [--compressor zstd|none]

One process writes a level-4 checkpoint of ``--arrays`` float64 arrays as a Zarr store (timed against a plain Zarr
write of the same arrays with the same codec, then an fsync of every file, best of ``--repeat``), then restarts from it,
cold (every file of the store evicted from the page cache before each read) and warm, the variants interleaved
round by round (medians): ``zarr.open_array(...)[...]`` of every array (the baseline: what any Zarr reader does,
no check), and ``recover()`` into fresh arrays (a restarting program's) and into arrays in use. A verified recovery
checks every file against the manifest and every chunk decodes before an array is touched; it also prints the
bytes the process read per stored byte (``/proc/self/io`` rchar: 1.0 = each stored byte read once).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time
import warnings

import numpy as np
import zarr
from timing import best, evict_tree, fresh_rows_note, map_large_arrays_afresh

import ftidask


def rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar"))


def plain_write(path: str, arrays: list[np.ndarray], compressor: str | None) -> None:
    """The arrays written with Zarr (one array each, the codec ftidask uses for ``compressor``), every file fsynced."""
    shutil.rmtree(path, ignore_errors=True)
    codec = zarr.codecs.ZstdCodec(level=3) if compressor == "zstd" else "auto"
    group = zarr.open_group(path, mode="w")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, a in enumerate(arrays):
            chunks = a.shape if a.nbytes <= (64 << 20) else "auto"
            group.create_array(f"v{i}", shape=a.shape, dtype=a.dtype, chunks=chunks, compressors=codec)[...] = a
    for d, _s, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--arrays", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compressor", choices=["zstd", "none"], default="zstd",
                    help="ftidask's compressor (none: Zarr's default codec, Zstd level 0, is still used)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        per = args.size_mib * 2**20 // args.arrays // 8
        map_large_arrays_afresh()  # each np.empty_like a new mapping, as a restarted program's first arrays
        if note := fresh_rows_note(per * 8):
            print(note, flush=True)
        rng = np.random.default_rng(0)  # a random walk rounded to 2 decimals: compresses to about a third
        arrays = [np.round(np.cumsum(rng.standard_normal(per)), 2) for _ in range(args.arrays)]
        dirs = dict(ckpt_dir=f"{root}/L", glbl_dir=f"{root}/G", meta_dir=f"{root}/M", verbosity=3,
                    l4_format="zarr", compressor=None if args.compressor == "none" else args.compressor)
        ctx = ftidask.init(**dirs)
        for i, a in enumerate(arrays):
            ctx.protect(i + 1, a)
        ids = iter(range(1, 1000))
        t_ckpt = best(lambda: ctx.checkpoint(next(ids), 4), args.repeat)
        t_plain = best(lambda: plain_write(f"{root}/plain.zarr", arrays, dirs["compressor"]), args.repeat)
        ctx._close()
        (store,) = glob.glob(f"{root}/G/**/Ckpt*-Rank0.zarr", recursive=True)
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(store) for f in fs)
        names = [n for n in sorted(os.listdir(store)) if os.path.isdir(os.path.join(store, n))]

        def plain() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name in names:
                    zarr.open_array(os.path.join(store, name), mode="r")[...]

        used = ftidask.init(**dirs)
        for i, a in enumerate(arrays):
            used.protect(i + 1, np.ones_like(a))
        restart = ftidask.init(**dirs)

        def fresh() -> None:  # not timed: new arrays, no page faulted in yet
            for i, a in enumerate(arrays):
                restart.protect(i + 1, np.empty_like(a))

        variants = {"zarr.open_array()[...] (no check)": (None, plain),
                    "recover into fresh arrays": (fresh, restart.recover),
                    "recover into arrays in use": (None, used.recover)}
        results = {}
        for cold in (True, False):
            times: dict[str, list[float]] = {name: [] for name in variants}
            reads: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeat):
                for name, (prepare, fn) in variants.items():
                    if prepare is not None:
                        prepare()
                    if cold:
                        evict_tree(store)
                    r0, t0 = rchar(), time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    reads[name].append((rchar() - r0) / stored)
            results[cold] = {n: (float(np.median(times[n])), float(np.median(reads[n]))) for n in variants}
        print(f"state: {args.arrays} arrays, {sum(a.nbytes for a in arrays) / 2**20:.0f} MiB, stored "
              f"{stored / 2**20:.0f} MiB as Zarr ({args.compressor}), median of {args.repeat}, {os.cpu_count()} cores")
        print(f"\ncheckpoint (best of {args.repeat}): ftidask level 4 as Zarr {t_ckpt:.3f} s, a plain Zarr write + fsync "
              f"{t_plain:.3f} s: {t_ckpt / t_plain:.2f}x")
        for cold, rows in results.items():
            base = rows["zarr.open_array()[...] (no check)"][0]
            print(f"\nrestart, {'cold cache (store evicted)' if cold else 'warm cache'}")
            print(f"{'operation':36} {'seconds':>8} {'x zarr':>7} {'read/stored':>11}")
            for name, (t, r) in rows.items():
                print(f"{name:36} {t:8.3f} {t / base:7.2f} {r:11.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
