"""Recover into fresh arrays without a copy after verification: verified pages are moved, not copied.

A recovery must verify every byte before an array holds it, so it reads the whole file (hashing it)
and then copies it into the arrays: that copy comes after the last hash, on no disk's time, and costs
0.05 s per GiB here (15-20% of a cold read). A restarting program's arrays are usually fresh: none of
their pages was ever touched. For those, :class:`Staged` maps private pages mirroring the array, the
verification reads the file into them while hashing, and :meth:`Staged.commit` moves them under the
array (``mremap``, page tables only) once every hash matched and every rank agreed. The array never
holds an unverified byte; a refused recovery unmaps the staged pages and the array is as it was.

Only arrays that can take it are staged (:func:`movable`): NumPy's own memory, private and anonymous,
no userfaultfd, lock or other special mapping, every whole page never touched (``/proc/self/pagemap``),
and at least :data:`MIN_BYTES`. Any other array is filled by the copy, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ftiff.reader import FtiffFile
from .prefault import numpy_owned

try:  # the native helper is optional (built when a C compiler is there at install)
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

PAGE = mmap.PAGESIZE
MIN_BYTES = 16 << 20  # below this, the copy costs about as much as mapping and moving
enabled = _native is not None and hasattr(_native, "page_move")  # a switch (and a test seam)
#: bytes moved and staged arrays copied instead (mremap refused): for the tests and benchmarks.
stats = {"moved_bytes": 0, "copied_back": 0}
_PAGEMAP_CHUNK = 1 << 18  # pagemap entries read at a time (1 GiB of 4 KiB pages)
_SAFE_FLAGS = {"rd", "wr", "mr", "mw", "me", "ac", "hg", "nh", "sd"}  # smaps VmFlags a plain heap array has


def _whole_pages(array: np.ndarray) -> tuple[int, int]:
    addr = array.ctypes.data
    return -(-addr // PAGE) * PAGE, (addr + array.nbytes) // PAGE * PAGE


def _never_touched(lo: int, hi: int) -> bool:
    """Whether no page of [lo, hi) was ever present, swapped or file-backed (pagemap bits 61-63).

    Read a few entries first, then ever more: a touched array (the usual case once a program ran) is told by
    its first pages in microseconds; only a fresh one costs a read of every entry (8 bytes per page).
    """
    first, count = lo // PAGE, (hi - lo) // PAGE
    with open("/proc/self/pagemap", "rb", buffering=0) as fh:
        at, n = 0, 16
        while at < count:
            n = min(n, _PAGEMAP_CHUNK, count - at)
            raw = os.pread(fh.fileno(), n * 8, (first + at) * 8)
            if len(raw) != n * 8 or (np.frombuffer(raw, np.uint64) >> np.uint64(61)).any():
                return False
            at, n = at + n, n * 16
    return True


def _plain_mappings() -> list[tuple[int, int, bool]]:
    """Every mapping of this process: (start, end, private anonymous with no flag beyond a plain heap's).

    ``/proc/self/maps`` tells private anonymous mappings in a fraction of a millisecond; only the flags it does not
    show need ``/proc/self/smaps``, which walks every resident page of the process (5 ms for a bare interpreter,
    17 ms for an MPI rank here, more with a large heap: a recovery of 128 MiB reads its file in about 25 ms).
    Of those flags, the two that moving pages would change for the program are a lock (``mlock``: the moved pages
    would no longer be locked) and a ``userfaultfd`` registration (its handler would no longer see the range); a
    process with neither (``VmLck`` of 0, no userfaultfd open) needs no ``smaps``. The others (``madvise``'s
    don't-fork, don't-dump, wipe-on-fork, mergeable) say nothing of the array's bytes and are dropped with the
    pages they applied to, as ``realloc`` would drop them.
    """
    if _locked_or_faulted():
        return _mappings("/proc/self/smaps")
    return _mappings("/proc/self/maps")


def _locked_or_faulted() -> bool:
    """Whether this process has locked memory or an open userfaultfd (then only ``smaps`` tells which mappings)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmLck:") and line.split()[1] != "0":
                return True
    fds = "/proc/self/fd"
    for name in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{name}") == "anon_inode:[userfaultfd]":
                return True
        except OSError:  # closed since it was listed (the listing's own fd among them)
            continue
    return False


def _mappings(source: str) -> list[tuple[int, int, bool]]:
    """The mappings ``source`` lists (``maps`` or ``smaps``), each with whether it is plain (``smaps``: its
    ``VmFlags`` too)."""
    out: list[tuple[int, int, bool]] = []
    with open(source) as fh:
        for line in fh:
            if line.startswith("VmFlags:"):
                if out:
                    start, end, plain = out[-1]
                    out[-1] = (start, end, plain and set(line.split()[1:]) <= _SAFE_FLAGS)
                continue
            head = line.split(None, 6)
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # range perms offset dev inode [path]
                start, end = (int(x, 16) for x in head[0].split("-"))
                anonymous = head[4] == "0" and (len(head) == 5 or head[5].strip() == "[heap]")
                out.append((start, end, head[1] == "rw-p" and anonymous))
    return out


def _plain_anonymous(lo: int, hi: int, mappings: list[tuple[int, int, bool]]) -> bool:
    """Whether [lo, hi) lies, without a gap, in plain private anonymous mappings."""
    covered = lo
    for start, end, plain in mappings:
        if start < hi and end > lo:
            if not plain or start > covered:
                return False
            covered = max(covered, end)
    return covered >= hi


def _fresh(array: Any) -> bool:
    """:func:`movable`'s checks but the mappings': NumPy's own writable C-ordered memory, large enough, whose
    whole pages were never touched."""
    if not enabled or not isinstance(array, np.ndarray) or array.nbytes < MIN_BYTES:
        return False
    if not (array.flags.writeable and array.flags.c_contiguous and numpy_owned(array)):
        return False
    lo, hi = _whole_pages(array)
    try:
        return hi > lo and _never_touched(lo, hi)
    except (OSError, ValueError):  # no /proc: copy as before
        return False


def movable(array: Any, mappings: list[tuple[int, int, bool]] | None = None) -> bool:
    """Whether ``array`` can be recovered by moving verified pages under it (see the module's doc).

    ``mappings``: this process's, as :func:`_plain_mappings` reads them (read here when needed and not given).
    """
    if not _fresh(array):
        return False
    try:
        return _plain_anonymous(*_whole_pages(array), mappings or _plain_mappings())
    except (OSError, ValueError):  # no /proc (or an unexpected line): copy as before
        return False


def movable_arrays(arrays: dict[int, Any]) -> dict[int, np.ndarray]:
    """Those of ``arrays`` (by var id) that :func:`movable` accepts; the mappings are read once, and only when
    an array passes the cheap checks (a recovery into arrays already in use, never staged, need not read them)."""
    fresh = {vid: a for vid, a in arrays.items() if _fresh(a)}
    if not fresh:
        return {}
    try:
        mappings = _plain_mappings()
    except (OSError, ValueError):
        return {}
    return {vid: a for vid, a in fresh.items() if _plain_anonymous(*_whole_pages(a), mappings)}


class Staged:
    """Private pages mirroring ``array``'s pages: filled through :attr:`view`, then moved under it."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.addr, self.nbytes = array.ctypes.data, array.nbytes
        self.page_lo = self.addr // PAGE * PAGE
        self.size = -(-(self.addr + self.nbytes) // PAGE) * PAGE - self.page_lo
        self.base = _native.page_map(self.size, self.page_lo)
        self._unmap = weakref.finalize(self, _native.page_unmap, self.base, self.size)  # on any path out
        offset = self.addr - self.page_lo
        # the array's bytes, at the same offset in their page as in the array's
        self.view = memoryview((ctypes.c_ubyte * self.size).from_address(self.base)).cast("B")[
            offset:offset + self.nbytes]

    def commit(self) -> None:
        """Put the verified bytes in the array: partial edge pages copied, whole pages moved."""
        lo, hi = _whole_pages(self.array)
        src = self.base + (lo - self.page_lo)
        self.view.release()
        ctypes.memmove(self.addr, self.base + (self.addr - self.page_lo), lo - self.addr)  # head: shared page
        ctypes.memmove(hi, src + (hi - lo), self.addr + self.nbytes - hi)  # tail: shared page
        if _native.page_move(src, lo, hi - lo):
            stats["moved_bytes"] += hi - lo
            self._unmap.detach()
            _native.page_unmap(self.base, src - self.base)  # what is left of the staged mapping: its edges
            _native.page_unmap(src + (hi - lo), self.base + self.size - (src + (hi - lo)))
        else:  # refused (an unusual mapping after all): the verified bytes are copied instead
            ctypes.memmove(lo, src, hi - lo)
            stats["copied_back"] += 1
            self.release()

    def release(self) -> None:
        """Unmap the staged pages (a refused or abandoned recovery); idempotent."""
        self.view.release()
        self._unmap()


def release_all(staged: dict[int, Staged] | None) -> None:
    """Release every staged array of a recovery that did not commit them."""
    for s in (staged or {}).values():
        s.release()


Stager = Callable[[FtiffFile], dict[int, "Staged"]]


def stager(arrays: dict[int, np.ndarray]) -> Stager | None:
    """For :func:`~ftidask.engine.recovery.check_file`: stage those of ``arrays`` (movable ones, by var id)
    that a parsed file holds as they are (same dtype, shape and C order); None if none can be."""
    if not arrays:
        return None

    def stage(parsed: FtiffFile) -> dict[int, Staged]:
        out: dict[int, Staged] = {}
        if parsed.legacy:  # FTI 1.1's files: checked whole, VB checksum included (ftiff.reader.verify_data)
            return out
        for vid, array in arrays.items():
            info = parsed.vars.get(vid)
            if (info is None or info.order != "C" or info.dtype != array.dtype
                    or info.shape != tuple(array.shape)):
                continue
            try:
                out[vid] = Staged(array)
            except (OSError, ValueError, MemoryError):  # no staged pages to be had: this one is copied
                continue
        return out

    return stage
