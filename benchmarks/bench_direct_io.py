"""Buffered writes against O_DIRECT writes with several writers on one disk: is direct I/O worth building?

    python benchmarks/bench_direct_io.py --procs 8 --mib 256 --repeat 3

Each of ``--procs`` processes writes its own file of ``--mib`` MiB at the same moment (a barrier), in turn:

- ``raw``: ``ndarray.tofile`` then ``fsync`` (the baseline of ``bench_levels_mpi.py``);
- ``writeback``: ftidask's way today: the bytes copied into a private 8 MiB buffer (the piece that is hashed), written
  through the page cache in 64 MiB writes, each followed by ``sync_file_range`` (early write-back), then ``fsync``;
- ``direct``: ``O_DIRECT``: each 8 MiB piece copied into an aligned buffer (the same private copy) and written from
  there by a second thread while the next one is copied (two buffers), then ``fsync`` (the device's cache).

Then, after the page cache is dropped for the files, a cold read by every process: ``np.fromfile`` against ``O_DIRECT``
reads of 8 MiB into aligned buffers. Printed: the slowest process's seconds (median and best of the rounds), GB/s of
all processes together and each mode's ratio to ``raw`` / ``fromfile`` of the same run. Modes run interleaved, round
by round. A file system refusing ``O_DIRECT`` (tmpfs) prints so and measures the buffered modes only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from timing import evict_file

PIECE = 8 << 20
WRITE = 64 << 20
ALIGN = 4096


def aligned(n: int) -> np.ndarray:
    """An ``n``-byte buffer whose address is a multiple of :data:`ALIGN` (O_DIRECT's rule)."""
    raw = np.empty(n + ALIGN, np.uint8)
    lo = (-raw.ctypes.data) % ALIGN
    return raw[lo:lo + n]


def write_raw(data: np.ndarray, path: Path) -> None:
    with open(path, "wb") as fh:
        data.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


try:  # imported once, here: inside the timed call its first round timed the import (0.3 s)
    from ftidask import _native
except ImportError:  # pragma: no cover - the native extension is optional
    _native = None


def write_writeback(data: np.ndarray, path: Path) -> None:
    src, buf = data.view(np.uint8), np.empty(PIECE, np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pending = 0
        for lo in range(0, src.size, PIECE):
            n = min(PIECE, src.size - lo)
            np.copyto(buf[:n], src[lo:lo + n])
            os.write(fd, memoryview(buf[:n]))
            pending += n
            if pending >= WRITE and _native is not None:
                _native.start_writeback(fd, lo + n - pending, pending)
                pending = 0
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(data: np.ndarray, path: Path, pool: ThreadPoolExecutor) -> None:
    src = data.view(np.uint8)
    depth = pool._max_workers
    bufs = [aligned(PIECE) for _ in range(depth + 1)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        inflight: list = []
        for i, lo in enumerate(range(0, src.size, PIECE)):
            n = min(PIECE, src.size - lo)
            buf = bufs[i % len(bufs)]
            while len(inflight) >= depth:  # the buffer about to be filled is free once the oldest write ended
                inflight.pop(0).result()
            np.copyto(buf[:n], src[lo:lo + n])
            whole = n + (-n) % ALIGN  # the tail padded to a whole block, cut by the ftruncate below
            inflight.append(pool.submit(os.pwrite, fd, memoryview(buf[:whole]), lo))
        for f in inflight:
            f.result()
        if src.size % ALIGN:
            os.ftruncate(fd, src.size)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_direct(path: Path, out: np.ndarray) -> None:
    buf = aligned(PIECE)
    dst = out.view(np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for lo in range(0, dst.size, PIECE):
            got = os.preadv(fd, [memoryview(buf)], lo)
            n = min(got, dst.size - lo)
            np.copyto(dst[lo:lo + n], buf[:n])
    finally:
        os.close(fd)


def proc(rank: int, args: argparse.Namespace, base: str, barrier, results, modes: list[str]) -> None:
    nbytes = args.mib << 20
    data = np.random.default_rng(rank).integers(0, 256, nbytes, np.uint8)
    out = np.empty(nbytes, np.uint8)
    path = Path(base) / f"rank{rank}.bin"
    pool = ThreadPoolExecutor(args.depth)
    times: dict[str, list[float]] = {m: [] for m in modes + ["fromfile", "direct-read"]}
    for _ in range(args.repeat):
        for mode in modes:
            path.unlink(missing_ok=True)
            barrier.wait()
            t0 = time.perf_counter()
            if mode == "raw":
                write_raw(data, path)
            elif mode == "writeback":
                write_writeback(data, path)
            else:
                write_direct(data, path, pool)
            times[mode].append(time.perf_counter() - t0)
            barrier.wait()
        assert np.array_equal(np.fromfile(path, np.uint8), data)  # the last mode wrote the data whole
        for reader in ("fromfile", "direct-read") if "direct" in modes else ("fromfile",):
            evict_file(path)
            barrier.wait()
            t0 = time.perf_counter()
            if reader == "fromfile":
                out = np.fromfile(path, np.uint8)
            else:
                read_direct(path, out)
            times[reader].append(time.perf_counter() - t0)
            barrier.wait()
        assert np.array_equal(out, data)
    results.put((rank, times))


def direct_supported(base: str) -> bool:
    try:
        fd = os.open(Path(base) / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, memoryview(aligned(ALIGN)), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(Path(base) / "probe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2, help="O_DIRECT writes in flight per process (threads)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as base:
        modes = ["raw", "writeback"] + (["direct"] if direct_supported(base) else [])
        if "direct" not in modes:
            print(f"{base}: this file system refuses O_DIRECT; buffered modes only")
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(args.procs), ctx.Queue()
        procs = [ctx.Process(target=proc, args=(r, args, base, barrier, results, modes)) for r in range(args.procs)]
        for p in procs:
            p.start()
        got = dict(results.get() for _ in procs)
        for p in procs:
            p.join()
    total = args.procs * (args.mib << 20)
    print(f"{args.procs} processes x {args.mib} MiB = {total >> 20} MiB, {os.cpu_count()} cores, "
          f"{args.repeat} rounds (interleaved); the slowest process's seconds")
    slowest = {m: [max(got[r][m][i] for r in got) for i in range(args.repeat)] for m in got[0] if got[0][m]}
    for group, base_mode in ((modes, "raw"), (["fromfile", "direct-read"], "fromfile")):
        for m in group:
            if m not in slowest:
                continue
            med, best = statistics.median(slowest[m]), min(slowest[m])
            ratio = med / statistics.median(slowest[base_mode])
            print(f"  {m:12s} median {med:7.3f} s  best {best:7.3f} s  {total / med / 1e9:6.2f} GB/s  "
                  f"{ratio:5.2f}x {base_mode} (median)  rounds {' '.join(f'{t:.3f}' for t in slowest[m])}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
