"""Read containers of a parsed FTI-FF file into memory the caller owns, hashing them as they arrive.

A recovery that stages its arrays' pages (:mod:`ftidask.engine.pagemove`) reads the file once, into
those pages, and checks each container's hash on the bytes read. A reader thread stays ahead of the
hash (both ``preadv`` and the hashes release the GIL), so the disk is never idle while a piece is
hashed: the pass costs what a raw read of the same bytes costs.

Compressed variables are read, hashed and decoded into those pages in the same pass, so that a
recovery into fresh arrays decodes each container once (a recovery into arrays that cannot be
staged decodes it twice: once to check it, before any array is touched, and once into the array).
A restart on another number of ranks reads the containers of its spans with them too
(:mod:`ftidask.engine.reshard_files`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from ..model.arrays import VarInfo
from ..model.errors import FormatError
from . import blockhash, compression, hashing
from .readahead import READERS, ReadAhead, read_full
from .reader import FtiffFile
from .structs import ContainerMeta
from .verify import container_what

PIECE = 8 << 20  # bytes per read; the hash follows one piece behind
_DECODE_THREADS = min(4, os.cpu_count() or 1)  # containers decoded at once (numcodecs releases the GIL)


def read_hashed(fd: int, offset: int, view: memoryview, hash_id: int) -> bytes | None:
    """Read ``len(view)`` bytes at ``offset`` into ``view`` and return their digest under ``hash_id``, each
    piece hashed while the next one is read (a raw read, then a hash pass, left the disk idle during the
    hash); None when the file ends first."""
    hasher = hashing.new_hasher(hash_id)
    if len(view) <= PIECE:
        if read_full(fd, offset, view) != len(view):
            return None
        hasher.update(view)
        return hasher.digest()
    pieces = [(offset + lo, view[lo:lo + PIECE]) for lo in range(0, len(view), PIECE)]
    with ReadAhead(fd, pieces, threads=READERS) as reader:
        for k, (_offset, piece) in enumerate(pieces):
            if not reader.wait(k):
                return None
            hasher.update(piece)
    return hasher.digest()


def read_verified(fh: BinaryIO, parsed: FtiffFile, views: Mapping[int, memoryview]) -> None:
    """Read every container of the variables in ``views`` into ``views[id][dptr:dptr + chunksize]``,
    checking its hash (a compressed variable's containers are decoded there, once their stored bytes
    matched their hash); :class:`FormatError` on a mismatch, a short file or bytes that do not decode.

    The views then hold unverified bytes: the caller discards them (they are never a user's array).
    Only ftidask's files (not FTI 1.1) are read this way; a differential (dCP) file's containers are checked block
    by block against its block digests (:func:`_read_verified_dcp`).
    """
    if parsed.fb.flags & blockhash.FLAG_DCP:
        _read_verified_dcp(fh, parsed, views)
        return
    packed: list[tuple[int, int, ContainerMeta]] = []  # encoded: read, checked and decoded (read_decoded_into)
    jobs: list[tuple[int, int, ContainerMeta]] = []  # the others: streamed and hashed
    for bi, ci, meta in parsed.containers():
        if meta.hascontent and meta.id in views:
            if compression.encoded(parsed.vars.get(meta.id), meta):
                packed.append((bi, ci, meta))
            elif meta.chunksize:
                jobs.append((bi, ci, meta))
    if packed:
        _read_decoded(fh, parsed, views, packed)
    spans = [[(meta.fptr + lo, views[meta.id][meta.dptr + lo:meta.dptr + min(lo + PIECE, meta.chunksize)])
              for lo in range(0, meta.chunksize, PIECE)] for _bi, _ci, meta in jobs]
    with ReadAhead(fh.fileno(), [piece for pieces in spans for piece in pieces], threads=READERS) as reader:
        k = 0
        for (bi, ci, meta), pieces in zip(jobs, spans):
            where = container_what(bi, ci, meta)
            hasher = hashing.new_hasher(parsed.fb.hash_id)
            for _offset, view in pieces:
                if not reader.wait(k):
                    raise FormatError(f"{where}: file ends inside its data", path=parsed.path)
                hasher.update(view)
                k += 1
            if hasher.digest() != meta.hash:
                raise FormatError(f"{where}: data hash does not match (damaged data)", path=parsed.path)


def _read_verified_dcp(fh: BinaryIO, parsed: FtiffFile, views: Mapping[int, memoryview]) -> None:
    """:func:`read_verified` of a dCP file (never compressed): its containers' block digests are checked against their
    container hashes first (:func:`~.blockhash.read_digests`), then each piece read is checked block by block while
    the next one is read, as a plain file's containers are hashed: one pass over the file, where checking the file,
    then copying it into the arrays, read it twice."""
    info, digests = blockhash.read_digests(fh, parsed)
    step = max(1, PIECE // info.block_size) * info.block_size  # whole blocks per piece (the last one may be short)
    jobs = [(bi, ci, meta) for bi, ci, meta in parsed.containers()
            if meta.hascontent and meta.id in views and meta.chunksize]
    pieces = [(bi, ci, meta, lo, (meta.fptr + lo, views[meta.id][meta.dptr + lo:meta.dptr + min(lo + step,
                                                                                              meta.chunksize)]))
              for bi, ci, meta in jobs for lo in range(0, meta.chunksize, step)]
    with ReadAhead(fh.fileno(), [piece[-1] for piece in pieces], threads=READERS) as reader:
        for k, (bi, ci, meta, lo, (_offset, view)) in enumerate(pieces):
            where = container_what(bi, ci, meta)
            if not reader.wait(k):
                raise FormatError(f"{where}: file ends inside its data", path=parsed.path)
            blockhash.check_blocks(view, info, digests[bi, ci], lo // info.block_size, where, parsed.path)


def _read_decoded(fh: BinaryIO, parsed: FtiffFile, views: Mapping[int, memoryview],
                  jobs: list[tuple[int, int, ContainerMeta]]) -> None:
    """The compressed containers of :func:`read_verified`, each decoded into its raw span of the view
    (:func:`read_decoded_into`); containers on a few threads."""

    def one(job: tuple[int, int, ContainerMeta]) -> str:
        where, meta = container_what(*job), job[2]
        info = parsed.vars[meta.id]
        span = compression.raw_span(info.nbytes, meta.dptr, meta.containersize)
        try:  # decoded straight into the staged pages, frame by frame
            into = views[meta.id][meta.dptr:meta.dptr + span]
            read_decoded_into(fh.fileno(), meta, info, parsed.fb.hash_id, where, into)
        except FormatError as exc:
            return str(exc)
        return ""

    with ThreadPoolExecutor(max_workers=_DECODE_THREADS, thread_name_prefix="ftidask-decode") as pool:
        for problem in pool.map(one, jobs):
            if problem:
                raise FormatError(problem, path=parsed.path)


def read_decoded_into(fd: int, meta: ContainerMeta, info: VarInfo, hash_id: int, what: str, into: memoryview) -> None:
    """Compressed container ``meta`` (of the variable ``info``) decoded into ``into``, memory the caller discards when
    this raises (staged pages, a Dask chunk, a reshard's span): a container in frames is read, hashed and decoded a few
    frames at a time (:func:`_read_frames`), one frame read whole, hash-checked, then decoded."""
    layout = compression.frame_layout(info, meta, meta.chunksize, what)
    if layout is None:
        compression.read_decoded(fd, meta, info, hash_id, what, into)
    else:
        codec = compression.var_codec(info.extra)
        _read_frames(fd, meta, codec, layout, hash_id, what, into)


def _read_frames(fd: int, meta: ContainerMeta, codec: object, layout: tuple[int, list[int]], hash_id: int, what: str,
                 into: memoryview) -> None:
    """A container stored in frames, into ``into`` (staged pages, discarded when this raises): a few frames read at a
    time, hashed in order, and decoded into their places on the frame threads; the container's hash compared at the
    end. Read whole first, the stored bytes of every container being decoded were held at once, up to several times
    the largest array for data that compresses little. A frame that does not decode is reported as the hash's
    mismatch when the hash does not match (the cause), as when the hash was checked first."""
    frame, sizes = layout
    hasher = hashing.new_hasher(hash_id)
    problem, pos, window = "", meta.fptr, compression.frame_threads()
    for lo in range(0, len(sizes), window):
        jobs = []
        for i in range(lo, min(len(sizes), lo + window)):
            stored = bytearray(sizes[i])
            if read_full(fd, pos, memoryview(stored)) != sizes[i]:
                raise FormatError(f"{what}: file ends inside its data")
            pos += sizes[i]
            hasher.update(stored)
            part = into[i * frame:(i + 1) * frame]
            jobs.append((stored, len(part), part, f"{what}, frame {i}"))
        if not problem:  # past a frame that did not decode, the rest is only hashed
            problem = compression.decode_frames(codec, jobs)
    if hasher.digest() != meta.hash:
        raise FormatError(f"{what}: data hash does not match (damaged data)")
    if problem:
        raise FormatError(problem)
