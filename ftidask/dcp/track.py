"""Hash only the blocks whose pages were written: write tracking for differential checkpoints.

A differential checkpoint needs the digest of every block of the current data, to compare with
the spare file's. Without help that means reading the whole state. With the kernel's write
tracking (:mod:`ftidask.dcp.pagetrack`), the digests computed at the previous checkpoint are reused
for every block none of whose pages was written since; only the others are hashed.

When the answer is trusted, and when it is not:

* Only C- or F-contiguous arrays of at least :data:`MIN_TRACKED` bytes in private anonymous
  memory are tracked, and only the pages entirely inside the array (its first and last, partly
  shared pages are always hashed); two protected variables sharing a page are not both tracked.
* The digests kept are taken out before a variable is scanned and put back only once all its
  blocks are hashed: a checkpoint that fails in between leaves "unknown", i.e. hash everything.
* While any memory of the process is pinned for a device (``VmPin`` > 0, e.g. an RDMA
  registration), pages can change without a write through the page tables: nothing is
  protected, every block is hashed, and so is every block at the next checkpoint (a device
  writing through a pin taken before a protection never clears it). ``VmPin`` is read again
  after each scan, for a pin taken in between.
* In a forked child, the userfaultfd context and the pagemap descriptor are the parent's: the
  child forgets them without an ioctl and hashes everything.
* The pages are protected again in the same atomic step that lists them, before their blocks are
  hashed, so a write racing with the checkpoint is seen by the next one.
* Protection costs the program one minor fault per page first written in an interval (about
  1 µs per 4 KiB here). When a checkpoint finds more than half of a variable's pages written,
  the protection is lifted, and put back only after a checkpoint where at most half of its
  blocks changed: a program that rewrites all its state every step pays the faults of one
  interval, then hashes everything as without tracking.

``dcp_page_tracking = 0`` turns it off. Nothing here changes what is written, only how the
digests are obtained: the files are byte for byte those of hashing everything.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from . import pagetrack
from .pagetrack import PAGE, TrackingUnavailable, WriteTracker

log = logging.getLogger(__name__)

MIN_TRACKED = 1 << 20  # smaller variables are hashed whole: it costs less than a millisecond
_PROTECT_BELOW = 0.5  # fraction of pages written (or blocks changed) under which the next interval is tracked


_Digests = dict[int, tuple[int, np.ndarray]]  # container dptr -> (chunksize, (n, D) block digests)


@dataclasses.dataclass(frozen=True)
class KnownDigests:
    """A variable's block digests as last hashed, and which of its pages were written since."""

    address: int  # of the variable's first byte
    digests: _Digests  # as hashed last time (chunksize then)
    dirty_prefix: np.ndarray  # dirty_prefix[i] = dirty pages among the first i pages of the variable

    def container(self, dptr: int, chunksize: int, block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For the container at ``dptr`` (``chunksize`` bytes now): ``(digests, stale)``, the
        known digest of every block and the mask of the blocks to hash; None when none is known."""
        known = self.digests.get(dptr)
        if known is None:
            return None
        old_size, old = known
        count = -(-chunksize // block_size)
        index = np.arange(count, dtype=np.int64)
        starts = dptr + index * block_size
        stops = np.minimum(starts + block_size, dptr + chunksize)
        # Usable: the block was hashed over the same bytes (not cut short by a size change since).
        ends = (index + 1) * block_size
        usable = (index < len(old)) & (np.minimum(ends, chunksize) == np.minimum(ends, old_size))
        first_page = self.address // PAGE
        pages0 = (self.address + starts) // PAGE - first_page
        pages1 = (self.address + stops - 1) // PAGE - first_page + 1
        stale = (self.dirty_prefix[pages1] > self.dirty_prefix[pages0]) | ~usable
        digests = np.zeros((count, old.shape[1]), np.uint8)
        kept = min(count, len(old))
        digests[:kept] = old[:kept]
        return digests, stale


@dataclasses.dataclass
class _Tracked:
    start: int  # the page-aligned range registered
    stop: int
    address: int
    nbytes: int
    protected: bool = True  # protected before the last hashing: a scan now is meaningful
    digests: _Digests | None = None  # None: unknown (hash everything)
    changed: float = 0.0  # fraction of blocks changed at the last checkpoint


class DcpTracking:
    """One rank's tracked variables. :meth:`before_hash` and :meth:`after_hash` frame the hashing
    of one variable by the differential writer."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._tracker: WriteTracker | None = None
        self._vars: dict[int, _Tracked] = {}
        self._pending: dict[int, tuple[bool, _Digests | None]] = {}  # var id -> (protected, digests before)
        self._refused: dict[int, tuple[int, int]] = {}  # var id -> (address, bytes) of memory not tracked
        self._prescans: dict[int, KnownDigests | None] = {}  # var id -> a scan taken at an async call
        self._pid = os.getpid()

    def prescan(self, var_id: int, view: memoryview | None) -> None:
        """Scan ``var_id``'s live pages now, for an asynchronous checkpoint that hashes a snapshot of
        them later: the next :meth:`before_hash` of ``var_id`` answers from this scan."""
        self._prescans[var_id] = self._scan(var_id, view)

    def before_hash(self, var_id: int, view: memoryview | None) -> KnownDigests | None:
        """Scan ``var_id``'s pages (its bytes as ``view``, None if not contiguous): the digests
        that can be reused, or None to hash every block. After :meth:`prescan`, that scan's answer
        (``view`` is then a snapshot of the pages scanned, and is not looked at)."""
        if var_id in self._prescans:
            return self._prescans.pop(var_id)
        return self._scan(var_id, view)

    def forget_prescans(self) -> None:
        """The asynchronous checkpoint that took the scans did not hash (failed before): hash everything."""
        for var_id in self._prescans:
            self._pending.pop(var_id, None)
        self._prescans.clear()

    def _scan(self, var_id: int, view: memoryview | None) -> KnownDigests | None:
        self._pending.pop(var_id, None)
        if os.getpid() != self._pid:
            self._leave_to_parent()
        if not self.enabled or view is None or view.nbytes < MIN_TRACKED:
            return None
        address = int(np.frombuffer(view, np.uint8).ctypes.data)
        if self._refused.get(var_id) == (address, view.nbytes):
            return None
        state = self._vars.get(var_id)
        # A device writing through memory pinned now would not clear any protection set now:
        # while anything is pinned, nothing is protected, and the next checkpoint trusts no scan.
        pinned = pagetrack.pinned_bytes() != 0
        try:
            if state is None or (state.address, state.nbytes) != (address, view.nbytes):
                if not pinned:
                    self._start(var_id, address, view.nbytes)
                    self._pending[var_id] = (True, None)
                return None
            digests, state.digests = state.digests, None  # unknown until this hashing completes
            tracker = self._tracker
            if tracker is None:
                raise TrackingUnavailable(0, "no tracker")
            if not state.protected or digests is None or pinned:
                protect = state.changed <= _PROTECT_BELOW and not pinned
                if protect:
                    tracker.protect(state.start, state.stop)
                self._pending[var_id] = (protect, digests)
                return None
            written = tracker.written(state.start, state.stop, protect=True)  # atomic: lose no write
            if pagetrack.pinned_bytes() != 0:  # pinned meanwhile: the scan may miss what comes next
                self._pending[var_id] = (False, digests)
                return None
            pages = int((written[:, 1] - written[:, 0]).sum()) // PAGE if len(written) else 0
            protect = pages <= _PROTECT_BELOW * (state.stop - state.start) // PAGE
            if not protect:  # most pages written: stop the faults for the next interval
                tracker.protect(state.start, state.stop, on=False)
            self._pending[var_id] = (protect, digests)
        except TrackingUnavailable as exc:
            self._stop(var_id)
            self._refused[var_id] = (address, view.nbytes)  # a new array under this id is tried again
            log.info("variable %d: write tracking off (%s); every block is hashed", var_id, exc.strerror or exc)
            return None
        return KnownDigests(address, digests, _dirty_prefix(address, view.nbytes, state.start, state.stop, written))

    def after_hash(self, var_id: int, digests: _Digests) -> None:
        """Every block of ``var_id`` was hashed into ``digests`` (container dptr -> (chunksize, digests))."""
        pending = self._pending.pop(var_id, None)
        state = self._vars.get(var_id)
        if pending is None or state is None:
            return
        state.protected, old = pending
        state.digests = digests
        if old is not None:
            state.changed = _changed_fraction(old, digests)

    def _leave_to_parent(self) -> None:
        """In a forked child: the registrations and scans are the parent's; forget them all
        without a single ioctl (they would act on the parent's pages) and hash everything."""
        self.enabled = False
        self._tracker = None  # its descriptors are closed with the child's copy of the object
        self._vars.clear()
        self._pending.clear()
        self._prescans.clear()

    def close(self) -> None:
        """Close the write tracker (userfaultfd) and forget every variable's registration and scans."""
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None
        self._vars.clear()
        self._pending.clear()
        self._prescans.clear()

    def _start(self, var_id: int, address: int, nbytes: int) -> None:
        self._stop(var_id)
        start, stop = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
        if stop <= start:
            raise TrackingUnavailable(0, "no whole page")
        if any(t.start < stop and start < t.stop for t in self._vars.values()):
            raise TrackingUnavailable(0, "it shares pages with another protected variable")
        if not pagetrack.anonymous_private(start, stop):
            raise TrackingUnavailable(0, "its memory is not private anonymous memory")
        if self._tracker is None:
            try:
                self._tracker = WriteTracker()
            except TrackingUnavailable:
                self.enabled = False  # the kernel cannot: do not ask again for every variable
                raise
        self._tracker.register(start, stop)
        self._vars[var_id] = _Tracked(start, stop, address, nbytes)

    def _stop(self, var_id: int) -> None:
        state = self._vars.pop(var_id, None)
        if state is not None and self._tracker is not None:
            self._tracker.unregister(state.start, state.stop)


def _dirty_prefix(address: int, nbytes: int, start: int, stop: int, written: np.ndarray) -> np.ndarray:
    """Prefix sums of a per-page dirty mask over the variable's pages; the pages outside the
    registered ``[start, stop)`` (first and last, shared with other data) always count as dirty."""
    first = address // PAGE
    pages = (address + nbytes - 1) // PAGE - first + 1
    edges = np.zeros(pages + 1, np.int64)  # +1 where a written range starts, -1 where it ends
    np.add.at(edges, (written[:, 0] // PAGE - first).astype(np.int64), 1)
    np.add.at(edges, (written[:, 1] // PAGE - first).astype(np.int64), -1)
    dirty = np.cumsum(edges[:-1]) > 0
    dirty[:start // PAGE - first] = True
    dirty[stop // PAGE - first:] = True
    return np.concatenate(([0], np.cumsum(dirty, dtype=np.int64)))


def _changed_fraction(old: _Digests, new: _Digests) -> float:
    changed = total = 0
    for dptr, (_size, digests) in new.items():
        total += len(digests)
        before = old.get(dptr)
        if before is None or before[1].shape != digests.shape:
            changed += len(digests)
        else:
            changed += int((before[1] != digests).any(axis=1).sum())
    return changed / total if total else 0.0
