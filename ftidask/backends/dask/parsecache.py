"""The parsed metadata of the rank files a worker reads chunks from, kept while each file is unchanged.

A recovery reads a rank file chunk by chunk, one task per chunk, and each read parsed the whole file first
(file block, every container's metadata, the variable table that lists every chunk): a file of ``n`` chunks
cost ``n`` parses of an ``n``-entry table, 7 s for 512 chunks and 160 s for 2048 on one core. The check that
precedes the reads parses each file once on the worker that serves it; the reads there reuse that parse.

What is kept was verified when parsed (its own hashes, the file block's), and is used only while the file
is the very one parsed (device, inode, size, modification and change times: :func:`identity_of`) and
belongs to the checkpoint asked for (its file block's hash); every chunk read is still checked against its
container's hash, so a file changed in a way the times do not show gives a failed read, never wrong data.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import BinaryIO

from ...ftiff.reader import FtiffFile, identity_of, parse_ftiff
from ...ftiff.structs import ContainerMeta

_MOST = 16  # files kept per worker process (a worker serves its own rank's file, a stand-in a few more)
_kept: OrderedDict[str, tuple[FtiffFile, dict[tuple[int, int], ContainerMeta]]] = OrderedDict()
_lock = threading.Lock()


Entry = tuple[FtiffFile, dict[tuple[int, int], ContainerMeta]]


def _parse(fh: BinaryIO, path: str) -> Entry:
    parsed = parse_ftiff(fh, path)
    index: dict[tuple[int, int], ContainerMeta] = {}
    for _b, _c, meta in parsed.containers():
        if meta.hascontent:
            index.setdefault((meta.id, meta.dptr), meta)  # the first, as a search in file order finds
    with _lock:
        _kept[path] = (parsed, index)
        _kept.move_to_end(path)
        while len(_kept) > _MOST:
            _kept.popitem(last=False)
    return parsed, index


def parse_kept(fh: BinaryIO, path: str) -> FtiffFile:
    """Parse the open file ``fh`` (at ``path``) now, and keep the result for :func:`parsed`."""
    return _parse(fh, path)[0]


def parsed(fh: BinaryIO, path: str, fb_hash: str) -> Entry:
    """The metadata of the open file ``fh`` and its containers with content by (var id, dptr): the kept parse
    if ``fh`` is the file parsed, unchanged, and its file block's hash is ``fb_hash``; else parsed now."""
    identity = identity_of(os.fstat(fh.fileno()))
    with _lock:
        hit = _kept.get(path)
    if hit is not None and hit[0].identity == identity and hit[0].fb.hash.hex() == fb_hash:
        return hit
    return _parse(fh, path)


def forget() -> None:
    """Drop every kept parse (a worker keeps at most :data:`_MOST`)."""
    with _lock:
        _kept.clear()
