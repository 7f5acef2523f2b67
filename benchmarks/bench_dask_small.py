"""Small Dask arrays checkpointed often (a notebook's loop on a cluster): what a checkpoint costs where the data is
written in a few milliseconds and the round trips between the client, the scheduler and the workers dominate.

    python benchmarks/bench_dask_small.py [--sizes-kib 256,4096,65536] [--chunks 4] [--workers 2]
                                          [--checkpoints 40] [--level 1]

For each size: a float64 array of ``--chunks`` chunks, persisted on a LocalCluster of ``--workers`` single-threaded
worker processes. Each step computes the next array (``x + 1``, persisted before any timing), then times, in turn,
``ctx.checkpoint`` (every checkpoint retiring the one before and cutting the array's lineage, as a loop does) and
``dask.array.to_zarr`` of the same array plus an fsync of every file zarr wrote (the baseline of
``bench_dask.py``). Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import dask.array as da
from bench_dask import fsync_tree
from distributed import Client, LocalCluster, wait

import ftidask


def measure(client: Client, size_kib: int, nchunks: int, checkpoints: int, level: int, base: str
            ) -> tuple[float, float]:
    """Median seconds of one checkpoint and of one to_zarr + fsync of the same array."""
    n = max(nchunks, size_kib * 1024 // 8)
    root = tempfile.mkdtemp(dir=base)
    ctx = ftidask.init(client=client, ckpt_dir=f"{root}/L", glbl_dir=f"{root}/G", meta_dir=f"{root}/M",
                       verbosity=3, progress="off")
    x = da.random.random(n, chunks=-(-n // nchunks)).persist()
    wait(x)
    ours, zarr = [], []
    for k in range(checkpoints + 3):  # the first three: the run's directories made, the first retirements done
        ctx.protect(1, x)
        start = time.perf_counter()
        ctx.checkpoint(k + 1, level)
        ours.append(time.perf_counter() - start)
        x = ctx.protected[1]  # its lineage cut: the next step starts from the checkpoint
        path = os.path.join(root, "step.zarr")
        start = time.perf_counter()
        da.to_zarr(x, path, compressors=None, overwrite=True)
        fsync_tree(path)
        zarr.append(time.perf_counter() - start)
        shutil.rmtree(path)
        x = (x + 1).persist()
        wait(x)
    ctx.finalize()
    shutil.rmtree(root, ignore_errors=True)
    return statistics.median(ours[3:]), statistics.median(zarr[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="256,4096,65536")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoints", type=int, default=40)
    ap.add_argument("--level", type=int, default=1)
    args = ap.parse_args()
    try:  # the to_zarr baseline needs zarr: checked before the cluster starts, not after ftidask's first checkpoint
        import zarr  # noqa: F401
    except ImportError:
        sys.exit("bench_dask_small.py: zarr is not installed (the to_zarr baseline needs it): "
                 "pip install 'ftidask[zarr]'")
    base = tempfile.mkdtemp(prefix="ftidask-dask-small-")
    try:
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            print(f"level {args.level}, {args.checkpoints} checkpoints per size, {args.chunks} chunks, "
                  f"{args.workers} workers, {os.cpu_count()} cores; medians in ms")
            print(f"{'size':>10} {'ftidask':>8} {'to_zarr+fsync':>14} {'ratio':>6}")
            for size in (int(s) for s in args.sizes_kib.split(",")):
                ours, zarr = measure(client, size, args.chunks, args.checkpoints, args.level, base)
                print(f"{size:>6} KiB {ours * 1e3:>8.1f} {zarr * 1e3:>14.1f} {ours / zarr:>6.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
