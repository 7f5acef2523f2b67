"""Timing helpers shared by the benchmark scripts (each runs as ``python benchmarks/NAME.py``, which puts
this directory on ``sys.path``)."""

from __future__ import annotations

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
