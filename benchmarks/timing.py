"""Timing helpers shared by the benchmark scripts (each runs as ``python benchmarks/NAME.py``, which puts
this directory on ``sys.path``)."""

from __future__ import annotations

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
