"""L1 checkpoint and recovery of a ~1 GiB state against raw tofile+fsync / fromfile, same run.

    python benchmarks/bench_l1.py [--size-mib 1024] [--arrays 4] [--repeat 3] [--hash xxh3_128] [--drop-caches] [--dcp]

Prints throughputs, time ratios (ftidask's time over the raw one's, as docs/performance.md quotes them; target:
checkpoint <= 1.25x the raw write's time, recovery <= 1.25x the raw read's, i.e. at least 0.8x their speed, both
with files in the page cache) and the extra anonymous resident memory at peak (target < 128 MiB).

Then a restart from a cold cache (median of ``--repeat`` rounds, the variants interleaved): the
checkpoint file is evicted from the page cache before each read (``posix_fadvise(DONTNEED)`` on that
file only; ``--drop-caches`` drops the whole cache instead, as root: without write access to
``/proc/sys/vm/drop_caches`` the file is evicted as without it, with a note), and a verified ``recover()`` is
timed against a raw read of the same file: ``np.fromfile`` (a fresh array, as a restarting program
allocates one) and ``readinto`` the existing arrays. Target (issue 16): at most 1.05-1.1x the raw read.
``--dcp``: the checkpoints are differential (level 5, ``enable_dcp = 1``; after the first two, nothing changed: only
the digests are compared), and the restart reads a dCP file.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import threading
import time

import numpy as np
from timing import best, evict_file, fresh_rows_note, map_large_arrays_afresh

import ftidask


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """Samples RssAnon every millisecond while active; ``extra`` is the peak above the start."""

    def __enter__(self) -> PeakAnon:
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def raw_write(arrays, root) -> None:
    for i, a in enumerate(arrays):
        path = os.path.join(root, f"raw{i}.bin")
        with open(path, "wb") as fh:
            a.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())


def raw_read(arrays, root) -> list[np.ndarray]:
    return [np.fromfile(os.path.join(root, f"raw{i}.bin"), dtype=a.dtype) for i, a in enumerate(arrays)]


DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    """Whether this process may write ``DROP_CACHES`` (root): checked before the run, not after its warm part."""
    try:
        with open(DROP_CACHES, "w"):  # opened, nothing written: nothing dropped
            return True
    except OSError:
        return False


def evict(paths: list[str], drop_all: bool) -> None:
    """Take ``paths`` out of the page cache (``drop_all``: the whole cache, root only)."""
    if drop_all:
        os.sync()
        with open(DROP_CACHES, "w") as fh:
            fh.write("3\n")
        return
    for path in paths:
        evict_file(path)


def cold_restart(dirs: dict, arrays: list[np.ndarray], path: str, repeat: int, drop_all: bool) -> dict[str, float]:
    """Median seconds of each cold-cache variant, interleaved round by round."""
    targets = [np.ones_like(a) for a in arrays]  # pages already touched, like the arrays of a running program
    flat = np.ones(os.path.getsize(path), np.uint8)
    touched = ftidask.init(**dirs)
    for i, a in enumerate(targets):
        touched.protect(i + 1, a)

    def raw_into() -> None:  # one read(2) returns at most 2 GiB on Linux: loop until the file is in
        view, got = memoryview(flat), 0
        with open(path, "rb", buffering=0) as fh:
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: ended after {got} of {len(view)} bytes")
                got += n

    restart = ftidask.init(**dirs)

    def fresh() -> None:  # a restarting program's arrays: new, no page faulted in yet (not timed)
        for i, a in enumerate(arrays):
            restart.protect(i + 1, np.empty_like(a))

    variants = {"raw np.fromfile (fresh array)": (None, lambda: np.fromfile(path, np.uint8)),
                "raw readinto (existing array)": (None, raw_into),
                "recover into fresh arrays": (fresh, restart.recover),
                "recover into existing arrays": (None, touched.recover)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, (prepare, fn) in variants.items():
            if prepare is not None:
                prepare()
            evict([path], drop_all)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for a, b in zip(arrays, targets):
        assert np.array_equal(a, b), "recovered arrays differ"
    return {name: float(np.median(t)) for name, t in times.items()}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--arrays", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hash", default="xxh3_128", choices=["xxh3_128", "md5"])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--direct-io", choices=["on", "off"], default="off",
                    help="the direct_io setting: the rank file's data written around the page cache (O_DIRECT) or not")
    ap.add_argument("--drop-caches", action="store_true", help="cold cache: drop the whole page cache (root)")
    ap.add_argument("--dcp", action="store_true", help="differential checkpoints (level 5): a dCP file to restart from")
    args = ap.parse_args()
    if args.drop_caches and not can_drop_caches():
        print(f"note: --drop-caches needs write access to {DROP_CACHES} (root), which this process lacks: the "
              "checkpoint file alone is evicted (posix_fadvise DONTNEED), as without --drop-caches", flush=True)
        args.drop_caches = False
    level, name = (5, "L5 (dCP, unchanged)") if args.dcp else (1, "L1 (hashed)")
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        per = args.size_mib * 2**20 // args.arrays // 8
        map_large_arrays_afresh()  # each np.empty_like a new mapping, as a restarted program's first arrays
        if note := fresh_rows_note(per * 8):
            print(note, flush=True)
        rng = np.random.default_rng(0)
        arrays = [rng.random(per) for _ in range(args.arrays)]
        nbytes = sum(a.nbytes for a in arrays)
        dirs = dict(ckpt_dir=f"{root}/L", glbl_dir=f"{root}/G", meta_dir=f"{root}/M", verbosity=3, hash=args.hash,
                    direct_io=args.direct_io == "on", enable_dcp=int(args.dcp))
        ctx = ftidask.init(**dirs)
        for i, a in enumerate(arrays):
            ctx.protect(i + 1, a)
        raw_write(arrays, root)  # warm up both paths once
        ctx.checkpoint(1, level)
        t_raw_w = best(lambda: raw_write(arrays, root), args.repeat)
        ids = iter(range(2, 1000))
        with PeakAnon() as mem_w:
            t_ck = best(lambda: ctx.checkpoint(next(ids), level), args.repeat)
        t_raw_r = best(lambda: raw_read(arrays, root), args.repeat)
        ctx2 = ftidask.init(**dirs)
        for i, a in enumerate(arrays):
            ctx2.protect(i + 1, a)
        with PeakAnon() as mem_r:
            t_rec = best(ctx2.recover, args.repeat)
        gib = nbytes / 2**30
        print(f"state: {args.arrays} arrays, {nbytes / 2**20:.0f} MiB, hash {args.hash}, direct_io {args.direct_io}, "
              f"best of {args.repeat}")
        # ratio: time over the raw baseline's (below 1: faster), as the cold table below and the docs give it
        print(f"{'operation':34} {'seconds':>8} {'GiB/s':>7} {'x raw':>6}")
        print(f"{'raw tofile + fsync':34} {t_raw_w:8.3f} {gib / t_raw_w:7.2f} {'1.00':>6}")
        print(f"{'ftidask checkpoint ' + name:34} {t_ck:8.3f} {gib / t_ck:7.2f} {t_ck / t_raw_w:6.2f}")
        print(f"{'raw np.fromfile':34} {t_raw_r:8.3f} {gib / t_raw_r:7.2f} {'1.00':>6}")
        print(f"{'ftidask recover (verified)':34} {t_rec:8.3f} {gib / t_rec:7.2f} {t_rec / t_raw_r:6.2f}")
        print(f"extra anonymous RSS at peak: checkpoint {mem_w.extra / 2**20:.1f} MiB, "
              f"recovery {mem_r.extra / 2**20:.1f} MiB")
        path = max(glob.glob(f"{root}/L/**/Ckpt*-Rank0.fti", recursive=True), key=os.path.getmtime)
        cold = cold_restart(dirs, arrays, path, args.repeat, args.drop_caches)
        raw, into = cold["raw np.fromfile (fresh array)"], cold["raw readinto (existing array)"]
        print(f"\nrestart, cold cache ({'whole cache dropped' if args.drop_caches else 'file evicted'}), median of "
              f"{args.repeat}, {os.path.getsize(path) / 2**20:.0f} MiB file, {os.cpu_count()} cores")
        print(f"{'operation':34} {'seconds':>8} {'GiB/s':>7} {'x fromfile':>10} {'x readinto':>10}")
        for name, t in cold.items():
            print(f"{name:34} {t:8.3f} {gib / t:7.2f} {t / raw:10.2f} {t / into:10.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
