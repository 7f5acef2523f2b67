"""Copy-on-write snapshots (ftidask.memsnap): what the application waits for, and what it pays after.

    python benchmarks/bench_cow.py [--mib 1024] [--repeat 3] [--no-thp]

``--no-thp`` maps the array with MADV_NOHUGEPAGE: 4 KiB page-table entries to protect instead of
2 MiB ones, where transparent huge pages are on.

- protect: the time ``CowSnapshot([a])`` blocks (write-protecting the pages), against
  ``np.copyto`` of the same bytes into a preallocated buffer (the blocking copy it replaces);
- copy-out: MB/s of reading the snapshot out in 16 MiB pieces, untouched memory;
- writes during copy-out: a loop writing one byte per page of the whole array, alone and while
  another thread copies the snapshot out (first writes fault and copy a run of pages until the
  reader has got there), and the extra memory and the faults that cost; then with no reader (every
  page is copied: a fault per run, up to 2 MiB).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import numpy as np
from timing import best

from ftidask.memsnap import CowSnapshot, cow_available

PAGE = os.sysconf("SC_PAGE_SIZE")
PIECE = 16 << 20



def copy_out(snap: CowSnapshot, nbytes: int) -> None:
    out = np.empty(PIECE, np.uint8)
    src = snap.source(0)
    for lo in range(0, nbytes, PIECE):
        src.copy_into(lo, min(nbytes, lo + PIECE), out)


def touch_pages(a: np.ndarray, value: int) -> None:
    a[::PAGE] = value  # one write per page (numpy's strided store, GIL released)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-thp", action="store_true", help="no transparent huge pages for the array")
    args = parser.parse_args()
    ok, why = cow_available()
    if not ok:
        raise SystemExit(f"copy-on-write snapshots unavailable here: {why}")
    nbytes = args.mib << 20
    if args.no_thp:
        mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mem.madvise(mmap.MADV_NOHUGEPAGE)
        a = np.frombuffer(mem, np.uint8)
        a[:] = 1
    else:
        a = np.ones(nbytes, np.uint8)  # populated: the usual case for a solver's state
    dst = np.empty_like(a)
    gib = nbytes / (1 << 30)

    copy_s = best(lambda: np.copyto(dst, a), args.repeat)
    protect, release, out_s = [], [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        snap = CowSnapshot([a])
        protect.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy_out(snap, nbytes)
        out_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snap.release()
        release.append(time.perf_counter() - t0)
    print(f"array: {args.mib} MiB, page {PAGE} B, {'no ' if args.no_thp else ''}THP, best of {args.repeat}")
    print(f"protect (blocked time of the snapshot): {min(protect) * 1e3:8.1f} ms  ({min(protect) / gib * 1e3:.1f} ms/GiB)")
    print(f"np.copyto of the same bytes:            {copy_s * 1e3:8.1f} ms  ({copy_s / gib * 1e3:.1f} ms/GiB)")
    print(f"copy-out, nothing written:              {nbytes / min(out_s) / 1e6:8.0f} MB/s")
    print(f"release after full copy-out:            {min(release) * 1e3:8.1f} ms")

    plain = best(lambda: touch_pages(a, 2), args.repeat)
    during, peak, copied, lone, faults, lone_faults = [], [], [], [], [], []
    for k in range(args.repeat):
        snap = CowSnapshot([a])
        reader = threading.Thread(target=copy_out, args=(snap, nbytes))
        reader.start()
        t0 = time.perf_counter()
        touch_pages(a, 3 + k)
        during.append(time.perf_counter() - t0)
        reader.join()
        peak.append(snap.extra_bytes_peak)
        copied.append(snap.pages_copied)
        faults.append(snap.stats["faults"])
        snap.release()
        snap = CowSnapshot([a])  # no reader: every page is copied
        t0 = time.perf_counter()
        touch_pages(a, 9)
        lone.append(time.perf_counter() - t0)
        lone_faults.append(snap.stats["faults"])
        snap.release()
    pages = nbytes // PAGE
    print(f"write one byte per page, unprotected:   {plain * 1e3:8.1f} ms")
    print(f"  same, while copy-out runs:            {min(during) * 1e3:8.1f} ms  (x{min(during) / plain:.0f}); "
          f"{min(copied)}-{max(copied)} of {pages} pages copied, side copies peak "
          f"{min(peak) / 2**20:.0f}-{max(peak) / 2**20:.0f} MiB, {min(faults)}-{max(faults)} faults")
    print(f"  same, every page copied (no reader):   {min(lone) * 1e3:7.1f} ms  "
          f"({min(lone) / pages * 1e6:.1f} us per page; {min(lone_faults)}-{max(lone_faults)} faults)")


if __name__ == "__main__":
    main()
