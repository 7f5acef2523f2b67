"""Reading a file ahead of its consumer: a thread reads the next pieces while the caller hashes the last.

``preadv`` and the hashes both release the GIL, so with the read on its own thread the disk (or, from
the page cache, the memory copy) never waits for a hash, nor a hash for the disk: a verified read costs
about what the read alone costs, and with two threads reading (:data:`READERS`) less than one read.
:class:`ReadAhead` reads pieces in order into views the caller gives: distinct views (the data's final
place, no limit on how far it reads ahead) or views of a few buffers used in turn (``window`` pieces at
most ahead of the consumer, each buffer released by :meth:`release`).
A read error (``EIO``) is raised to the consumer as the ``OSError`` it was, never left to hang it; so is any
other error of a reader thread (a ``MemoryError`` of a recovery short of memory).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

PIECE = 2 << 20  # bytes per read of a span hashed through a ring of buffers
SLOTS = 6  # buffers in the ring: one being hashed, the others being read ahead
#: threads reading one span ahead of its hash: from the page cache, one thread's copy is the bottleneck (6 GB/s
#: here, where the hash runs at 50), two double it; from a disk, two reads in flight keep its queue fuller.
READERS = min(2, os.cpu_count() or 1)


def runs(items: Sequence[T], size: Callable[[T], int], at_least: int) -> list[list[T]]:
    """``items`` in order, cut into runs that each hold at least ``at_least`` bytes by ``size`` (the last one may
    hold fewer): a task per small item costs more than the item (10,000 variables of 1 KiB: 20,000 tasks for one
    recovery)."""
    out: list[list[T]] = []
    held = at_least
    for item in items:
        if held >= at_least:
            out.append([])
            held = 0
        out[-1].append(item)
        held += size(item)
    return out


def read_full(fd: int, offset: int, view: memoryview) -> int:
    """Read ``len(view)`` bytes at ``offset`` into ``view`` (at most 64 MiB per call); the count read (less: the
    file ended)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:got + (64 << 20)]], offset + got)
        if n <= 0:
            break
        got += n
    return got


class ReadAhead:
    """Reads ``pieces`` ((offset, view) pairs) on ``threads`` threads (piece k on thread k % threads), at most
    ``window`` pieces ahead of those released.

    ``with ReadAhead(fd, pieces) as ahead:`` then, for each piece k in order, :meth:`wait` (True once it is in,
    False when the file ended first) and, with a window, :meth:`release` once its view may be read into again.
    Leaving the block stops the threads and waits for them.
    """

    def __init__(self, fd: int, pieces: list[tuple[int, memoryview]], window: int | None = None,
                 threads: int = 1) -> None:
        self.fd, self.pieces, self.window = fd, pieces, window
        self.state = [0] * len(pieces)  # per piece: 0 pending, 1 read in full, 2 the file ended, 3 a read error
        self.released = 0  # pieces the consumer is through with
        self.error: BaseException | None = None
        self.stop = False
        self.cond = threading.Condition()
        self._threads = [threading.Thread(target=self._run, args=(j, threads), name="ftidask-readahead", daemon=True)
                         for j in range(max(1, min(threads, len(pieces))))]

    def _run(self, first: int, step: int) -> None:
        for k in range(first, len(self.pieces), step):
            offset, view = self.pieces[k]
            with self.cond:
                if self.window is not None:
                    self.cond.wait_for(lambda k=k: self.stop or k - self.released < self.window)
                if self.stop:
                    return
            try:
                state = 1 if read_full(self.fd, offset, view) == len(view) else 2
            except BaseException as exc:  # noqa: BLE001 - the consumer raises it (a piece never marked: a hang)
                state, self.error = 3, exc
            with self.cond:
                self.state[k] = state
                self.cond.notify_all()
            if state != 1:  # the pieces after it are not wanted: the consumer stops at this one
                return

    def wait(self, k: int) -> bool:
        """Whether piece ``k`` was read in full (False: the file ends first); an error of the read is raised."""
        with self.cond:
            self.cond.wait_for(lambda: self.state[k] != 0)
            if self.state[k] == 3 and self.error is not None:
                raise self.error
            return self.state[k] == 1

    def release(self) -> None:
        """The oldest piece not yet released is consumed: its view may be read into again."""
        with self.cond:
            self.released += 1
            self.cond.notify_all()

    def __enter__(self) -> ReadAhead:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        for thread in self._threads:
            thread.join()


def feed(fd: int, offset: int, length: int, update: Callable[[memoryview], object], ring: list[memoryview],
         threads: int = 1) -> bool:
    """Pass bytes ``[offset, offset + length)`` of the file to ``update`` piece by piece, the next pieces read
    into the other buffers of ``ring`` meanwhile by ``threads`` threads (the buffers' length is the piece's).
    False when the file ends first; a read's ``OSError`` is raised."""
    piece = len(ring[0])
    if length <= piece:  # one read: nothing to overlap
        view = ring[0][:length]
        if read_full(fd, offset, view) != length:
            return False
        update(view)
        return True
    spans = [(offset + lo, ring[i % len(ring)][:min(piece, length - lo)])
             for i, lo in enumerate(range(0, length, piece))]
    with ReadAhead(fd, spans, window=len(ring), threads=threads) as ahead:
        for k, (_offset, view) in enumerate(spans):
            if not ahead.wait(k):
                return False
            update(view)
            ahead.release()
    return True
