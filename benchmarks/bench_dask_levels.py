"""Time and worker memory of Dask L2/L3 checkpoints on a LocalCluster.

    python benchmarks/bench_dask_levels.py [--size-mib 256] [--workers 2] [--levels 2 3] [--repeat 1]

Each worker holds ``--size-mib`` of a persisted float64 array (so writes a file of that size).
For each level, every worker's peak resident memory (VmHWM, reset before the checkpoint through
``/proc/PID/clear_refs``; a 5 ms sampling thread where that cannot be written) is compared with
its resident memory just before: the difference is what the checkpoint (the write, then the
level's transfers) added. The array's chunks are resident in both, so a level that moves whole
files through task results shows up as ``k x file size`` extra, a streamed one as its stripes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import dask.array as da
import psutil
from distributed import Client, LocalCluster, wait

import ftidask


def _raw_write(nbytes: int, folder: str, dask_worker=None) -> float:
    """On a worker: seconds of a raw tofile + fsync of ``nbytes`` (the baseline of its own file's write)."""
    import numpy as np

    data = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    path = os.path.join(folder, f"raw-{os.getpid()}")
    start = time.perf_counter()
    with open(path, "wb") as fh:
        data.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    took = time.perf_counter() - start
    os.remove(path)
    return took


def _reset_hwm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    return 0


class PeakRss:
    """Peak resident memory of some processes over a block of code."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.procs = {w: psutil.Process(p) for w, p in pids.items()}
        self.before = {w: p.memory_info().rss for w, p in self.procs.items()}
        self.sampled = dict(self.before)
        self.hwm_ok = all(_reset_hwm(p) for p in pids.values())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            for w, p in self.procs.items():
                try:
                    self.sampled[w] = max(self.sampled[w], p.memory_info().rss)
                except psutil.Error:
                    pass

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = {w: max(self.sampled[w], _hwm(p) if self.hwm_ok else 0) for w, p in self.pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="file size per worker")
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ftidask-bench-levels-", dir=args.dir)
    rows_per_chunk = args.chunk_mib * 2**20 // 8 // 1024
    nchunks = args.workers * max(1, args.size_mib // args.chunk_mib)
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit=0, silence_logs=40) as cluster, Client(cluster) as client:
        x = da.random.default_rng(0).random((nchunks * rows_per_chunk, 1024), chunks=(rows_per_chunk, 1024))
        x = x.persist()
        wait(x)
        pids = client.run(os.getpid)
        ctx = ftidask.init(client=client, ckpt_dir=f"{root}/Local", glbl_dir=f"{root}/Global",
                           meta_dir=f"{root}/Meta", verbosity=3, progress="off", group_size=args.workers)
        ctx.protect(1, x)
        os.makedirs(f"{root}/raw", exist_ok=True)
        per_worker = x.nbytes // args.workers
        raw = min(max(client.run(_raw_write, per_worker, f"{root}/raw").values()) for _ in range(2))
        print(f"array {x.nbytes / 2**20:.0f} MiB on {args.workers} workers x 1 thread "
              f"({args.size_mib} MiB each), group of {args.workers}, ftidask from {ftidask.__file__}; baseline: "
              f"every worker's raw tofile+fsync of its {per_worker / 2**20:.0f} MiB at once, {raw:.2f} s (slowest)")
        try:
            ckpt = 0
            for level in args.levels:
                for _ in range(args.repeat):
                    ckpt += 1
                    time.sleep(0.5)  # let the workers settle (freed buffers, finished deletions)
                    with PeakRss(pids) as mem:
                        info = ctx.checkpoint(ckpt, level)
                    extra = {w: mem.peak[w] - mem.before[w] for w in pids}
                    sizes = "/".join(f"{s / 2**20:.0f}" for s in info.file_sizes)
                    print(f"L{level}: {info.seconds:.2f} s ({info.seconds / raw:.2f} x raw write of the rank files), "
                          f"files {sizes} MiB; worker RSS before "
                          f"{'/'.join(f'{mem.before[w] / 2**20:.0f}' for w in sorted(pids))} MiB, extra at peak "
                          f"{'/'.join(f'{extra[w] / 2**20:.0f}' for w in sorted(pids))} MiB "
                          f"(max {max(extra.values()) / 2**20:.0f} MiB, {'VmHWM' if mem.hwm_ok else 'sampled'})",
                          flush=True)
        finally:
            ctx.finalize()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
