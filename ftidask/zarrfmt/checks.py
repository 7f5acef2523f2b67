"""The arrays of a Zarr store whose files matched their manifest: each one as the manifest describes it.

The files' hashes say that the store holds what its writer hashed; these checks say that it is whole: each
variable's array opens with the manifest's shape and dtype, its chunk files are exactly its chunks (a writer
of :mod:`.store` writes every chunk, empty or not: a chunk without a file would read as Zarr's fill value,
a value the checkpoint never held) and each chunk file can be a chunk (an uncompressed one holds a whole chunk's
bytes, a compressed one is one Zstd frame or Blosc buffer whose header declares them: :mod:`.chunkfile`; the
dtype exactly, a structured one's fields with their byte order: :mod:`.dtypes`). A forged chunk grid of billions
of chunks is refused by its count, before any chunk is read. That every chunk decodes is seen as it is read
(:mod:`.verify`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..model.errors import FormatError
from . import store as store_module
from .chunkfile import check_chunk_file
from .dtypes import same_dtype


@dataclasses.dataclass(frozen=True)
class ArrayChunks:
    """A variable's array as checked: opened on the verified store, and its chunk files."""

    array: Any  # zarr.Array, reading through store.verified_store
    files: list[str]  # the manifest's keys of its chunk files
    raw: bool  # uncompressed, no filter: a chunk file is the chunk's bytes


def check_arrays(path: Path, manifest: Mapping[str, Any]) -> dict[str, ArrayChunks]:
    """Each variable's array exists with the shape and dtype the manifest gives it (its metadata and the chunk
    files' sizes and headers only); by array name, what the data pass needs.

    Checked with the hashes, before recovery fills any array: found only while filling them, a
    mismatch would leave the variables read before it recovered and the others not.
    """
    zarr = store_module._zarr()
    store = store_module.verified_store(path, manifest)
    entries = store_module.store_entries(manifest, path)
    files_of = _files_by_array(manifest, {name for name, _info in entries})
    out = {}
    for name, info in entries:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # Zarr v3 only: else Zarr probes v2's metadata names too (.zarray, .zattrs), files no manifest lists
                z = zarr.open_array(store=store, path=name, mode="r", zarr_format=3)
                shape, dtype = tuple(z.shape), np.dtype(z.dtype)
                grid = tuple(z.cdata_shape)  # a chunk shape of 0: ZeroDivisionError
        except FormatError:
            raise
        except Exception as exc:  # zarr raises many kinds on metadata it cannot read
            raise FormatError(f"{path}: array {name!r} cannot be opened: {exc}") from None
        if shape != info.shape or not same_dtype(dtype, info.dtype):
            raise FormatError(f"{path}: array {name!r} is {dtype} {shape}, the manifest says {info.dtype} "
                              f"{info.shape}")
        files = files_of.get(name, [])
        chunks = _check_chunk_files(path, files, name, z, grid)
        raw = _check_chunk_sizes(path, manifest, chunks, name, z)
        out[name] = ArrayChunks(z, chunks, raw)
    return out


def _files_by_array(manifest: Mapping[str, Any], names: set[str]) -> dict[str, list[str]]:
    """The files of the manifest under each array of ``names`` (``name/...``), in the manifest's order: found once
    by walking each file's path a component at a time down a tree of the arrays' names, where each array's checks
    scanned every file of the store (10,000 variables: 10,000 x 10,000 paths, 109 s to verify the store).

    A component at a time, never a prefix sliced at each slash: a forged manifest's path of n slashes made that
    O(n^2) (4,000 slashes, the most a file system opens: 8 ms a path; 256 MiB of them, minutes)."""
    tree: dict[str | None, Any] = {}  # component -> subtree; None -> the array's name ending there
    for name in names:
        node = tree
        for part in name.split("/"):
            node = node.setdefault(part, {})
        node[None] = name
    out: dict[str, list[str]] = {}
    for rel in manifest["files"]:
        node = tree
        for part in rel.split("/")[:-1]:  # a name followed by a slash: the last component is no array's
            node = node.get(part)
            if node is None:
                break
            if None in node:
                out.setdefault(node[None], []).append(rel)
    return out


def _check_chunk_files(path: Path, files: list[str], name: str, z: Any, grid: tuple[int, ...]) -> list[str]:
    """The manifest lists a file for every chunk of array ``name`` (``z``, its chunk grid ``grid``; ``files``: the
    manifest's files under it), and no other file in it but its metadata: counted first (a grid of more chunks than
    files is refused without walking it), then each chunk's key. The chunk files."""
    listed = {rel for rel in files if rel != f"{name}/zarr.json"}
    count = int(np.prod(grid, dtype=object))
    if count != len(listed):
        raise FormatError(f"{path}: array {name!r} has {count} chunks, the manifest lists {len(listed)} chunk files")
    for index in np.ndindex(*grid):  # as many as the files listed
        key = f"{name}/{z.metadata.encode_chunk_key(index)}"
        if key not in listed:
            raise FormatError(f"{path}: array {name!r}: chunk {index} ({key}) is not in the store")
    return sorted(listed)


def _check_chunk_sizes(path: Path, manifest: Mapping[str, Any], chunks: list[str], name: str, z: Any) -> bool:
    """Each chunk file of ``z`` (``chunks``: its chunk keys, whatever their encoding) can be a chunk: an uncompressed
    array's are whole chunks, a compressed one's codec headers declare a chunk's raw size
    (:func:`_check_declared_sizes`). Whether the array is uncompressed.

    A chunk shape is at most its array's, first: Zarr reads a chunk file whole, and a forged chunk of 2**28
    elements is a file of holes of gigabytes (free to its forger) that the verified store reads before its hash
    can refuse it, and a buffer of that size for Zarr to decode into."""
    if any(c > max(n, 1) for c, n in zip(z.chunks, z.shape, strict=True)):
        raise FormatError(f"{path}: array {name!r}: chunks {tuple(z.chunks)} are larger than its shape {z.shape}")
    if not z.compressors and not z.filters and type(z.serializer).__name__ == "BytesCodec":
        whole = int(np.prod(z.chunks)) * z.dtype.itemsize
        for rel in chunks:  # every one: a forged key encoding (c.0, v2's 0, a 0-d array's c) is a chunk too
            check_chunk_file(path, rel, "raw", whole, manifest["files"][rel][0])
        return True
    _check_declared_sizes(path, manifest, chunks, name, z)
    return False


def _check_declared_sizes(path: Path, manifest: Mapping[str, Any], chunks: list[str], name: str, z: Any) -> None:
    """Before a compressed chunk is decoded (its chunk shape checked to be at most its array's): each chunk file
    is one Zstd frame or Blosc buffer declaring exactly a chunk's raw size (:func:`.chunkfile.check_chunk_file`).
    A codec allocates what its header declares, and hash-checked bytes of a forged store can declare anything: a
    Zstd frame of a few bytes unpacks to terabytes, a second frame after a chunk's own as much again, and a chunk
    shape of 2**40 elements is a buffer Zarr allocates for any chunk. Only the codecs ftidask writes are read."""
    kinds = [type(c).__name__ for c in z.compressors]
    codec = {("ZstdCodec",): "zstd", ("BloscCodec",): "blosc"}.get(tuple(kinds))
    if codec is None or z.filters:
        raise FormatError(f"{path}: array {name!r}: filters {list(z.filters)} and compressors {kinds} are not "
                          "those of a store ftidask writes (one Zstd or Blosc compressor)")
    whole = int(np.prod(z.chunks)) * z.dtype.itemsize
    for rel in chunks:  # a file the manifest lists, not hashed yet: its size as the manifest says (else refused)
        size = manifest["files"][rel][0]
        check_chunk_file(path, rel, codec, whole, size if isinstance(size, int) else -1)
