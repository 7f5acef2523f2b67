"""Recovery of a compressed checkpoint on a Dask LocalCluster against ``dask.array.from_zarr`` of the same
array compressed with the same codec, from a cold cache; and the codec's frame threads on the workers.

    python benchmarks/bench_dask_compression.py [--size-mib 256] [--chunk-mib 16] [--workers 2] [--threads 1]
        [--compressor zstd:1] [--repeat 3] [--frame-threads] [--frame-pool worker|default]

A smooth float64 field (a diffused temperature, full double precision, as a solver writes it), checkpointed
at level 2 with the compressor (each chunk of more than 4 MiB in frames). Then, interleaved, each from a
cold cache (every file evicted from the page cache):

* ``ftidask``: ``ctx.recover()`` in a new context, nothing missing (the search checks metadata, the reads
  check the hashes and decode);
* ``ftidask, partner copies erased``: the same after erasing every partner copy, which the recovery
  rebuilds from the own files (their data hash-checked first, then each chunk read and decoded);
* ``from_zarr``: ``da.from_zarr(...).persist()`` of the same array written by ``to_zarr`` with the Zarr codec
  that matches the compressor (``ftidask.zarrfmt.store.zarr_compressors``).

With ``--frame-threads``, also a checkpoint and a recovery with the frame pool of each worker bounded by twice
its ``nthreads`` (what ``ftidask.init`` does), by its ``nthreads``, and ``min(8, cores)`` threads per worker (the
default of a process that owns its machine), interleaved. Prints every time, medians and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait
from timing import evict_tree

import ftidask
from ftidask.ftiff import compression
from ftidask.zarrfmt.store import zarr_compressors

SOURCES = np.random.default_rng(0).random((6, 4))  # centre x, centre y, width, amplitude of each source


def _block(block_info: Any = None) -> np.ndarray:
    """Rows of the global field ``rows x cols`` that this block holds."""
    info = block_info[None]
    (r0, r1), (c0, c1) = info["array-location"]
    rows, cols = info["shape"]
    y, x = np.mgrid[r0:r1, c0:c1]
    y, x = y / rows, x / cols
    field = 300.0 + 20.0 * x
    for cx, cy, w, a in SOURCES:
        field += 50 * a * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (0.005 + 0.05 * w))
    return field


def set_frame_threads(client: Client, share: int | None) -> None:
    """Every worker's frame pool: ``share`` threads (None: the process default, ``min(8, cores)``)."""
    limit = getattr(compression, "limit_frame_threads", None)
    if limit is None:
        raise SystemExit("--frame-threads needs a version of ftidask with compression.limit_frame_threads")
    client.run(limit, share)


def recover_once(client: Client, dirs: dict[str, str], x: da.Array, erase: bool, pool: str) -> float:
    ctx = ftidask.init(client=client, verbosity=3, progress="off", **dirs)
    if pool == "default":
        set_frame_threads(client, None)
    ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
    if erase:
        for path in Path(dirs["ckpt_dir"]).glob("**/Ckpt*-Pcof*.fti"):
            path.unlink()
    evict_tree(dirs["ckpt_dir"])
    cpu = worker_cpu(client)
    start = time.perf_counter()
    out = ctx.recover()[1]
    seconds = time.perf_counter() - start
    CPU.append(worker_cpu(client) - cpu)
    del out
    ctx._close()  # the checkpoint stays for the next one
    return seconds


CPU: list[float] = []  # the workers' CPU seconds of each ftidask recovery, in order


def worker_cpu(client: Client) -> float:
    """CPU seconds used so far by every worker process, all its threads (less noisy than wall time on a
    shared machine: what a second decoding costs shows there whatever else runs)."""
    return sum(client.run(time.process_time).values())


def zarr_once(zpath: str) -> float:
    evict_tree(zpath)
    start = time.perf_counter()
    y = da.from_zarr(zpath).persist()
    wait(y)
    seconds = time.perf_counter() - start
    del y
    return seconds


def _line(name: str, times: list[float], nbytes: int, base: list[float] | None = None) -> str:
    med = statistics.median(times)
    ratio = f", {med / statistics.median(base):.2f}x from_zarr" if base else ""
    return (f"  {name:<38} median {med:6.2f} s ({nbytes / med / 2**20:5.0f} MiB/s raw){ratio}; "
            f"runs {', '.join(f'{t:.2f}' for t in times)}")


def bench_recovery(client: Client, x: da.Array, root: str, spec: str, repeat: int, pool: str) -> None:
    dirs = {"ckpt_dir": f"{root}/Local", "glbl_dir": f"{root}/Global", "meta_dir": f"{root}/Meta"}
    writer = ftidask.init(client=client, verbosity=3, progress="off", compressor=spec, **dirs)
    if pool == "default":
        set_frame_threads(client, None)
    writer.protect(1, x)
    info = writer.checkpoint(1, 2)
    writer._close()  # as a job that ends: the checkpoint stays
    zpath = os.path.join(root, "recover.zarr")
    config = compression.parse_compressor(spec)
    da.to_zarr(x, zpath, compressors=zarr_compressors(config), overwrite=True)
    stored = sum(p.stat().st_blocks * 512 for p in Path(dirs["ckpt_dir"]).glob("**/Ckpt1-Rank*.fti"))
    zstored = sum(p.stat().st_size for p in Path(zpath).rglob("*") if p.is_file())
    print(f"L2 checkpoint {info.seconds:.2f} s; own files {stored / 2**20:.0f} MiB on disk, zarr store "
          f"{zstored / 2**20:.0f} MiB, raw {x.nbytes / 2**20:.0f} MiB")
    kinds = {"ftidask, nothing missing": lambda: recover_once(client, dirs, x, False, pool),
             "ftidask, partner copies erased": lambda: recover_once(client, dirs, x, True, pool),
             "from_zarr(...).persist()": lambda: zarr_once(zpath)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for i in range(repeat):
        for name in names[i % 3:] + names[:i % 3]:  # rotate the order: no kind always after the same one
            times[name].append(kinds[name]())
            if name.startswith("ftidask"):
                cpu[name].append(CPU[-1])
    check_costs(dirs, repeat)
    print("recovery, cold cache:")
    for name in names:
        print(_line(name, times[name], x.nbytes, None if name.startswith("from_zarr") else times[names[-1]]))
        if cpu[name]:
            print(f"  {'':<38} workers' CPU median {statistics.median(cpu[name]):6.2f} s; "
                  f"runs {', '.join(f'{t:.2f}' for t in cpu[name])}")


def check_costs(dirs: dict[str, str], repeat: int) -> None:
    """The check of every own file that precedes a rebuild, in this process from a warm cache, best of
    ``repeat``: hashes and decoding (what it was) against hashes only (what a Dask recovery does now that
    the reads decode); their difference is the decoding each such recovery no longer does twice."""
    from ftidask.backends.dask import tasks
    from ftidask.ftiff.reader import parse_ftiff

    files = []
    for path in sorted(Path(dirs["ckpt_dir"]).glob("**/Ckpt1-Rank*.fti")):
        with open(path, "rb") as fh:
            files.append((str(path), parse_ftiff(fh, str(path)).fb.hash.hex()))
    if "decode" not in tasks.check_file.__kwdefaults__:
        print("check of the own files: this ftidask's check_file has no decode= (it always decodes)")
        return
    timed = {}
    for decode in (True, False):
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            assert all(tasks.check_file(p, h, decode=decode)["ok"] for p, h in files)
            best = min(best, time.perf_counter() - start)
        timed[decode] = best
    print(f"check of the {len(files)} own files (warm cache, best of {repeat}): hashes and decoding "
          f"{timed[True]:.2f} s, hashes only {timed[False]:.2f} s ({timed[False] / timed[True]:.2f}x)")


def bench_frame_threads(client: Client, x: da.Array, root: str, spec: str, repeat: int, nthreads: int) -> None:
    dirs = {"ckpt_dir": f"{root}/FLocal", "glbl_dir": f"{root}/FGlobal", "meta_dir": f"{root}/FMeta"}
    default = min(8, os.cpu_count() or 1)
    shares = {f"2 x nthreads ({2 * nthreads}) per worker": 2 * nthreads, f"nthreads ({nthreads}) per worker": nthreads,
              f"min(8, cores) ({default}) per worker": None}
    ck: dict[str, list[float]] = {k: [] for k in shares}
    rc: dict[str, list[float]] = {k: [] for k in shares}
    for i in range(repeat):
        for name in (list(shares) if i % 2 == 0 else list(shares)[::-1]):
            ctx = ftidask.init(client=client, verbosity=3, progress="off", compressor=spec, **dirs)
            set_frame_threads(client, shares[name])  # after init, whose plugin set 2 x nthreads
            ctx.protect(1, x)
            ck[name].append(ctx.checkpoint(1, 1).seconds)
            ctx._close()
            ctx = ftidask.init(client=client, verbosity=3, progress="off", **dirs)
            set_frame_threads(client, shares[name])
            ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
            evict_tree(dirs["ckpt_dir"])
            start = time.perf_counter()
            out = ctx.recover()[1]
            rc[name].append(time.perf_counter() - start)
            del out
            ctx.finalize()  # removes the checkpoint
    set_frame_threads(client, 2 * nthreads)
    print("frame threads (L1 checkpoint, then recovery from a cold cache):")
    first = list(shares)[0]
    for name in shares:
        print(_line(f"checkpoint, {name}", ck[name], x.nbytes)
              + f"; {statistics.median(ck[name]) / statistics.median(ck[first]):.2f}x the first")
        print(_line(f"recovery, {name}", rc[name], x.nbytes)
              + f"; {statistics.median(rc[name]) / statistics.median(rc[first]):.2f}x the first")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    ap.add_argument("--compressor", default="zstd:1")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--frame-threads", action="store_true", help="also compare the frame pool's sizes")
    ap.add_argument("--only-frame-threads", action="store_true", help="only the comparison of --frame-threads")
    ap.add_argument("--frame-pool", choices=("worker", "default"), default="worker",
                    help="the workers' frame pool in the recovery runs: 'worker' (2 x nthreads, what ftidask.init sets) "
                         "or 'default' (min(8, cores): as ftidask did before, to compare with an older version)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ftidask-bench-", dir=args.dir)
    cols = 1024
    rows = args.size_mib * 2**20 // 8 // cols
    chunk_rows = args.chunk_mib * 2**20 // 8 // cols
    with LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                      dashboard_address=":0", memory_limit=0, silence_logs=40) as cluster, Client(cluster) as client:
        x = da.map_blocks(_block, chunks=da.core.normalize_chunks((chunk_rows, cols), (rows, cols)),
                          dtype=np.float64).persist()
        wait(x)
        print(f"array: {x.nbytes / 2**20:.0f} MiB float64, {x.npartitions} chunks of {args.chunk_mib} MiB, "
              f"{args.workers} workers x {args.threads} thread(s) on {os.cpu_count()} cores, {args.compressor}, "
              f"frame pool {args.frame_pool}; ftidask from {Path(ftidask.__file__).parent}")
        try:
            if not args.only_frame_threads:
                bench_recovery(client, x, root, args.compressor, args.repeat, args.frame_pool)
            if args.frame_threads or args.only_frame_threads:
                bench_frame_threads(client, x, root, args.compressor, args.repeat, args.threads)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
