"""L1 checkpoint of a Dask array on a LocalCluster against ``dask.array.to_zarr`` (no compression)
plus an fsync of every file zarr wrote (ftidask's files are fsynced, so the baseline is too), and
a recovery against ``dask.array.from_zarr`` of the same array, both from a cold cache.

    python benchmarks/bench_dask.py [--size-mib 2048] [--chunk-mib 64] [--workers 2] [--repeat 2] [--dcp]

Both write the same persisted array from the same workers, into the same file system.
Prints times, throughputs and the ratios ftidask_time / zarr_time (issue 16's targets: checkpoint
at most 0.7x to_zarr+fsync, recovery at most 0.9x from_zarr). A recovery is ``ctx.recover()`` in a
new context (every chunk read on the workers and checked against its hash, in worker memory when it
returns) against ``from_zarr(...).persist()``; before each, every file of both is evicted from the
page cache (``posix_fadvise``; the workers' files and zarr's alike). With ``--dcp``, also
differential checkpoints at L1 and L2 after 1% of the rows changed, against a full L1 checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait
from timing import evict_tree

import ftidask


def fsync_tree(root: str) -> int:
    """fsync every file and directory under ``root``; the number of files."""
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            count += 1
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return count


def run_zarr(x: da.Array, root: str) -> tuple[float, int]:
    path = os.path.join(root, "array.zarr")
    start = time.perf_counter()
    da.to_zarr(x, path, compressors=None, overwrite=True)
    files = fsync_tree(path)
    seconds = time.perf_counter() - start
    shutil.rmtree(path)
    return seconds, files


DIRECT_IO = False  # --direct-io


def run_ftidask(client: Client, x: da.Array, root: str, ckpt_id: int) -> float:
    ctx = ftidask.init(client=client, ckpt_dir=f"{root}/Local", glbl_dir=f"{root}/Global",
                       meta_dir=f"{root}/Meta", verbosity=3, progress="off", direct_io=DIRECT_IO)
    ctx.protect(1, x)
    info = ctx.checkpoint(ckpt_id, 1)
    ctx.finalize()  # removes the checkpoint (keep_last_ckpt = 0)
    return info.seconds


def run_recovery(client: Client, x: da.Array, root: str, repeat: int) -> tuple[list[float], list[float]]:
    """Cold-cache recoveries, interleaved: ftidask's (a checkpoint kept for it) and from_zarr's."""
    dirs = {"ckpt_dir": f"{root}/RLocal", "glbl_dir": f"{root}/RGlobal", "meta_dir": f"{root}/RMeta"}
    writer = ftidask.init(client=client, verbosity=3, progress="off", direct_io=DIRECT_IO, **dirs)
    writer.protect(1, x)
    writer.checkpoint(1, 1)
    writer._close()  # as a job that ends: the checkpoint stays (finalize would remove it)
    zpath = os.path.join(root, "recover.zarr")
    da.to_zarr(x, zpath, compressors=None, overwrite=True)
    fsync_tree(zpath)
    ft, zt = [], []
    for i in range(repeat):
        for kind in (("ftidask", "zarr") if i % 2 == 0 else ("zarr", "ftidask")):
            evict_tree(root)
            if kind == "ftidask":
                ctx = ftidask.init(client=client, verbosity=3, progress="off", **dirs)
                ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
                start = time.perf_counter()
                out = ctx.recover()[1]
                ft.append(time.perf_counter() - start)
                del out
                ctx._close()
            else:
                start = time.perf_counter()
                y = da.from_zarr(zpath).persist()
                wait(y)
                zt.append(time.perf_counter() - start)
                del y
    return ft, zt


def run_dcp(client: Client, x: da.Array, root: str, level: int, repeat: int) -> None:
    """Differential checkpoints (level 5, or 6 for L2): 1% of the rows changed (scattered) between
    checkpoints, each timed right after a full level-1 checkpoint of the same state."""
    ctx = ftidask.init(client=client, ckpt_dir=f"{root}/Local", glbl_dir=f"{root}/Global", meta_dir=f"{root}/Meta",
                       verbosity=3, progress="off", enable_dcp=1, dcp_block_size=16384)
    ctx.protect(1, x)
    rng = np.random.default_rng(5)
    ids = iter(range(100, 10_000))
    rows = x.shape[0]
    print(f"\ndifferential level {level} ({level - 4} + dCP), 16 KiB blocks, 1% of the rows changed (scattered):")
    try:
        for _ in range(repeat):
            for _fill in range(2):  # both alternating files up to date
                ctx.checkpoint(next(ids), level)
            full = ctx.checkpoint(next(ids), 1)
            mask = np.zeros(rows, bool)
            mask[rng.choice(rows, rows // 100, replace=False)] = True
            current = ctx.protected[1]
            changed = da.where(da.from_array(mask, chunks=x.chunks[0])[:, None], current + 1, current).persist()
            wait(changed)
            ctx.protect(1, changed)
            info = ctx.checkpoint(next(ids), level)
            extra = f", L2 sent {info.partner_bytes / 2**20:.1f} MiB" if info.partner_bytes is not None else ""
            print(f"  full L1 {full.seconds:.2f} s; dCP {info.seconds:.2f} s ({info.seconds / full.seconds:.3f}x), "
                  f"{info.blocks_changed}/{info.blocks_total} blocks, {info.bytes_written / 2**20:.1f} MiB of data "
                  f"({info.bytes_written / full.bytes_written:.2%}){extra}")
    finally:
        ctx.finalize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--dcp", action="store_true", help="also time differential checkpoints (levels 5 and 6)")
    ap.add_argument("--direct-io", choices=["on", "off"], default="off",
                    help="the direct_io setting: the workers' files written around the page cache (O_DIRECT) or not")
    args = ap.parse_args()
    try:  # the baseline (to_zarr, from_zarr) needs zarr: checked before the cluster starts and ftidask's checkpoint
        import zarr  # noqa: F401  # runs, not at the first to_zarr after it
    except ImportError:
        sys.exit("bench_dask.py: zarr is not installed (the to_zarr / from_zarr baseline needs it): "
                 "pip install 'ftidask[zarr]'")
    global DIRECT_IO
    DIRECT_IO = args.direct_io == "on"
    root = tempfile.mkdtemp(prefix="ftidask-bench-", dir=args.dir)
    chunk_rows = args.chunk_mib * 2**20 // 8 // 1024
    rows = args.size_mib * 2**20 // 8 // 1024
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit=0, silence_logs=40) as cluster, Client(cluster) as client:
        x = da.random.default_rng(0).random((rows, 1024), chunks=(chunk_rows, 1024)).persist()
        wait(x)
        nbytes = x.nbytes
        print(f"array: {nbytes / 2**30:.2f} GiB float64, {x.npartitions} chunks of {args.chunk_mib} MiB, "
              f"{args.workers} workers x 1 thread, direct_io {args.direct_io}")
        ft, zt = [], []
        try:
            for i in range(args.repeat):
                # Alternate the order so that neither always writes into a warmer page cache.
                if i % 2 == 0:
                    ft.append(run_ftidask(client, x, root, i + 1))
                    zt.append(run_zarr(x, root)[0])
                else:
                    zt.append(run_zarr(x, root)[0])
                    ft.append(run_ftidask(client, x, root, i + 1))
                print(f"  run {i + 1}: ftidask L1 {ft[-1]:.2f} s ({nbytes / ft[-1] / 2**20:.0f} MiB/s), "
                      f"to_zarr+fsync {zt[-1]:.2f} s ({nbytes / zt[-1] / 2**20:.0f} MiB/s)")
            rf, rz = run_recovery(client, x, root, args.repeat)
            for i, (a, b) in enumerate(zip(rf, rz)):
                print(f"  recovery {i + 1}: ftidask {a:.2f} s ({nbytes / a / 2**20:.0f} MiB/s), "
                      f"from_zarr {b:.2f} s ({nbytes / b / 2**20:.0f} MiB/s)")
            if args.dcp:
                for level in (5, 6):
                    run_dcp(client, x, root, level, args.repeat)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    best_f, best_z = min(ft), min(zt)
    print(f"best: ftidask L1 {best_f:.2f} s ({nbytes / best_f / 2**20:.0f} MiB/s), "
          f"to_zarr+fsync {best_z:.2f} s ({nbytes / best_z / 2**20:.0f} MiB/s)")
    print(f"checkpoint: ftidask/to_zarr = {best_f / best_z:.2f}x best, {np.median(ft) / np.median(zt):.2f}x median "
          f"(target <= 0.7x; {args.workers} workers on {os.cpu_count()} cores)")
    print(f"recovery:   ftidask/from_zarr = {min(rf) / min(rz):.2f}x best, {np.median(rf) / np.median(rz):.2f}x "
          f"median (target <= 0.9x; cold cache)")


if __name__ == "__main__":
    main()
