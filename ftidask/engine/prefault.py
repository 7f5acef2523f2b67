"""Fault in the pages of the arrays a recovery will fill, while their file is being verified.

A restart usually fills fresh arrays (``np.empty``/``np.zeros`` hold no page yet), and the first
write to each page costs a fault and the zeroing of a page: about as much as the copy itself. The
verification pass before it waits on the disk with a core to spare, so :class:`Prefault` faults the
pages in on a thread meanwhile (``MADV_POPULATE_WRITE``, Linux 5.14+, through the native helper).
Contents are unchanged, so a refused recovery still leaves every array as it was; where the kernel
or the build cannot do it, nothing happens and the copy faults the pages as before.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

try:  # the native helper is optional (built when a C compiler is there at install)
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

MIN_BYTES = 4 << 20  # smaller arrays fault in a few milliseconds: no thread for them
PIECE = 32 << 20  # bytes populated per call
_PAGE = mmap.PAGESIZE


def numpy_owned(array: np.ndarray) -> bool:
    """Whether ``array`` lies in memory NumPy allocated (private, anonymous), not a file or shared map."""
    base: Any = array
    while isinstance(base, np.ndarray) and not base.flags.owndata:
        base = base.base
    return isinstance(base, np.ndarray) and not isinstance(base, np.memmap)


def _targets(arrays: Iterable[Any]) -> list[tuple[memoryview, int]]:
    out = []
    for a in arrays:
        if (isinstance(a, np.ndarray) and a.nbytes >= MIN_BYTES and a.flags.writeable
                and (a.flags.c_contiguous or a.flags.f_contiguous) and numpy_owned(a)):
            out.append((memoryview(a.reshape(-1, order="A").view(np.uint8)), a.ctypes.data))
    return out


class Prefault:
    """``with Prefault(arrays): verify()``: the arrays' pages are faulted in while the body runs.

    Leaving the block waits for the thread (it never raises), so the copy that follows finds every page.
    """

    def __init__(self, arrays: Iterable[Any], buffers: Iterable[tuple[memoryview, int]] = ()) -> None:
        """``arrays``: user arrays (only NumPy's own memory is touched); ``buffers``: (bytes, address) pairs
        of memory ftidask mapped itself (:mod:`.pagemove`)."""
        usable = _native is not None and hasattr(_native, "populate_write")
        self.buffers = [*_targets(arrays), *buffers] if usable else []
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        # In pieces: the kernel holds the process's memory-map lock while it populates, and the
        # verification beside it maps the file (and starts threads) under that lock.
        for buf, addr in self.buffers:
            first = -addr % _PAGE  # cut at page boundaries, so that no page falls between two pieces
            cuts = sorted({0, *range(first, buf.nbytes, PIECE), buf.nbytes})
            for lo, hi in zip(cuts, cuts[1:]):
                try:
                    if hi - lo >= _PAGE and not _native.populate_write(buf[lo:hi]):
                        return  # refused (old kernel, unusual mapping): the copy faults the pages
                except Exception:  # noqa: BLE001 - a hint only: the copy faults the pages itself
                    return

    def __enter__(self) -> Prefault:
        if self.buffers:
            self._thread = threading.Thread(target=self._run, name="ftidask-prefault", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._thread.join()
        self._thread, self.buffers = None, []  # no view of staged pages outlives the block
