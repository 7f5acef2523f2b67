"""Functions that Dask runs as tasks on the workers: write, flush, check, read, clean up.

Plain functions of paths, JSON-able values and NumPy arrays (no ``distributed`` import);
the client places each one on the worker that holds the chunks or the files. L2 and L3 are not
here: they run the shared level code over worker-to-worker channels (:mod:`.group_tasks`).
"""

from __future__ import annotations

import bisect
import functools
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...engine.checkpointing import write_rank_file
from ...engine.device import host_chunk
from ...ftiff import blockhash, compression, hashing
from ...ftiff.readahead import read_full
from ...ftiff.reader import verify_data
from ...ftiff.readhash import read_decoded_into, read_hashed
from ...model.arrays import VarInfo, contiguous_items, dtype_from_json, dtype_to_json
from ...model.errors import ConfigError, FormatError
from ...storage import files as storage
from . import fence, parsecache
from .plan import layout_from_json


class ChunkBytes:
    """The byte stream of one variable in a worker's file: its chunks back to back."""

    def __init__(self, chunks: Sequence[np.ndarray], dptrs: Sequence[int], dtype: np.dtype | None = None) -> None:
        self._views = {}
        for chunk, dptr in zip(chunks, dptrs, strict=True):
            flat = contiguous_items(_as_recorded(chunk, dtype)).reshape(-1).view(np.uint8)
            if dptr not in self._views or flat.nbytes:  # an empty chunk starts where the next one does: its bytes
                self._views[dptr] = memoryview(flat)
        self._starts = sorted(self._views)
        self.nbytes = sum(len(v) for v in self._views.values())

    def view(self, start: int, stop: int) -> memoryview:
        """A zero-copy view of bytes ``[start, stop)``; :class:`FormatError` unless they lie in one chunk."""
        # One container per chunk: a range (a container, or blocks of one) lies within one chunk.
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            raise FormatError(f"bytes [{start}, {stop}) are not in any chunk")
        first = self._starts[i]
        data = self._views[first]
        if stop > first + len(data) or stop < start:
            raise FormatError(f"bytes [{start}, {stop}) do not lie within the chunk at {first} "
                              f"({len(data)} bytes)")
        return data[start - first:stop - first]

    def pieces(self, start: int, stop: int) -> list[memoryview]:
        """Bytes ``[start, stop)`` as one piece (:meth:`view`)."""
        return [self.view(start, stop)]


def _as_recorded(chunk: Any, dtype: np.dtype | None) -> np.ndarray:
    """The chunk, on the host (a CuPy chunk copied from its device), in the dtype its variable's table records. Dask
    may compute the chunks of a big-endian array in the machine's byte order (a slice of a '>f8' array is copied as
    '<f8'): their bytes written as they are would be read back byte-swapped. Only the byte order is changed; a chunk
    of another kind of value is refused."""
    chunk = host_chunk(chunk)
    if dtype is None or chunk.dtype == dtype:
        return chunk
    if dtype_from_json(dtype_to_json(chunk.dtype)) == dtype:  # what the table records of it
        return chunk.view(dtype)
    try:
        return chunk.astype(dtype, casting="equiv")
    except TypeError:
        raise FormatError(f"a chunk holds {chunk.dtype}, its Dask array is {dtype}") from None


def chunk_sources(places: Sequence[Sequence[int]], chunks: Sequence[np.ndarray],
                  infos: Sequence[VarInfo]) -> dict[int, ChunkBytes]:
    """Each variable's byte stream from the chunks a worker holds (``places``: [var id, dptr] per chunk), each chunk
    in its variable's recorded dtype and of the shape its Dask array declares (the blocks of ``infos``' tables).
    A block of another shape (a ``map_blocks`` that returns more than it declares) would be written cut to the
    planned bytes, or fail deep in the writer: refused, naming the block."""
    dtypes = {i.id: i.dtype for i in infos}
    # An empty block starts where the next one does: the blocks at one dptr, in the order the places list them
    shapes: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for i in infos:
        for index, shape, dptr in i.extra.get("dask", {}).get("blocks", ()):
            shapes.setdefault((i.id, int(dptr)), []).append((tuple(index), tuple(shape)))
    seen: dict[tuple[int, int], int] = {}
    by_var: dict[int, tuple[list[np.ndarray], list[int]]] = {}
    for (vid, dptr), chunk in zip(places, chunks, strict=True):
        at = (int(vid), int(dptr))
        nth, declared = seen.get(at, 0), shapes.get(at, [])
        seen[at] = nth + 1
        index, shape = declared[nth] if nth < len(declared) else (None, None)
        got = tuple(getattr(chunk, "shape", ()))
        if shape is not None and got != shape and (math.prod(got) or math.prod(shape)):  # (Dask's empty blocks vary)
            raise FormatError(f"block {index} of variable {vid} has shape {got}, "
                              f"its Dask array declares {shape} (a map_blocks whose chunks= does not match what it "
                              "returns?)")
        arrays, dptrs = by_var.setdefault(int(vid), ([], []))
        arrays.append(chunk)
        dptrs.append(int(dptr))
    return {vid: ChunkBytes(a, d, (dtypes or {}).get(vid)) for vid, (a, d) in by_var.items()}


def write_rank(path: str, layout_json: Any, infos_json: list[dict[str, Any]], meta: dict[str, Any],
               hash_name: str, pt_fs: int, max_fs: int, places: list[list[int]],
               *chunks: np.ndarray, durable: bool = True, discards: Sequence[str] = (),
               direct: bool = False) -> dict[str, Any]:
    """Write this worker's FTI-FF file from the chunks it holds (``places``: [var id, dptr] per chunk); the
    containers of a variable whose table entry names a codec (``extra["codec"]``) are compressed here.
    ``durable=False`` (L2/L3): renamed unsynced; the level's task makes it durable after the redundancy.
    ``direct``: the data written around the page cache where it can be (L1/L4, ``direct_io``).
    ``discards``: the directories of checkpoints retired right before, :func:`discard_paths` first (every worker
    writes a file: the retirement's call to every worker, carried by the write instead of a round trip of its own)."""
    discard_paths(discards)
    layout = layout_from_json(layout_json)
    infos = [VarInfo.from_json(raw) for raw in infos_json]
    codecs = {i.id: (compression.get_codec(i.extra["codec"]), i.dtype.itemsize) for i in infos if "codec" in i.extra}
    sources = chunk_sources(places, chunks, infos)
    written = write_rank_file(Path(path), layout, sources, infos, hash_id=hashing.hash_id(hash_name), meta=meta,
                              pt_fs=pt_fs, max_fs=max_fs, codecs=codecs or None, durable=durable,
                              direct=direct and durable)
    return {"rank": meta["rank"], "node": meta["node"], "size": written.file_size,
            "fb_hash": written.fb.hash.hex(), "data_bytes": written.data_bytes, "path": path}


def flush(src: str, dst: str, after: Any = None, keep_src: bool = False) -> dict[str, Any]:
    """L4: copy this worker's file to the global directory, then drop the local copy."""
    size = storage.copy_file_atomic(Path(src), Path(dst))
    if not keep_src:
        os.unlink(src)
    return {"path": dst, "size": size}


def check_file(path: str, fb_hash: str, after: Any = None, *,
               expect: Sequence[tuple[int, list[int], int, int]] = (), data: bool = True,
               decode: bool = True) -> dict[str, Any]:
    """Parse and hash-check a rank's file; compare its file-block hash with the commit record, and
    find in it every chunk the record places there (``expect``: var id, grid index, dptr, bytes).

    ``data`` False checks the metadata only (parsed, its own hashes, the file block's, the chunks'
    places), not the containers' data: for a recovery whose reads check every chunk's hash anyway.
    ``decode`` False checks the containers' hashes but does not decode the compressed ones: the reads
    that follow decode each chunk (once), and one that does not decode sends the recovery back to a
    check that does (see :func:`ftidask.backends.dask.restore.recover`)."""
    try:
        with storage.open_read(path) as fh:
            parsed = parsecache.parse_kept(fh, path)  # parsed now; the reads of its chunks that follow reuse it
            if data:
                verify_data(fh, parsed, decode=decode)
    except FileNotFoundError:
        return {"ok": False, "message": f"{path}: missing"}
    except (FormatError, OSError) as exc:
        return {"ok": False, "message": str(exc)}
    except ConfigError as exc:  # a package it needs is not installed here (numcodecs): not damage
        return {"ok": False, "unreadable": True, "message": f"{path}: {exc}"}
    if parsed.fb.hash.hex() != fb_hash:
        return {"ok": False, "message": f"{path}: does not belong to this checkpoint"}
    if expect:
        missing = _chunks_missing(parsed, expect)
        if missing:  # the record and the file disagree: the record is wrong (the file verifies)
            return {"ok": False, "message": f"{path}: holds no chunk (var id, grid index, dptr, bytes) {missing} "
                                            "where the commit record places it"}
    return {"ok": True, "message": ""}


def _chunks_missing(parsed: Any, expect: Sequence[tuple[int, list[int], int, int]]) -> list[Any] | None:
    """The first of ``expect`` that the file's containers or its variable table (hash-covered: which
    grid index is at which dptr) do not hold, or None."""
    held = {(m.id, m.dptr, _raw_size(parsed, m)) for _b, _c, m in parsed.containers() if m.hascontent}
    placed: dict[int, set[tuple[Any, Any]]] = {}  # a set per variable: a rank may hold thousands of chunks
    for vid, index, dptr, nbytes in expect:
        if vid not in placed:
            placed[vid] = _blocks_placed(parsed, vid)
        if (vid, dptr, nbytes) not in held or (tuple(index), dptr) not in placed[vid]:
            return [vid, list(index), dptr, nbytes]
    return None


def _blocks_placed(parsed: Any, vid: int) -> set[tuple[Any, Any]]:
    """``(grid index, dptr)`` of every block the file's variable table places for ``vid`` (malformed
    entries place nothing)."""
    info = parsed.vars.get(vid)
    grid = info.extra.get("dask") if info is not None else None
    blocks = grid.get("blocks") if isinstance(grid, dict) else None
    if not isinstance(blocks, list):
        return set()
    number = (int, float)  # what can equal a grid index or a dptr (and be hashed)
    return {(tuple(b[0]), b[2]) for b in blocks if isinstance(b, list) and len(b) == 3 and isinstance(b[0], list)
            and all(isinstance(i, number) for i in b[0]) and isinstance(b[2], number)}


def _raw_size(parsed: Any, meta: Any) -> int:
    """The raw bytes container ``meta`` holds: its stored size, or a compressed variable's raw span (which
    :func:`parse_ftiff` checked against the stored size of a container kept raw)."""
    info = parsed.vars.get(meta.id)
    if info is None or "codec" not in info.extra:
        return int(meta.chunksize)
    return compression.raw_span(info.nbytes, meta.dptr, meta.containersize)


def read_chunk(path: str, var_id: int, dptr: int, dtype_json: Any, shape: list[int], fb_hash: str,
               after: Any = None) -> np.ndarray:
    """One chunk from a rank's file, its container hash checked before it is returned (a compressed
    container's stored bytes are checked, then decoded). The file's metadata is parsed once per worker
    while the file is unchanged (:mod:`.parsecache`), not once per chunk."""
    dtype = dtype_from_json(dtype_json)
    with storage.open_read(path) as fh:
        parsed, index = parsecache.parsed(fh, path, fb_hash)
        if parsed.fb.hash.hex() != fb_hash:
            raise FormatError("file does not belong to the checkpoint being recovered", path=path)
        meta = index.get((var_id, dptr))
        out = np.empty(shape, dtype)
        nbytes = out.nbytes
        if nbytes == 0:
            return out
        if meta is None or _raw_size(parsed, meta) != nbytes:
            raise FormatError(f"no container of {nbytes} bytes for variable {var_id} at dptr {dptr}", path=path)
        view = memoryview(out.reshape(-1).view(np.uint8))
        info = parsed.vars.get(var_id)
        if compression.encoded(info, meta):
            if parsed.fb.flags & blockhash.FLAG_DCP:  # ftidask never writes one: patched in place, not decoded
                raise FormatError(f"variable {var_id}: a differential file holds a compressed container", path=path)
            what = f"variable {var_id}, chunk at dptr {dptr}"
            try:  # into the chunk, a few frames at a time, hash-checked at the end (the chunk dropped if not)
                read_decoded_into(fh.fileno(), meta, info, parsed.fb.hash_id, what, view)
            except FormatError as exc:
                raise FormatError(str(exc), path=path) from None
            return out
        if parsed.fb.flags & blockhash.FLAG_DCP:  # checked block by block
            if read_full(fh.fileno(), meta.fptr, view) == nbytes:
                blockhash.check_container(fh, parsed, meta, view)
                return out
            digest = None
        else:  # each piece hashed while the next is read
            digest = read_hashed(fh.fileno(), meta.fptr, view, parsed.fb.hash_id)
    if digest != meta.hash:
        raise FormatError(f"variable {var_id}, chunk at dptr {dptr}: data hash does not match", path=path)
    return out


def collect_garbage(ckpt_dir: str, exec_id: str, committed: Sequence[str], trash: bool = False,
                    spares: bool = True) -> int:
    """Remove what interrupted checkpoints left in the node directories this worker sees.

    Checkpoint directories that no commit record names, and temporary files; with ``trash``
    (once, when a run starts) also the trash that killed workers left (:func:`discard_paths`
    removes its own in the background), and the spares of differential checkpoints unless
    ``spares`` (the run writes them); the count removed.
    """
    keep = set(committed)
    return sum(storage.collect_level_garbage(root, keep, trash, spares)
               for root in Path(ckpt_dir).glob(f"node*/{exec_id}/l[1-4]"))


def discard_and_collect(discards: Sequence[str], ckpt_dir: str, exec_id: str, committed: Sequence[str],
                        trash: bool = False, spares: bool = True) -> int:
    """:func:`discard_paths` of the directories a retirement left to discard (first: the collection would delete
    them on the spot), then :func:`collect_garbage`: both in one call to every worker."""
    discard_paths(discards)
    return collect_garbage(ckpt_dir, exec_id, committed, trash, spares)


def remove_run_dirs(ckpt_dir: str, runs: Sequence[str]) -> None:
    """Remove the node directories of the dead runs ``runs`` (checked exec_ids) that this worker sees."""
    for run in runs:
        for node_dir in Path(ckpt_dir).glob(f"node*/{run}"):
            storage.remove_tree(node_dir)


def sizes(paths: Sequence[str]) -> list[int]:
    """The size of each of ``paths`` as this worker sees it, -1 where it sees none (stats: no file opened)."""
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_size)
        except OSError:
            out.append(-1)
    return out


@functools.cache
def _remover() -> ThreadPoolExecutor:
    # One thread per worker process, made on first use: deletions never hold up a task.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-remove")


def wait_removals() -> None:
    """Wait until this worker's background deletions are done (finalize leaves no trash behind)."""
    if _remover.cache_info().currsize:
        _remover().submit(int).result()  # one thread, in order: every earlier deletion is done


def abandon_checkpoint(patterns: Sequence[str], paths: Sequence[str]) -> None:
    """A failed checkpoint, on every worker: its tasks told (:func:`ftidask.backends.dask.fence.abandon`: those still
    running remove what they write after), then its directories discarded (:func:`discard_paths`)."""
    fence.abandon(patterns)
    discard_paths(paths)


def discard_paths(paths: Sequence[str]) -> None:
    """Rename each path to a hidden trash name now (atomic), delete it in the background.

    Freeing GiB-sized files takes a noticeable time, which a checkpoint must not wait for;
    what a killed worker leaves in the trash is removed by :func:`collect_garbage`.
    """
    for p in paths:
        storage.discard(Path(p), _remover)
