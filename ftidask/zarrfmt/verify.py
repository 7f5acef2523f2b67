"""Verify an ftidask Zarr store reading each stored byte once, filling the arrays it is given on the way.

The manifest's digest is the commit record's; each file of the store must match the manifest (size and digest)
and each array must be whole (:mod:`.checks`) before recovery lets a value into a user array. Before, the store was
hashed file by file, then every compressed chunk was read again to see that it decodes, then recovery read it a
third time into the arrays: a restart read the stored bytes up to three times. Now:

1. the manifest's entries are checked against the files' ``stat`` (a missing, truncated or special file is found
   without reading any byte), then the arrays' metadata and chunk grids (:func:`.checks.check_arrays`);
2. the files that are no array's chunks (metadata, anything else the manifest lists) are hashed;
3. each array's chunks are read once: into the buffer given for it (pages staged for a fresh user array, moved
   under it once every rank agreed), each chunk hash-checked as Zarr reads it, before it is decoded; or, with no
   buffer, hash-checked (a compressed chunk decoded into a scratch chunk, so that it is known to decode).
"""

from __future__ import annotations

import itertools
import os
import stat
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..model.errors import FormatError
from ..storage import interrupts
from ..storage.files import MAX_RECORD
from . import store as store_module
from .checks import ArrayChunks, check_arrays


def verify_store(path: Path, expected: str | None = None,
                 into: Mapping[int, np.ndarray] | None = None) -> dict[str, Any]:
    """Check every file the manifest lists (size and digest) and every array (whole, decodable); the manifest.

    ``into``: variable id (of the root group) -> an array of the variable's dtype and shape, filled with its
    verified values on the way (its content is undefined when a :class:`FormatError` is raised).
    """
    manifest, arrays = open_checked(path, expected)
    verify_arrays(path, manifest, arrays, into or {})
    return manifest


def read_verified(path: Path, group: str = "") -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The manifest and the variables of ``group`` as new arrays, the whole store verified, each byte read once (the
    arrays allocated once the metadata and chunk grids are checked: never the size of a manifest alone)."""
    manifest, arrays = open_checked(path)
    table = store_module.store_vars(manifest, path, group)
    out = {}
    for vid, (info, _name) in table.items():
        try:
            out[vid] = info.empty()
        except (MemoryError, ValueError) as exc:  # a shape of 2**40 elements: no traceback from numpy
            raise FormatError(f"{path}: variable {vid} is {info.dtype} {info.shape}: no memory for it "
                              f"({type(exc).__name__}: {exc})") from None
    verify_arrays(path, manifest, arrays, out, group)
    return manifest, out


def verify_arrays(path: Path, manifest: Mapping[str, Any], arrays: Mapping[str, ArrayChunks],
                  into: Mapping[int, np.ndarray], group: str = "") -> None:
    """Step 3, after :func:`open_checked` gave ``manifest`` and ``arrays``: every array's chunks read once, into
    ``into[id]`` (variable ids of ``group``) when given."""
    targets: dict[str, np.ndarray] = {}
    if into:
        table = store_module.store_vars(manifest, path, group)
        if set(into) - set(table):
            raise FormatError(f"{path}: variables {sorted(set(into) - set(table))} are not in the store")
        targets = {table[vid][1]: out for vid, out in into.items()}
    raw = [rel for name, a in arrays.items() if a.raw and name not in targets for rel in a.files]
    _hash_files(path, manifest, raw)
    for name, a in arrays.items():
        if name in targets:
            _decode_into(path, name, a, targets[name])
        elif not a.raw:
            _decode_each(path, name, a)


def open_checked(path: Path, expected: str | None = None) -> tuple[dict[str, Any], dict[str, ArrayChunks]]:
    """Steps 1 and 2 (no chunk read): the manifest and, by name, each variable's array, each chunk checked as it is
    read through it (a reader of some chunks only, :func:`fill`, verifies the chunks it reads)."""
    manifest = store_module.read_manifest(path, expected)
    check_entries(path, manifest)
    arrays = check_arrays(path, manifest)
    chunk_files = {rel for a in arrays.values() for rel in a.files}
    others = [rel for rel in manifest["files"] if rel not in chunk_files]
    for rel in others:  # metadata (zarr.json): a forged file of holes of terabytes would be hashed whole
        if manifest["files"][rel][0] > MAX_RECORD:
            raise FormatError(f"{path}: {rel} holds {manifest['files'][rel][0]} bytes: no chunk of an array, and "
                              f"larger than the {MAX_RECORD} bytes of any ftidask record")
    _hash_files(path, manifest, others)
    return manifest, arrays


def check_entries(path: Path, manifest: Mapping[str, Any]) -> None:
    """Each manifest entry names a regular file inside the store, of the size it lists (``stat`` only)."""
    for rel, entry in manifest["files"].items():
        # Only files inside the store: an absolute entry would make path / rel that very path.
        # A NUL byte names no file (os.open raises ValueError on it).
        if (not isinstance(rel, str) or ".." in Path(rel).parts or Path(rel).is_absolute() or "\0" in rel
                or not isinstance(entry, list) or len(entry) != 2):
            raise FormatError(f"{path}: bad manifest entry {rel!r}")
        try:  # a name no file system takes (a component of 256 bytes) is OSError here
            st = os.stat(path / rel)
        except FileNotFoundError:
            raise FormatError(f"{path}: {rel} is missing") from None
        except OSError as exc:
            raise FormatError(f"{path}: {rel}: {exc}") from None
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block the read or never end
            raise FormatError(f"{path}: {rel} is not a regular file")
        size = st.st_size
        if size != entry[0]:
            raise FormatError(f"{path}: {rel} holds {size} bytes, its manifest entry {entry[0]!r} (damaged Zarr "
                              "chunk or metadata)")
        try:
            store_module._check_meta_sizes(path, {rel: entry})
        except OSError as exc:
            raise FormatError(f"{path}: {rel}: {exc}") from None


def _hash_files(path: Path, manifest: Mapping[str, Any], rels: list[str]) -> None:
    """Each of ``rels`` matches its manifest entry: hashed a few files at a time (hashing releases the GIL)."""
    def one(rel: str) -> str:
        try:
            size, digest = store_module._file_digest(path / rel)
        except FileNotFoundError:
            return f"{path}: {rel} is missing"
        except OSError as exc:
            return f"{path}: {rel}: {exc}"
        entry = manifest["files"][rel]
        if size != entry[0] or digest != entry[1]:
            return f"{path}: {rel} does not match its hash (damaged Zarr chunk or metadata)"
        return ""

    rels = sorted(rels)
    if len(rels) <= 1:
        problems = [one(rel) for rel in rels]
    else:
        with ThreadPoolExecutor(max_workers=store_module._SYNC_THREADS, thread_name_prefix="ftidask-zarr-hash") as pool:
            problems = list(pool.map(one, rels))
    problem = next((p for p in problems if p), "")
    if problem:
        raise FormatError(problem)


#: Chunks read and decoded at once (a call each: the file read, the digest and the codec release the GIL).
_READERS = 4


def _each_block(path: Path, name: str, indices: list[tuple[int, ...]],
                read: Callable[[tuple[int, ...]], None]) -> None:
    """``read(index)`` for each chunk index of ``indices``, a few at a time, each call over before this returns.

    A chunk at a time, never one Zarr call for the whole array: Zarr reads an array's chunks as concurrent tasks
    and raises the first task's error while the others still write into the buffer given, which here may be pages
    unmapped as soon as the error is seen (a refused recovery), a crash of the process."""
    def one(index: tuple[int, ...]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read(index)
        except FormatError:
            raise
        except Exception as exc:  # whatever the codec raises on bytes it cannot decode
            raise FormatError(f"{path}: array {name!r}: chunk {index} does not decode: {type(exc).__name__}: "
                              f"{exc}") from None

    if len(indices) <= 1:
        for index in indices:
            one(index)
        return
    pool = ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="ftidask-zarr-read")
    try:
        for future in [pool.submit(one, index) for index in indices]:
            future.result()
    finally:  # none still writing once this returns or raises (a second Ctrl-C waits for them too)
        with interrupts.held_off():
            pool.shutdown(wait=True, cancel_futures=True)


def _decode_into(path: Path, name: str, a: ArrayChunks, out: np.ndarray) -> None:
    """Read array ``name`` into ``out``; the verified store checks each chunk's digest before Zarr decodes it."""
    z = a.array
    if tuple(out.shape) != tuple(z.shape) or out.dtype.newbyteorder("<") != np.dtype(z.dtype).newbyteorder("<"):
        raise FormatError(f"{path}: array {name!r} is {z.dtype} {z.shape}, the buffer for it {out.dtype} {out.shape}")
    fill(path, name, z, out)


def _decode_each(path: Path, name: str, a: ArrayChunks) -> None:
    """Every chunk of array ``name`` decodes (hash-checked chunks of a forged store may not)."""
    check_chunks(path, name, a.array)


def _bounds(z: Any, src: tuple[slice, ...] | None) -> list[tuple[int, int]]:
    """``[start, stop)`` of each slice of ``src`` (of unit step; None: the whole array) in ``z``'s shape."""
    if src is None:
        return [(0, int(n)) for n in z.shape]
    if any(s.step not in (None, 1) for s in src):
        raise ValueError(f"a region of slices of unit step, got {src}")
    return [s.indices(n)[:2] for s, n in zip(src, z.shape, strict=True)]


def _chunks_of(z: Any, bounds: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The index of each chunk of ``z`` that holds part of the region ``bounds`` (none for an empty region)."""
    if any(lo >= hi for lo, hi in bounds):
        return []
    ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, z.chunks)]
    return [tuple(ix) for ix in itertools.product(*ranges)]


def fill(path: Path, name: str, z: Any, out: np.ndarray, src: tuple[slice, ...] | None = None) -> None:
    """Read the region ``src`` (slices of unit step; None: all of it) of Zarr array ``z`` (``name`` in the store at
    ``path``, opened on its verified store) into ``out``, an array of the region's shape: each chunk that holds part
    of it read once, checked against its digest before it is decoded (:func:`_each_block`)."""
    from zarr.core.buffer import default_buffer_prototype

    bounds = _bounds(z, src)
    wrap = default_buffer_prototype().nd_buffer.from_numpy_array

    def read(index: tuple[int, ...]) -> None:
        sel = tuple(slice(max(lo, i * c), min(hi, (i + 1) * c)) for i, c, (lo, hi) in zip(index, z.chunks, bounds))
        sub = tuple(slice(s.start - lo, s.stop - lo) for s, (lo, _hi) in zip(sel, bounds))
        z.get_basic_selection(sel, out=wrap(out[(*sub, ...)]))  # a view even of a 0-d array

    _each_block(path, name, _chunks_of(z, bounds), read)


def check_chunks(path: Path, name: str, z: Any, src: tuple[slice, ...] | None = None) -> None:
    """Read, check and decode each chunk of Zarr array ``z`` that holds part of the region ``src`` (None: every
    chunk), into a scratch chunk each, dropped."""
    _each_block(path, name, _chunks_of(z, _bounds(z, src)), z.get_block_selection)
