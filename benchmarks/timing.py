"""Timing helpers shared by the benchmark scripts (each runs as ``python benchmarks/NAME.py``, which puts
this directory on ``sys.path``)."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` calls of ``fn``, in seconds."""
    return min(timed(fn) for _ in range(repeat))


def evict_file(path: str | os.PathLike[str]) -> None:
    """Take ``path`` out of the page cache (written back first), for a read from a cold cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(root: str | os.PathLike[str]) -> None:
    """Take every file under ``root`` out of the page cache (what a restart on other nodes would read)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            evict_file(os.path.join(dirpath, name))


def map_large_arrays_afresh() -> bool:
    """Make this process's ``np.empty`` of 1 MiB or more a new anonymous mapping, no page of it touched, as a
    restarted program's first large arrays are (ftidask moves verified pages under such arrays instead of copying).

    glibc raises its mmap threshold (up to 32 MiB) when a mapped chunk is freed: after a loop made and freed arrays
    of one size, the next ``np.empty`` of that size reuses resident heap pages, neither fresh nor counted as new
    memory. The threshold is fixed at 1 MiB (as ``tests/freshpages.py`` does) and the free heap memory given back.
    An array on a mapping of the benchmark's own (``np.frombuffer(mmap.mmap(...))``) would be fresh too, but it is
    not NumPy's memory, which ftidask never moves pages under: it would time the copy, not a restart's path.
    False where glibc's ``mallopt`` is missing (the arrays may then not be fresh).
    """
    try:
        libc = ctypes.CDLL(None)
        done = libc.mallopt(-3, 1 << 20) == 1 and libc.mallopt(-1, 1 << 20) == 1  # M_MMAP_, M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return done


def fresh_rows_note(array_bytes: int) -> str:
    """'' when arrays of ``array_bytes`` are large enough for a recovery to move verified pages under fresh ones,
    else a note for the output: below ftidask's threshold a recovery copies into any array, so the rows named
    "fresh" time the copy path, as the rows of arrays in use do (a small run measures no page move)."""
    from ftidask.engine.pagemove import MIN_BYTES

    if array_bytes >= MIN_BYTES:
        return ""
    return (f"note: arrays of {array_bytes / 2**20:.1f} MiB, under {MIN_BYTES >> 20} MiB: a recovery copies into "
            "them; the 'fresh' rows time the copy path, not the page move of a restart's large arrays")
