"""The native GF(2^8) kernel of the L3 codec, with large stripes split over a thread pool.

``ftidask._native.gf_matmul`` (``ftidask/csrc/gf256.c``) computes ``outs[i] (^)= XOR_j
mat[i][j] * ins[j]`` with split-nibble table lookups (SSSE3, AVX2, AVX-512BW, NEON) or GFNI affine
transforms, picked at run time from the CPU's features, and releases the GIL. It computes the
bytes of the NumPy code in :mod:`ftidask.levels.gf_numpy`, which stays the reference and the
fallback when the extension is not built (``tests/test_erasure_native.py`` compares the two).

Bytes are independent, so a stripe longer than ``PARALLEL_MIN_BYTES`` is cut into one piece per
core, each piece a kernel call on a pool thread: the codec then runs on every core.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

try:  # optional: built by setup.py when a C compiler is there at install
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["PARALLEL_MIN_BYTES", "available", "isa", "matmul", "threads"]

_kernel: Any = getattr(_native, "gf_matmul", None)  # None: an extension built before the kernel existed
#: Stripes at least this long (bytes per block) are split over the pool; below, a pool round trip
#: (tens of microseconds) costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 20
_PIECE_MIN_BYTES = 256 << 10  # a piece's table set-up is ~1 us: pieces this long amortise it
#: Threads per stripe; None: every core this process may run on. Benchmarks set 1 for per-core figures.
threads: int | None = None

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def available() -> bool:
    """True when ``ftidask._native`` has the GF(2^8) kernel."""
    return _kernel is not None


def isa() -> str | None:
    """The kernel's code path on this CPU (``"avx2"``, ``"gfni"``, ``"scalar"``...), None without it."""
    return str(_native.gf_isa()) if _kernel is not None else None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _executor() -> ThreadPoolExecutor:
    """The shared pool; a new one in a forked child (the parent's threads do not exist there)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_cores(), thread_name_prefix="ftidask-gf")
            _pool_pid = os.getpid()
        return _pool


def _flat(buf: Any) -> memoryview:
    """``buf`` as a 1-D memoryview of bytes, sharing its memory (the kernel refuses what is not contiguous)."""
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def matmul(mat: np.ndarray, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], accumulate: bool = False) -> None:
    """``outs[i] = XOR_j mat[i][j] * ins[j]`` (``^=`` with accumulate); 1-D contiguous uint8 of one length."""
    if _kernel is None:
        raise RuntimeError("ftidask._native has no GF(2^8) kernel (built without a C compiler?)")
    raw = np.ascontiguousarray(mat, np.uint8).tobytes()
    n = len(outs[0]) if len(outs) else 0
    want = _cores() if threads is None else max(1, threads)
    pieces = min(want, n // _PIECE_MIN_BYTES) if n >= PARALLEL_MIN_BYTES else 1
    if pieces <= 1:
        _kernel(raw, ins, outs, accumulate)
        return
    step = (-(-n // pieces) + 63) // 64 * 64  # whole cache lines: no two threads write one line
    spans = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    # Pieces are slices of memoryviews: a slice of a bytearray (or of bytes) would be a copy, and
    # the kernel would write the copy, leaving the caller's output unwritten.
    in_views, out_views = [_flat(a) for a in ins], [_flat(o) for o in outs]
    futures: list[Future[None]] = []
    try:
        for lo, hi in spans[1:]:
            futures.append(_executor().submit(_kernel, raw, [a[lo:hi] for a in in_views],
                                              [o[lo:hi] for o in out_views], accumulate))
        lo, hi = spans[0]
        _kernel(raw, [a[lo:hi] for a in in_views], [o[lo:hi] for o in out_views], accumulate)  # this thread too
    finally:
        for f in futures:  # every piece done before the caller may touch the buffers, error or not
            f.exception()
    for f in futures:
        f.result()
