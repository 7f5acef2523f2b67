"""Large arrays on mappings of their own, so that ``np.empty`` gives pages never touched (the recoveries that move
verified pages under fresh arrays, ftidask.engine.pagemove, take only those), in tests that run many ranks as
threads of one process after other tests."""

from __future__ import annotations

import ctypes

import pytest


def map_large_arrays_afresh() -> None:
    """glibc raises its mmap threshold (up to 32 MiB) when a mapped chunk is freed, and the next large arrays then
    come from recycled heap memory, touched; free heap memory that earlier tests of the process touched (their
    threads' arenas too) is served first even under a fixed threshold (a slow CI run failed so). The mmap and trim
    thresholds are fixed at 1 MiB for this process and the free memory given back (``malloc_trim``)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallopt")
