"""Asynchronous checkpoints: how long the application is blocked, against the synchronous checkpoint
and a plain memcpy of the state, measured in one run.

    python benchmarks/bench_async.py [--gib 1 4] [--dir /tmp/bench-async] [--repeat 3]

For each state size and each snapshot mechanism available here (``cow``: copy-on-write, ``copy``:
staging buffers), one process protects the state (float64) and, medians of ``--repeat``:

* ``sync``: ``checkpoint(id, 1)`` (the whole write, fsync included);
* ``blocked``: the time ``checkpoint(id, 1, wait=False)`` takes to return; ``total``: until its
  handle's ``result()`` returns;
* ``memcpy``: ``numpy.copyto`` of the state into a buffer already faulted in;
* ``loop``: a compute loop writing every page of the state once (``state += 1``) while the
  checkpoint is in flight, against the same loop with nothing in flight (slowdown ratio);
* ``extra``: the peak resident memory above the state during an asynchronous checkpoint.

With torch installed, ``torch.distributed.checkpoint.async_save`` of the same arrays (as tensors,
one process) is timed the same way. Ratios are printed against the synchronous checkpoint and memcpy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import ftidask


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak resident memory while the block runs (sampled every millisecond)."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = rss(), False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def mechanisms() -> list[str]:
    out = ["copy"]
    try:
        from ftidask.memsnap.cow import cow_available

        if cow_available()[0]:
            out.insert(0, "cow")
    except ImportError:
        pass
    return out


def bench_size(gib: float, base: Path, repeat: int) -> None:
    n = int(gib * (1 << 30)) // 8
    state = np.random.default_rng(0).random(n)
    memcpy = _memcpy(state, repeat)
    loop_alone = statistics.median(_timed(lambda: np.add(state, 1, out=state)) for _ in range(repeat))
    print(f"\n== state {gib:g} GiB ({state.nbytes / 2**30:.2f} GiB float64) ==")
    print(f"memcpy (numpy.copyto, warm)      {memcpy:8.3f} s")
    print(f"compute loop alone (state += 1)   {loop_alone:8.3f} s")
    for mechanism in mechanisms():
        run = base / mechanism
        shutil.rmtree(run, ignore_errors=True)
        ctx = ftidask.init(ckpt_dir=str(run / "L"), glbl_dir=str(run / "G"), meta_dir=str(run / "M"), verbosity=3,
                           async_snapshot=mechanism)
        ctx.protect(1, state)
        ids = iter(range(1, 1000))
        sync = statistics.median(_timed(lambda: ctx.checkpoint(next(ids), 1)) for _ in range(repeat))
        blocked, total, loops, extra = [], [], [], []
        for _ in range(repeat):
            before = rss()
            with PeakRss() as peak:
                start = time.perf_counter()
                handle = ctx.checkpoint(next(ids), 1, wait=False)
                blocked.append(time.perf_counter() - start)
                loop_start = time.perf_counter()
                np.add(state, 1, out=state)
                loops.append(time.perf_counter() - loop_start)
                handle.result()
                total.append(time.perf_counter() - start)
            assert handle.mechanism == mechanism, handle.mechanism
            extra.append(peak.peak - before)
        ctx.finalize()
        b, t, lp = statistics.median(blocked), statistics.median(total), statistics.median(loops)
        print(f"[{mechanism}] sync checkpoint              {sync:8.3f} s")
        print(f"[{mechanism}] async blocked                {b:8.4f} s   {b / sync:6.3f}x sync   {b / memcpy:6.3f}x memcpy")
        print(f"[{mechanism}] async total                  {t:8.3f} s   {t / sync:6.3f}x sync")
        print(f"[{mechanism}] loop while in flight         {lp:8.3f} s   {lp / loop_alone:6.2f}x alone "
              "(loop and writer share the cores)")
        print(f"[{mechanism}] peak extra memory            {max(extra) / 2**20:8.1f} MiB "
              f"({max(extra) / state.nbytes:.2%} of the state)")
    _torch(state, base, repeat)


def _torch(state: np.ndarray, base: Path, repeat: int) -> None:
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        print("torch.distributed.checkpoint.async_save: torch not installed, skipped")
        return
    tensor = torch.from_numpy(state)
    blocked, total = [], []
    for i in range(repeat):
        start = time.perf_counter()
        future = dcp.async_save({"state": tensor}, checkpoint_id=str(base / f"torch{i}"))
        blocked.append(time.perf_counter() - start)
        future.result()
        total.append(time.perf_counter() - start)
    print(f"torch dcp.async_save blocked      {statistics.median(blocked):8.4f} s   "
          f"total {statistics.median(total):8.3f} s")


def _memcpy(state: np.ndarray, repeat: int) -> float:
    """numpy.copyto of the state into a buffer already faulted in (freed before the checkpoints)."""
    scratch = np.empty_like(state)
    np.copyto(scratch, state)
    return statistics.median(_timed(lambda: np.copyto(scratch, state)) for _ in range(repeat))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-async-"))
    print(f"ftidask {ftidask.__version__}; {os.cpu_count()} cores; files under {base}")
    try:
        for gib in args.gib:
            bench_size(gib, base, args.repeat)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
