"""Asynchronous checkpoints: how long the application is blocked, against the synchronous checkpoint
and a plain memcpy of the state, measured in one run.

    python benchmarks/bench_async.py [--gib 1 4] [--dir /tmp/bench-async] [--repeat 3]

For each state size and each snapshot mechanism available here (``cow``: copy-on-write, ``copy``:
staging buffers), one process protects the state (float64) and, medians of ``--repeat`` rounds
(each round runs every measurement once, interleaved, so that a noisy moment weighs on all alike):

* ``sync``: ``checkpoint(id, 1)`` (the whole write, fsync included);
* ``blocked``: the time ``checkpoint(id, 1, wait=False)`` takes to return; ``total``: until its
  handle's ``result()`` returns, the application idle meanwhile;
* ``memcpy``: ``numpy.copyto`` of the state into a buffer already faulted in (also timed in each round,
  just before the asynchronous call: the ratios use that median);
* ``loop``: a compute loop writing every page of the state once (``state += 1``) while the
  checkpoint is in flight, against the same loop with nothing in flight (slowdown ratio);
* ``extra``: the peak resident memory above the state while a checkpoint is in flight, with the
  loop (every page written) and with single writes to 5% of the pages, scattered (the target for
  copy-on-write: the pages written plus 64 MiB).

With torch installed, ``torch.distributed.checkpoint.save`` and ``async_save`` of the same array (a
tensor sharing its memory, one process) are timed the same way, and ftidask's sync, blocked and
total times are printed over torch's (``pip install -e '.[bench]'``).
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
from timing import timed

import ftidask

PAGE = os.sysconf("SC_PAGE_SIZE")


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
    scratch = np.empty_like(state)  # the memcpy's target, faulted in once, kept for the rounds below
    np.copyto(scratch, state)
    memcpy = statistics.median(timed(lambda: np.copyto(scratch, state)) for _ in range(repeat))
    loop_alone = statistics.median(timed(lambda: np.add(state, 1, out=state)) for _ in range(repeat))
    pages = state.nbytes // PAGE
    scattered = np.random.default_rng(1).choice(pages, pages // 20, replace=False) * (PAGE // 8)
    print(f"\n== state {gib:g} GiB ({state.nbytes / 2**30:.2f} GiB float64) ==")
    print(f"memcpy (numpy.copyto, warm)          {memcpy:8.3f} s")
    print(f"compute loop alone (state += 1)      {loop_alone:8.3f} s")
    ours: dict[str, dict[str, float]] = {}
    for mechanism in mechanisms():
        run = base / mechanism
        shutil.rmtree(run, ignore_errors=True)
        base_rss = rss()  # before the context: its staging buffers (copy) count as extra memory
        ctx = ftidask.init(ckpt_dir=str(run / "L"), glbl_dir=str(run / "G"), meta_dir=str(run / "M"), verbosity=3,
                           async_snapshot=mechanism)
        ctx.protect(1, state)
        ids = iter(range(1, 1000))
        ctx.checkpoint(next(ids), 1, wait=False).result()  # warm-up: staging buffers, threads
        m: dict[str, list[float]] = {k: [] for k in ("memcpy", "sync", "blocked", "total", "loop", "total_loop",
                                                     "extra_loop", "extra_sparse")}
        for _ in range(repeat):  # interleaved, so that a noisy moment weighs on all alike
            os.sync()  # each measurement starts with no dirty pages of the one before to write back
            m["sync"].append(timed(lambda: ctx.checkpoint(next(ids), 1)))
            os.sync()
            m["memcpy"].append(timed(lambda: np.copyto(scratch, state)))  # the baseline, beside the blocked call
            start = time.perf_counter()
            handle = ctx.checkpoint(next(ids), 1, wait=False)
            m["blocked"].append(time.perf_counter() - start)
            handle.result()
            m["total"].append(time.perf_counter() - start)
            assert handle.mechanism == mechanism, handle.mechanism
            os.sync()
            with PeakRss() as peak:  # a loop writing every page while the checkpoint is in flight
                start = time.perf_counter()
                handle = ctx.checkpoint(next(ids), 1, wait=False)
                m["loop"].append(timed(lambda: np.add(state, 1, out=state)))
                handle.result()
                m["total_loop"].append(time.perf_counter() - start)
            m["extra_loop"].append(peak.peak - base_rss)
            os.sync()
            with PeakRss() as peak:  # single writes to 5% of the pages, scattered
                handle = ctx.checkpoint(next(ids), 1, wait=False)
                state[scattered] += 1
                handle.result()
            m["extra_sparse"].append(peak.peak - base_rss)
        ctx.finalize()
        med = ours[mechanism] = {k: statistics.median(v) for k, v in m.items()}
        sync, b, t, copy = med["sync"], med["blocked"], med["total"], med["memcpy"]
        tag = f"[{mechanism}]"
        print(f"{tag:7}memcpy in the same rounds     {copy:8.3f} s")
        print(f"{tag:7}sync checkpoint               {sync:8.3f} s")
        print(f"{tag:7}async blocked                 {b:8.4f} s   {b / sync:6.3f}x sync   {b / copy:6.3f}x memcpy")
        print(f"{tag:7}async total (app idle)        {t:8.3f} s   {t / sync:6.3f}x sync")
        print(f"{tag:7}loop writing the state        {med['loop']:8.3f} s   {med['loop'] / loop_alone:6.2f}x alone "
              f"(total {med['total_loop']:.3f} s, {med['total_loop'] / sync:.2f}x sync; loop and writer share the cores)")
        print(f"{tag:7}peak extra memory, loop       {max(m['extra_loop']) / 2**20:8.1f} MiB "
              f"(the loop writes all {state.nbytes / 2**20:.0f} MiB)")
        written = scattered.size * PAGE
        print(f"{tag:7}peak extra memory, scattered  {max(m['extra_sparse']) / 2**20:8.1f} MiB "
              f"(pages written {written / 2**20:.0f} MiB; bound written + 64 MiB = {written / 2**20 + 64:.0f} MiB)")
    _torch(state, base, repeat, memcpy, ours)


def _torch(state: np.ndarray, base: Path, repeat: int, memcpy: float, ours: dict[str, dict[str, float]]) -> None:
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        print("torch.distributed.checkpoint.async_save: torch not installed, skipped")
        return
    tensor = torch.from_numpy(state)
    sync, blocked, total = [], [], []
    for i in range(repeat):
        os.sync()
        sync.append(timed(lambda i=i: dcp.save({"state": tensor}, checkpoint_id=str(base / f"torch-sync{i}"))))
        os.sync()
        start = time.perf_counter()
        future = dcp.async_save({"state": tensor}, checkpoint_id=str(base / f"torch{i}"))
        blocked.append(time.perf_counter() - start)
        future.result()
        total.append(time.perf_counter() - start)
    s, b, t = (statistics.median(x) for x in (sync, blocked, total))
    print(f"[torch]dcp.save                      {s:8.3f} s")
    print(f"[torch]dcp.async_save blocked        {b:8.4f} s   {b / s:6.3f}x its save   {b / memcpy:6.3f}x memcpy")
    print(f"[torch]dcp.async_save total          {t:8.3f} s   {t / s:6.3f}x its save")
    for mechanism, med in ours.items():  # the same array, the same run: ftidask's time over torch's
        tag = f"[{mechanism}]"
        print(f"{tag:7}ftidask / torch: sync {med['sync'] / s:.3f}x save, blocked {med['blocked'] / b:.3f}x "
              f"async_save's, total {med['total'] / t:.3f}x async_save's")



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
