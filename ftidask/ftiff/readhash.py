"""Read containers of a parsed FTI-FF file into memory the caller owns, hashing them as they arrive.

A recovery that stages its arrays' pages (:mod:`ftidask.engine.pagemove`) reads the file once, into
those pages, and checks each container's hash on the bytes read. A reader thread stays ahead of the
hash (both ``preadv`` and the hashes release the GIL), so the disk is never idle while a piece is
hashed: the pass costs what a raw read of the same bytes costs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import BinaryIO

from ..model.errors import FormatError
from . import hashing
from .reader import FtiffFile

PIECE = 8 << 20  # bytes per read; the hash follows one piece behind


def _read_full(fd: int, offset: int, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


class _Reader(threading.Thread):
    """Reads ``pieces`` in order; :meth:`wait` returns once piece ``k`` is in (False: the file ended)."""

    def __init__(self, fd: int, pieces: list[tuple[int, memoryview]]) -> None:
        super().__init__(name="ftidask-readahead", daemon=True)
        self.fd, self.pieces = fd, pieces
        self.done = 0  # pieces read in full
        self.short = False
        self.stop = False
        self.cond = threading.Condition()

    def run(self) -> None:
        for offset, view in self.pieces:
            full = not self.stop and _read_full(self.fd, offset, view) == len(view)
            with self.cond:
                self.short = not full
                self.done += full
                self.cond.notify_all()
            if not full:
                return

    def wait(self, k: int) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.done > k or self.short)
            return self.done > k


def read_verified(fh: BinaryIO, parsed: FtiffFile, views: Mapping[int, memoryview]) -> None:
    """Read every container of the variables in ``views`` into ``views[id][dptr:dptr + chunksize]``,
    checking its hash; :class:`FormatError` on a mismatch or a short file.

    The views then hold unverified bytes: the caller discards them (they are never a user's array).
    Only uncompressed containers of ftidask's files (not dCP, not FTI 1.1) are read this way.
    """
    jobs = [(bi, ci, meta) for bi, ci, meta in parsed.containers()
            if meta.hascontent and meta.chunksize and meta.id in views]
    spans = [[(meta.fptr + lo, views[meta.id][meta.dptr + lo:meta.dptr + min(lo + PIECE, meta.chunksize)])
              for lo in range(0, meta.chunksize, PIECE)] for _bi, _ci, meta in jobs]
    reader = _Reader(fh.fileno(), [piece for pieces in spans for piece in pieces])
    reader.start()
    try:
        k = 0
        for (bi, ci, meta), pieces in zip(jobs, spans):
            where = f"block {bi}, container {ci} (var id {meta.id}, containerid {meta.containerid})"
            hasher = hashing.new_hasher(parsed.fb.hash_id)
            for _offset, view in pieces:
                if not reader.wait(k):
                    raise FormatError(f"{where}: file ends inside its data", path=parsed.path)
                hasher.update(view)
                k += 1
            if hasher.digest() != meta.hash:
                raise FormatError(f"{where}: data hash does not match (damaged data)", path=parsed.path)
    finally:
        reader.stop = True
        reader.join()
