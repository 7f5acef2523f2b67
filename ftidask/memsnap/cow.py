"""Copy-on-write snapshots of NumPy arrays, in native code (``ftidask/csrc/cow.c`` and its ``cow_*.c`` parts).

Taking a snapshot write-protects the arrays' pages (a page-table walk, not a copy). Until a page
is read out, the first write to it (by any thread, or by the kernel: ``f.readinto(array)``) waits
while a native thread copies the page aside; reading out takes the side copy if there is one,
else the page itself, and then lifts the page's protection, so later writes cost nothing. A write
copies a run of pages around the one written (64 KiB, doubled while writes sweep on, up to 2 MiB),
so a sweep faults once per 2 MiB. The extra memory is the pages written before they were read out,
plus the pages copied ahead by runs that no sweep went on past, at most 32 MiB of those at a time
(:attr:`CowSnapshot.extra_bytes_peak`).

Where this cannot work (no native extension, not Linux, userfaultfd refused or without
write-protection, memory already registered elsewhere such as by the dCP page tracker, memory
that is not private anonymous), :class:`CowSnapshot` raises :class:`CowUnavailable` and the
caller copies the arrays instead.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

try:  # optional native helpers (built when a C compiler is there at install; see setup.py)
    from .. import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None  # type: ignore[assignment]

#: Bytes per piece yielded by :meth:`CowSource.pieces` (each piece is a fresh buffer).
PIECE = 16 << 20

_probe: tuple[bool, str] | None = None
_probe_lock = threading.Lock()


class CowUnavailable(OSError):
    """This process, kernel, build or memory does not allow a copy-on-write snapshot: copy instead."""


def _native_cow() -> Any:
    if _native is None or not hasattr(_native, "cow_new"):
        raise CowUnavailable(errno.ENOSYS, "the native extension ftidask._native is not built")
    return _native


def cow_available() -> tuple[bool, str]:
    """Whether copy-on-write snapshots work in this process, and if not, why (probed once)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            try:
                ok, why = _native_cow().cow_probe()
                _probe = (bool(ok), str(why))
            except CowUnavailable as exc:
                _probe = (False, exc.strerror or str(exc))
        return _probe


def _region(array: np.ndarray) -> tuple[int, int]:
    """The memory of ``array`` as (address, bytes). Its stream (C order, or the transpose's C
    order for a Fortran-ordered array, see :func:`ftidask.model.arrays.stream_order`) is then that
    memory in address order, so byte ``k`` of the stream is byte ``k`` of the region."""
    if not isinstance(array, np.ndarray):
        raise CowUnavailable(errno.EINVAL, f"a snapshot takes numpy arrays, got {type(array).__name__}")
    if array.dtype.hasobject:  # the bytes are pointers to objects the snapshot would not keep alive
        raise CowUnavailable(errno.EINVAL, "arrays of Python objects cannot be snapshot")
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise CowUnavailable(errno.EINVAL, "only C- or Fortran-contiguous arrays can be snapshot")
    return int(array.__array_interface__["data"][0]), int(array.nbytes)


class CowSnapshot:
    """The bytes of ``arrays`` as they are now, readable later while the arrays are written.

    Protects at construction (raises :class:`CowUnavailable`); :meth:`release` (or leaving the
    ``with`` block, or garbage collection) lifts all protection, early or not. The arrays are
    referenced until then: their memory must not be freed while it is protected; where it is
    (``ndarray.resize(refcheck=False)``, munmap, mremap), the copy-out of the pages not yet read
    out raises ``OSError(EFAULT)`` rather than read memory that is gone. Each byte of a
    source is read out once: a page read out in full is unprotected, and reading it again raises
    ``OSError(EALREADY)`` rather than return what was written since.
    """

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        native = _native_cow()
        self._handle: Any = None
        arrays = list(arrays)
        regions = [_region(a) for a in arrays]
        self._regions = regions
        self._sizes = [n for _addr, n in regions]
        self._native = native
        # Set before the protection: an interrupt (Ctrl-C) right after it still finds what release() needs.
        self._arrays: list[np.ndarray] | None = arrays
        try:
            self._handle = native.cow_new(regions)
        except OSError as exc:
            self._arrays = None
            raise CowUnavailable(exc.errno, f"copy-on-write snapshot: {exc.strerror}") from None

    def __len__(self) -> int:
        return len(self._sizes)

    def source(self, i: int) -> CowSource:
        """The byte source of ``arrays[i]`` as it was at construction (for the FTI-FF writer)."""
        if not 0 <= i < len(self._sizes):
            raise IndexError(f"snapshot has {len(self._sizes)} arrays, not {i + 1}")
        return CowSource(self, i, self._sizes[i])

    def _copy(self, i: int, start: int, out: np.ndarray) -> None:
        arrays = self._arrays
        if arrays is not None and _region(arrays[i])[0] != self._regions[i][0]:
            # ndarray.resize(refcheck=False) gave the array new memory and freed or moved the old:
            # the snapshot's pages are gone. The kernel reports that to the native side too
            # (UFFD_EVENT_UNMAP/REMAP), where it can; this also covers kernels that do not.
            raise OSError(errno.EFAULT, "a page was unmapped, moved or made inaccessible (munmap, mremap: a realloc or "
                          "ndarray.resize(refcheck=False); mprotect PROT_NONE) before it was read out")
        self._native.cow_copy(self._handle, i, start, out)

    def release(self) -> None:
        """Unprotect and unregister everything and free the side copies; idempotent. Waits for
        the copy-outs in flight; later ones raise ``OSError(EBADF)``."""
        if self._handle is not None and self._arrays is not None:
            self._native.cow_release(self._handle)
            self._arrays = None  # unprotected: the memory may be freed now

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._arrays is None

    def _stats(self) -> dict[str, Any]:
        return self._native.cow_stats(self._handle) if self._handle is not None else {}

    @property
    def extra_bytes_peak(self) -> int:
        """The most bytes of side copies held at once (pages written before they were read out)."""
        return int(self._stats().get("peak_bytes", 0))

    @property
    def pages_copied(self) -> int:
        """Pages copied aside because they, or a page of their run, were written before being
        read out."""
        return int(self._stats().get("pages_copied", 0))

    @property
    def stats(self) -> dict[str, Any]:
        """Counters from the native side: pages_copied, pages_copied_ahead (of those, copied by
        the run around a written page rather than for it), pages_lost (written when no memory
        was left, or dropped by madvise), faults (write faults handled), peak_bytes, live_bytes,
        pages (protected), ranges (registrations), unpopulated_protected, drops_reported (pages
        that madvise(DONTNEED/FREE) drops fail their copy-out; else they would read as zeros),
        unmaps_reported (pages that munmap or mremap take away, a realloc such as
        ``ndarray.resize(refcheck=False)``, fail their copy-out), safe_read (the live pages are read
        with ``process_vm_readv``: memory unmapped meanwhile fails the copy-out, never faults)."""
        return self._stats()

    def __enter__(self) -> CowSnapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        # Before the instance's attributes go: the arrays must outlive the protection.
        with contextlib.suppress(Exception):
            self.release()


class CowSource:
    """One array's snapshot bytes by range: the writer's ``ByteSource`` (no zero-copy view)."""

    def __init__(self, snapshot: CowSnapshot, index: int, nbytes: int) -> None:
        self._snapshot = snapshot
        self._index = index
        self.nbytes = nbytes

    def view(self, start: int, stop: int) -> memoryview | None:
        """Always None: the live memory is not the snapshot, so there is nothing to view."""
        return None

    def pieces(self, start: int, stop: int, piece: int = PIECE) -> Iterator[memoryview]:
        """Bytes ``[start, stop)`` in fresh buffers of at most ``piece`` bytes each."""
        for lo in range(start, stop, piece):
            hi = min(stop, lo + piece)
            buf = np.empty(hi - lo, np.uint8)
            self.copy_into(lo, hi, buf)
            yield memoryview(buf)

    def copy_into(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Copy bytes ``[start, stop)`` into the first bytes of ``out`` (C-contiguous, writable),
        without the GIL: the filled part of ``out`` as uint8."""
        if not 0 <= start <= stop <= self.nbytes:
            raise ValueError(f"bytes [{start}, {stop}) are not in a stream of {self.nbytes}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable C-contiguous array")
        flat = out.reshape(-1).view(np.uint8)
        if flat.nbytes < stop - start:
            raise ValueError(f"out holds {flat.nbytes} bytes, [{start}, {stop}) needs {stop - start}")
        dst = flat[:stop - start]
        self._snapshot._copy(self._index, start, dst)
        return dst
