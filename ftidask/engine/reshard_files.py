"""The old files of a redistributed checkpoint (:mod:`ftidask.engine.reshard`): each one opened and its variable
table summed up for the planner, then the pieces a new rank needs read from it, each container checked against its
hash before its bytes are used. The Dask backend's stitching (:mod:`ftidask.backends.dask.stitch`) reads with them
too."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff import blockhash, compression, readahead, readhash, verify
from ..ftiff.blockhash import FLAG_DCP
from ..ftiff.reader import FtiffFile, check_unchanged, copy_direct, parse_ftiff
from ..model.arrays import copy_items, dtype_from_json, dtype_to_json
from ..model.decomposition import Piece, bands, piece_view
from ..model.errors import ConfigError, FormatError, RecoveryError
from ..storage.files import open_read
from .pystate import EXTRA_KEY as PYSTATE
from .reshard_dask import Refused, piece_of_stream
from .runstate import CommitRecord


def open_old(path: Path, record: CommitRecord, rank: int) -> Any:
    """A parsed old file: FTI-FF files are only parsed here (their containers, or a differential file's blocks, are
    checked as they are read; a differential file's block digests are checked against its container hashes here);
    Zarr stores are verified whole."""
    if path.suffix != ".zarr":
        try:
            with open_read(path) as fh:
                parsed = parse_ftiff(fh, str(path))
                expected = next((f.fb_hash for f in record.files if f.rank == rank), None)
                if expected != parsed.fb.hash.hex():
                    raise RecoveryError(f"{path}: does not belong to checkpoint {record.ckpt_id} (seq {record.seq})")
                if parsed.fb.flags & FLAG_DCP:  # read once, kept for the reads (blockhash.read_blocks_checked)
                    digests = blockhash.read_digests(fh, parsed)
                    parsed.memo("dcp_digests", lambda: digests)
        except FileNotFoundError:
            raise RecoveryError(f"{path}: missing, or not reachable from this rank") from None
        except OSError as exc:
            raise RecoveryError(f"{path}: {exc}") from None
        return parsed
    from .zarr_l4 import open_store

    try:
        return open_store(path, record, rank)
    except (FormatError, OSError, ConfigError) as exc:
        raise RecoveryError(str(exc)) from None


def stored_dtype(value: Any) -> np.dtype | None:
    """The dtype an old file's table records (:func:`dtype_to_json`'s form), None for a malformed one."""
    try:
        return dtype_from_json(value)
    except FormatError:
        return None


def table_of(parsed: Any) -> dict[str, Any]:
    """What the planner needs of one old file: per variable dtype, shape, order and placement."""
    out = {}
    for vid, info in parsed.vars.items():
        out[str(vid)] = {"dtype": dtype_to_json(info.dtype), "shape": list(info.shape), "order": info.order,
                         "extra": {k: info.extra[k] for k in ("global_shape", "offset", "replicated", "dask", PYSTATE)
                                   if k in info.extra}}
    return out


def state_sizes(tables: dict[int, dict[str, Any]], n: int, m: int, rank: int, arrays: Collection[int],
                states: Collection[int]) -> dict[int, int]:
    """The stored sizes of the Python states ``states`` in the old files' tables (by old rank, ``n`` of them, ``m``
    ranks now): a Dask checkpoint holds each whole on one worker; an MPI checkpoint one per rank, old rank ``rank``'s
    for this rank (on as many ranks only). :class:`Refused` when the checkpoint holds an array under a state's id, or
    a state under the id of one of ``arrays`` (its bytes are never loaded into an array)."""
    for vid in arrays:
        kind = next((e["extra"][PYSTATE] for e in _entries(tables, vid, n) if PYSTATE in e["extra"]), None)
        if kind is not None:
            raise Refused(f"variable {vid}: the checkpoint holds a Python state ({kind}), the protected variable is an "
                          "array; protect what was protected then (ftidask.State, ftidask.Value or a numpy.random "
                          "Generator)")
    return {vid: _state_size(tables, vid, n, m, rank) for vid in states}


def _entries(tables: dict[int, dict[str, Any]], vid: int, n: int) -> list[dict[str, Any]]:
    return [e for e in (tables.get(old, {}).get(str(vid)) for old in range(n)) if e]


def _state_size(tables: dict[int, dict[str, Any]], vid: int, n: int, m: int, rank: int) -> int:
    entries = _entries(tables, vid, n)
    try:
        if entries and all(PYSTATE in e["extra"] and stored_dtype(e["dtype"]) == np.uint8 for e in entries):
            if "dask" not in entries[0]["extra"]:
                holders = [old for old in range(n) if tables.get(old, {}).get(str(vid))]
                if n != m and all(e["extra"].get("replicated") is True for e in entries):  # the same on every rank:
                    (size,) = tables[holders[rank % len(holders)]][str(vid)]["shape"]  # read as the plan reads it
                    return int(size)
                if n != m:
                    raise StatesRefused(f"variable {vid} is a Python state (ftidask.State, Value or a NumPy "
                                        f"Generator), which each of the checkpoint's {n} ranks holds for itself: it "
                                        f"cannot be redistributed onto {m} rank(s) (one every rank holds alike is "
                                        "protected with replicated=True)")
                (size,) = tables[rank][str(vid)]["shape"]
                return int(size)
            (size,) = entries[0]["extra"]["dask"]["shape"]
            stored = sum(int(np.prod([int(k) for k in e["shape"]], dtype=object)) for e in entries)
            if 0 <= int(size) <= stored:  # forged: nothing allocated
                return int(size)
    except (IndexError, TypeError, KeyError, ValueError, OverflowError):
        pass
    raise Refused(f"variable {vid} is a Python state here, the checkpoint holds no state under that id")


class StatesRefused(Refused):
    """A checkpoint's per-rank Python states on another number of ranks: its layout, not this run's declarations,
    is what does not fit (restart on its number of ranks, or name an older checkpoint: see
    :func:`ftidask.engine.reshard.states_advice`)."""


def read_in_place(parsed: Any) -> bool:
    """Whether ``parsed`` is an FTI-FF file, whose containers (a differential file's blocks) are read one by one,
    hashed by one rank for all when two need one (:mod:`.reshard_read`); not a Zarr store."""
    return isinstance(parsed, FtiffFile)


def verified_first(parsed: Any) -> bool:
    """Whether pieces of ``parsed`` can be verified first and read into a user's array later (:func:`verify_pieces`,
    then :func:`read_pieces`, ``verified``): an FTI-FF file, or a Zarr store (each chunk of a piece decoded to check
    it, then read again, checked again, into the array after the agreement), both with no buffer of the array's
    size."""
    from .zarr_l4 import ZarrRankStore

    return isinstance(parsed, (FtiffFile, ZarrRankStore))


def verify_pieces(parsed: FtiffFile, wanted: list[tuple[int, Piece]],
                  trusted: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Check the hash of every container that holds a byte of the pieces ``wanted`` (each once; compressed ones are
    decoded too, a few frames at a time), reading into buffers of the check's own: :class:`FormatError` naming the
    file when one does not match. The pieces are read into the arrays after every rank agreed (:func:`read_pieces`,
    which checks that the file is the one verified, unchanged). ``trusted``: the (block, container) another rank
    verifies (:mod:`.reshard_read`), not hashed here. A differential file: only the blocks of the pieces' spans,
    each against its digest. A Zarr store: the chunks that hold the pieces, each read, checked and decoded."""
    if not read_in_place(parsed):
        from .zarr_l4 import check_region

        for vid in {vid for vid, _piece in wanted if "dask" in parsed.vars[vid].extra}:  # read whole: all of it
            check_region(parsed, vid, (slice(None),) * len(parsed.vars[vid].shape))
        for vid, piece in wanted:
            if "dask" not in parsed.vars[vid].extra:
                check_region(parsed, vid, piece.src)
        return
    if parsed.fb.flags & FLAG_DCP:
        _verify_pieces_dcp(parsed, wanted)
        return
    jobs: dict[tuple[int, int], Any] = {}
    for vid, piece in wanted:
        for _dptr, _raw, bi, ci, meta in _containers(parsed, vid, *piece.span):
            if (bi, ci) not in trusted:
                jobs[bi, ci] = (bi, ci, meta)
    verify_containers(parsed, list(jobs.values()), True)


def _verify_pieces_dcp(parsed: FtiffFile, wanted: list[tuple[int, Piece]]) -> None:
    """:func:`verify_pieces` of a dCP file: the blocks each piece's span touches, read and checked (through a buffer
    of at most a piece of blocks; the file checked unchanged before and after)."""
    with open_read(parsed.path) as fh:
        check_unchanged(fh, parsed)
        for vid, piece in wanted:
            start, stop = piece.span
            for dptr, raw, bi, ci, meta in _containers(parsed, vid, start, stop):
                lo, hi = max(start, dptr) - dptr, min(stop, dptr + raw) - dptr
                blockhash.read_blocks_checked(fh, parsed, (bi, ci), meta, lo, hi, None)
        check_unchanged(fh, parsed)


def verify_containers(parsed: FtiffFile, jobs: list[tuple[int, int, Any]], decode: bool, after: bool = False) -> None:
    """Check the containers ``jobs`` ((block, container, meta)) of ``parsed`` in file order, the file first checked to
    be the one parsed, unchanged (and, ``after``, once more at the end): :class:`FormatError` naming the file."""
    with open_read(parsed.path) as fh:
        check_unchanged(fh, parsed)
        problem = verify.first_problem(fh.fileno(), parsed, sorted(jobs, key=lambda j: j[2].fptr), decode)
        if after:
            check_unchanged(fh, parsed)
    if problem:
        raise FormatError(problem, path=parsed.path)


#: A strided piece goes through a buffer of at most about this many bytes (a band of it at a time).
BAND_BYTES = 16 << 20


def read_pieces(parsed: Any, wanted: list[tuple[int, Piece]], staged: dict[int, np.ndarray],
                verified: bool = False, trusted: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Copy the pieces ``wanted`` of one old file into the buffers ``staged`` (the buffers are dropped when a
    container does not match its hash); or, ``verified``, into the arrays ``staged``, after :func:`verify_pieces`
    checked every container that holds them and the ranks agreed (as a recovery on the same layout reads into
    arrays in use).

    Each container is hash-checked once in a pass, read whole: straight where it goes when a piece holds all of it,
    else through small buffers (:mod:`~ftidask.ftiff.verify`); then only the bytes the pieces need are read, a
    strided piece a band at a time (:func:`~ftidask.model.decomposition.bands`). The file must be the one parsed,
    unchanged (checked before the first byte and after the last). Compressed containers are decoded whole, checked
    again each time. ``trusted``: the plain (block, container) that another rank verifies (:mod:`.reshard_read`):
    only the bytes the pieces need are read of them."""
    if read_in_place(parsed):
        scratch, checked = _Scratch(), _Checked(every=verified, trusted=trusted)
        with open_read(parsed.path) as fh:
            check_unchanged(fh, parsed)
            if verified:  # the runs of the stream first, on the copying threads; the others below, in turn
                wanted = _copy_runs(fh, parsed, wanted, staged)
            for vid, piece in wanted:
                # a view even of a 0-d array (``a[()]`` is a scalar copy); of a base ndarray: a user's np.matrix
                # flattened stays 2-D, (1, n), and its bytes sliced so would be rows (read elsewhere than verified)
                array = np.asarray(staged[vid])
                dst = array[(*piece.dst, ...)]
                direct = _stream_order_bytes(piece, dst)
                if direct is not None:  # the piece is a run of the stream: read (and checked) where it goes
                    _read_span(fh, parsed, vid, piece.first, direct, scratch, checked)
                    continue
                whole = compression.var_codec(parsed.vars[vid].extra) is not None  # decoded whole: not in bands
                for band in [piece] if whole else bands(piece, BAND_BYTES):
                    start, stop = band.span
                    buf = scratch.take(stop - start, 0)
                    _read_span(fh, parsed, vid, start, buf, scratch, checked)
                    # (whole items: NumPy assigns a structured array field by field, its padding left out)
                    copy_items(array[(*band.dst, ...)], piece_view(band, buf, start, parsed.vars[vid].dtype))
            check_unchanged(fh, parsed)
        return
    # A Zarr store: the chunks that hold each piece, each checked as it is read.
    from .zarr_l4 import read_region

    whole: dict[int, np.ndarray] = {}
    for vid, piece in wanted:
        if "dask" in parsed.vars[vid].extra:  # a chunk at its dptr in the worker's stream (.reshard_dask)
            if vid not in whole:
                whole[vid] = parsed.vars[vid].empty()
                read_region(parsed, vid, (slice(None),) * len(parsed.vars[vid].shape), whole[vid])
            copy_items(np.asarray(staged[vid])[(*piece.dst, ...)], piece_of_stream(piece, whole[vid],
                                                                                  parsed.vars[vid].dtype))
        else:
            read_region(parsed, vid, piece.src, np.asarray(staged[vid])[(*piece.dst, ...)])


def _copy_runs(fh: Any, parsed: FtiffFile, wanted: list[tuple[int, Piece]],
               arrays: dict[int, np.ndarray]) -> list[tuple[int, Piece]]:
    """Read the pieces ``wanted`` that are runs of a raw variable's stream straight into ``arrays``, verified before
    (:func:`verify_pieces`): a copy from the page cache, spread over threads as on the same layout
    (:func:`~ftidask.ftiff.reader.copy_direct`: one thread copies at a fraction of the memory's bandwidth; 4 x 256 MiB
    onto 2 on 16 cores took 0.18 s warm so, 0.11 s on the threads). The pieces left (strided, compressed) are
    returned."""
    spans, rest = [], []
    for vid, piece in wanted:
        direct = _stream_order_bytes(piece, np.asarray(arrays[vid])[(*piece.dst, ...)])
        if direct is None or compression.var_codec(parsed.vars[vid].extra) is not None:
            rest.append((vid, piece))
            continue
        start = piece.first
        for dptr, raw, bi, ci, meta in _containers(parsed, vid, start, start + direct.nbytes):
            lo, hi = max(start, dptr), min(start + direct.nbytes, dptr + raw)
            spans.append((meta.fptr + lo - dptr, memoryview(direct[lo - start:hi - start]), (bi, ci, vid)))
    copy_direct(fh, parsed, spans)
    return rest


def _stream_order_bytes(piece: Piece, dst: np.ndarray) -> np.ndarray | None:
    """``dst``'s bytes in memory order when they are, in that order, the stream's bytes from ``piece.first`` (a
    contiguous destination whose strides are the old block's: a 1-D piece, whole rows or columns); else None."""
    if dst.size == 0 or tuple(dst.shape) != tuple(piece.shape):
        return None
    if not (dst.flags.c_contiguous or dst.flags.f_contiguous):
        return None
    if any(a != b for n, a, b in zip(piece.shape, piece.strides, dst.strides) if n > 1):
        return None
    flat = dst.reshape(-1, order="A")
    return flat.view(np.uint8) if np.shares_memory(flat, dst) else None  # a view, never a copy filled in vain


class _Scratch:
    """Buffers of one file's reads, kept between pieces: fresh memory costs a page fault per page each time (a
    strided piece's band; a compressed container cut by a piece, decoded whole; the ring a cut container is
    hash-checked through)."""

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._ring: list[memoryview] = []

    def take(self, n: int, which: int) -> np.ndarray:
        """``n`` bytes of buffer ``which`` (0: a span, 1: a container), its content undefined."""
        if self._bufs[which].nbytes < n:
            self._bufs[which] = np.empty(n, np.uint8)
        return self._bufs[which][:n]

    def ring(self, n: int) -> list[memoryview]:
        """Read buffers to hash a container of ``n`` bytes through (:func:`~ftidask.ftiff.verify.ring_for`): this
        pass's own, not the calling thread's (a rank's main thread would keep those for good)."""
        self._ring = verify.ring_for(n, self._ring or None)
        return self._ring


class _Checked:
    """The containers of one file (by block and index) whose hash this pass checked, or ``every`` one (verified
    before the pass), or that another rank verifies (``trusted``): their bytes are read as they are, the file being
    checked unchanged at the pass's end."""

    def __init__(self, every: bool = False, trusted: frozenset[tuple[int, int]] = frozenset()) -> None:
        self.every, self.done, self.trusted = every, set(), trusted

    def __contains__(self, key: tuple[int, int]) -> bool:
        return self.every or key in self.done or key in self.trusted


def _read_span(fh: Any, parsed: FtiffFile, vid: int, start: int, out: np.ndarray, scratch: _Scratch,
               checked: _Checked | None = None) -> None:
    """Fill ``out`` (uint8) with bytes ``[start, start + len(out))`` of variable ``vid``'s stream.

    A container not yet ``checked`` is hash-checked whole (its hash covers all of it): read straight into ``out``
    when it lies inside, else through the verifying ring buffers, its part then read again (from the page cache);
    compressed ones are read, checked and decoded whole (through a scratch buffer when cut).
    """
    info = parsed.vars[vid]
    codec = compression.var_codec(info.extra)
    plain = compression.plain_ids(info.extra)
    stop = start + out.nbytes
    spans = _containers(parsed, vid, start, stop)
    hid, fd = parsed.fb.hash_id, fh.fileno()
    checked = checked or _Checked()
    for dptr, raw, bi, ci, meta in spans:  # ``out`` is dropped if one is refused: never a user's array
        what = f"block {bi}, container {ci} (var id {vid})"
        inside = start <= dptr and dptr + raw <= stop
        lo, hi = max(start, dptr), min(stop, dptr + raw)
        try:
            if codec is not None and meta.containerid not in plain:  # read a few frames at a time, decoded in place
                into = out[dptr - start:dptr - start + raw] if inside else scratch.take(raw, 1)
                readhash.read_decoded_into(fd, meta, info, hid, what, memoryview(into))
                if not inside:
                    out[lo - start:hi - start] = into[lo - dptr:hi - dptr]
                continue
            if (bi, ci) not in checked and parsed.fb.flags & FLAG_DCP:  # the blocks it touches only, checked
                blockhash.read_blocks_checked(fh, parsed, (bi, ci), meta, lo - dptr, hi - dptr,
                                              memoryview(out[lo - start:hi - start]))
                continue
            if (bi, ci) not in checked:
                if inside:  # read where it goes, hashed as it comes
                    if readhash.read_hashed(fd, meta.fptr, memoryview(out[dptr - start:hi - start]), hid) != meta.hash:
                        raise FormatError(f"{what}: data hash does not match (damaged data)")
                    checked.done.add((bi, ci))
                    continue
                problem = verify.container_problem(fd, parsed, meta, what, False, scratch.ring(meta.chunksize))
                if problem:
                    raise FormatError(problem)
                checked.done.add((bi, ci))
            if readahead.read_full(fd, meta.fptr + lo - dptr, memoryview(out[lo - start:hi - start])) != hi - lo:
                raise FormatError(f"{what}: the file ends inside its data")
        except FormatError as exc:
            raise FormatError(str(exc), path=parsed.path) from None


def cut_needs(files: dict[int, Any], plan: dict[int, list[tuple[int, Piece]]]) -> list[list[int]]:
    """``[old rank, block, container, size, bytes needed]`` of each plain container of the plain FTI-FF old files
    ``files`` that this rank's pieces ``plan`` need (by old rank); a strided piece counts the span it lies in. For
    the choice of the rank that hashes each container two ranks need (:mod:`.reshard_read`)."""
    out = []
    for old, wanted in sorted(plan.items()):
        parsed = files[old]
        if not read_in_place(parsed) or parsed.fb.flags & FLAG_DCP:  # a dCP file's blocks: each rank checks its own
            continue
        parts: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for vid, piece in wanted:
            if compression.var_codec(parsed.vars[vid].extra) is not None:  # decoded whole by each reader
                continue
            start, stop = piece.span
            for dptr, raw, bi, ci, _meta in _containers(parsed, vid, start, stop):
                parts.setdefault((bi, ci, raw), []).append((max(start, dptr) - dptr, min(stop, dptr + raw) - dptr))
        for (bi, ci, raw), spans in sorted(parts.items()):
            covered, end = 0, 0
            for lo, hi in sorted(spans):  # their union
                covered += max(0, hi - max(lo, end))
                end = max(end, hi)
            out.append([old, bi, ci, raw, covered])
    return out


def _containers(parsed: FtiffFile, vid: int, start: int, stop: int) -> list[tuple[int, int, int, int, Any]]:
    """The containers of variable ``vid`` that hold its stream's bytes ``[start, stop)``, in stream order:
    ``(dptr, raw size, block, container, meta)``; :class:`FormatError` when they do not hold every one."""
    if stop <= start:  # no bytes (an item of size 0): nothing to hold
        return []
    info = parsed.vars[vid]
    codec = compression.var_codec(info.extra)
    spans = []
    for bi, ci, meta in parsed.containers_of((vid,)):  # indexed: a pass over every container per piece was O(n^2)
        if meta.id != vid or not meta.hascontent or not meta.chunksize:
            continue
        raw = compression.raw_span(info.nbytes, meta.dptr, meta.containersize) if codec else meta.chunksize
        if meta.dptr < stop and meta.dptr + raw > start:
            spans.append((meta.dptr, raw, bi, ci, meta))
    spans.sort(key=lambda s: s[0])
    if not spans or spans[0][0] > start or spans[-1][0] + spans[-1][1] < stop:  # parse_ftiff: they tile the stream
        raise FormatError(f"variable {vid}: bytes [{start}, {stop}) are not held by its containers", path=parsed.path)
    return spans
