"""Check the containers of a parsed FTI-FF file against their hashes, reading the file, never mapping it.

A map would spare a copy, but a mapped file that shrinks under its reader (another process, a truncation
by a failing job) or whose disk cannot read a page kills the process with SIGBUS: no fallback to a
partner copy, the parity or an older checkpoint could follow. Read with ``preadv`` into buffers of each
thread (:mod:`.readahead`: the next piece read while one is hashed), the same faults are a short read or an
``OSError``: a damaged file. Containers are checked on several threads (``preadv`` and the hashes release
the GIL), each one piece by piece. A compressed container whose hash matched is then decoded a frame at a
time (:class:`~.compression.StoredSpan`), each frame read again from the pages just read: a copy of the whole
container could double a recovery's memory, a map of it would end the process if the file were cut meanwhile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import compression, hashing, readahead
from .structs import ContainerMeta

THREADS = min(4, os.cpu_count() or 1)  # containers checked at once
#: at most this many bytes in all are checked on the caller's thread: starting threads (and their buffers) costs
#: more than hashing a few MiB (a 1 MiB state's recovery took 50-100 ms on a loaded 2-core machine, nearly all of
#: it spent waiting for the verifying threads to start)
INLINE_BYTES = 4 << 20
BATCH_BYTES = 1 << 20  # containers smaller than this are checked a run of them per task (readahead.runs)
_local = threading.local()


def ring_for(biggest: int, ring: list[memoryview] | None = None) -> list[memoryview]:
    """Read buffers to check containers of up to ``biggest`` bytes through (:func:`container_problem`): ``ring`` when
    it is large enough, else new ones, no more than such a container needs: a whole ring (12 MiB, zeroed) to check
    containers of 1 MiB held several times the bytes checked (a restart into small arrays in use: more than their
    buffer did)."""
    piece = max(1, min(readahead.PIECE, biggest))
    count = max(1, min(readahead.SLOTS, -(-biggest // piece)))
    if ring is None or len(ring[0]) < piece or len(ring) < count:
        ring = [memoryview(bytearray(piece)) for _ in range(count)]
    return ring


def _ring(biggest: int = readahead.PIECE * readahead.SLOTS) -> list[memoryview]:
    """This thread's read buffers (the verifying threads live as long as one check), sized by :func:`ring_for`."""
    _local.ring = ring_for(biggest, getattr(_local, "ring", None))
    return _local.ring


def container_what(bi: int, ci: int, meta: ContainerMeta) -> str:
    """How a refusal names container ``ci`` of block ``bi``."""
    return f"block {bi}, container {ci} (var id {meta.id}, containerid {meta.containerid})"


def container_problem(fd: int, parsed: Any, meta: ContainerMeta, what: str, decode: bool,
                      ring: list[memoryview] | None = None) -> str:
    """Why container ``meta`` of ``parsed`` does not match its hash (or, ``decode``, does not decode), or ''.

    ``ring``: the read buffers (default: this thread's)."""
    hasher = hashing.new_hasher(parsed.fb.hash_id)
    if not readahead.feed(fd, meta.fptr, meta.chunksize, hasher.update, ring or _ring(), readahead.READERS):
        return f"{what}: the file ends inside its data"
    if hasher.digest() != meta.hash:
        return f"{what}: data hash does not match (damaged data)"
    info = parsed.vars.get(meta.id)
    if not (decode and compression.encoded(info, meta)):
        return ""
    # The codec needs each frame whole: read from the file a frame at a time (from the page cache, which the hash
    # has just filled), never the container whole (a recovery's memory could not always hold a copy of it) nor
    # from a map (the file cut under it would end the process with SIGBUS: a short read here is damage).
    stored = compression.StoredSpan(fd, meta.fptr, meta.chunksize, what)
    return compression.decode_problem(info, meta, stored, what)


def first_problem(fd: int, parsed: Any, jobs: Sequence[tuple[int, int, ContainerMeta]], decode: bool) -> str:
    """The first container of ``jobs`` ((block, container, meta) triples) that fails its check, said; ''.

    Small files (:data:`INLINE_BYTES`) are checked on the caller's thread, each container in one read into a buffer
    of this call; larger ones on :data:`THREADS` threads."""
    inline = sum(meta.chunksize for _b, _c, meta in jobs) <= INLINE_BYTES
    biggest = max([meta.chunksize for _b, _c, meta in jobs] + [1])
    ring = [memoryview(bytearray(biggest))] if inline else None

    def check(job: tuple[int, int, ContainerMeta]) -> str:
        what = container_what(*job)
        meta = job[2]
        try:
            return container_problem(fd, parsed, meta, what, decode, ring or _ring(biggest))
        except OSError as exc:  # a disk that cannot read the span: damage, for this file
            return f"{what}: cannot be read: {exc.strerror or exc}"

    oneshot = hashing.oneshot(parsed.fb.hash_id)
    plain = _stored_plain(parsed, decode)

    def check_batch(batch: Sequence[tuple[int, int, ContainerMeta]]) -> str:
        for group in _small_runs(batch, plain):
            if len(group) == 1:
                problem = check(group[0])
            else:
                problem = _check_run(fd, group, oneshot)
                if problem is None:  # cut short, or unreadable: each one on its own, to name it
                    problem = next((p for p in map(check, group) if p), "")
            if problem:
                return problem
        return ""

    if inline:
        return check_batch(jobs)

    runs = readahead.runs(jobs, lambda job: job[2].chunksize, BATCH_BYTES)
    with ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="ftidask-verify") as pool:
        return next((problem for problem in pool.map(check_batch, runs) if problem), "")


#: Containers up to this size that follow each other in the file are read with one call and hashed from that read,
#: at most :data:`RUN_BYTES` at a time: a read and a hasher per container cost more than hashing 1 KiB (10,000
#: variables: 10,000 reads); each container is still hashed on its own, from the bytes of the file.
SMALL_BYTES = 64 << 10
RUN_BYTES = 1 << 20


def _stored_plain(parsed: Any, decode: bool) -> Any:
    """Whether a container is checked by its hash alone (not one to decode too)."""
    infos = parsed.vars

    def plain(meta: ContainerMeta) -> bool:
        return not (decode and compression.encoded(infos.get(meta.id), meta))

    return plain


def _small_runs(batch: Sequence[tuple[int, int, ContainerMeta]], plain: Any) -> list[list[Any]]:
    """``batch`` (file order) in groups: small containers stored as they are and close together in the file, read
    at once; every other container alone."""
    out: list[list[Any]] = []
    start = end = -1
    for job in batch:
        meta = job[2]
        if meta.chunksize > SMALL_BYTES or not plain(meta):
            out.append([job])
            start = end = -1
            continue
        # in one read: after the last one, not far (a gap of unused container space is read along) and not too many
        if out and start >= 0 and meta.fptr >= end and meta.fptr + meta.chunksize - start <= RUN_BYTES:
            out[-1].append(job)
        else:
            out.append([job])
            start = meta.fptr
        end = meta.fptr + meta.chunksize
    return out


def _check_run(fd: int, group: list[tuple[int, int, ContainerMeta]], digest: Any) -> str | None:
    """The problem of the first container of ``group`` (small, close together in the file) whose bytes do not match
    its hash, '' if none, None when the read came back short or failed (the caller checks each one to name it)."""
    start = group[0][2].fptr
    last = group[-1][2]
    buf = memoryview(bytearray(last.fptr + last.chunksize - start))
    try:
        if readahead.read_full(fd, start, buf) != len(buf):
            return None
    except OSError:
        return None
    for bi, ci, meta in group:
        lo = meta.fptr - start
        if digest(buf[lo:lo + meta.chunksize]) != meta.hash:  # as container_problem says it
            return f"{container_what(bi, ci, meta)}: data hash does not match (damaged data)"
    return ""


def md5_hex(fd: int, start: int, stop: int) -> str:
    """The MD5 (hex) of bytes ``[start, stop)`` of the file (FTI 1.1's checksum of the whole VB); '' when short."""
    hasher = hashing.new_hasher(1)
    # buffers of this call (the caller's thread may be the application's, which would keep a ring for ever)
    ring = [memoryview(bytearray(readahead.PIECE)) for _ in range(readahead.SLOTS)]
    return hasher.hexdigest() if readahead.feed(fd, start, max(stop - start, 0), hasher.update, ring) else ""
