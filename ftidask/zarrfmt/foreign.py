"""Zarr groups that ftidask did not write: read as they are, ids from their attributes.

Nothing in such a store is hash-checked, so every read is bounded before Zarr makes it:

- the store is walked before Zarr opens anything: a symbolic link (to a file or a directory: a linked directory
  was never walked, so a FIFO or a sparse file of gigabytes behind it reached Zarr) or anything but a regular file
  or a directory is refused, and Zarr then reads only the files that walk found, as they were (:class:`_Walked`);
- an array is read only with the codecs whose decoded size its chunk files declare (none, one Zstd frame, one
  Blosc buffer: :func:`.chunkfile.check_chunk_file`), each chunk file checked before any is decoded; a
  variable-length dtype, a filter, a sharded array or another codec is refused (what it unpacks to is only known
  by unpacking it: a vlen chunk of 68 bytes declared 2**26 items);
- only the chunk files that exist are read: a grid of 2**32 chunks of one element, none of them stored, made Zarr
  run one task per chunk (days), for an array that is all its fill value.
"""

from __future__ import annotations

import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..model.errors import FormatError
from ..storage.files import MAX_RECORD
from .chunkfile import check_chunk_file


def _memory_bytes() -> int:
    """The machine's physical memory (no array of a foreign store may need more: its shape is untrusted)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):  # pragma: no cover - every Linux has both
        return 1 << 62


#: Zarr's metadata files: read whole by Zarr, so bounded like ftidask's own JSON records.
_METADATA = {"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"}
_ID_RANGE = (-(2**31), 2**31 - 1)  # FTI's ids are C ints
_WHOLE_READ = 4096  # missing chunks a whole-array read may pass over (Zarr's cost per chunk, file or not)
_CHUNK_FLOOR = 64 << 20  # bytes a chunk may unpack to whatever the array's size


def _file_sizes(path: Path) -> dict[str, int]:
    """Every file of the store (its ``/``-separated path) and its size; a :class:`FormatError` for a symbolic
    link, for anything that is neither a regular file nor a directory (a FIFO would block Zarr's read for ever, a
    device never end) or for metadata larger than any record."""
    def failed(exc: OSError) -> None:  # a directory that cannot be listed: its files would be read unchecked
        raise FormatError(f"{path}: cannot list {exc.filename}: {exc.strerror}")

    sizes = {}
    for dirpath, dirs, files in os.walk(path, onerror=failed):  # links never followed: refused below
        for name in [*dirs, *files]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            try:
                st = os.lstat(full)
            except OSError as exc:
                raise FormatError(f"{path}: {rel}: {exc.strerror}") from None
            if stat.S_ISLNK(st.st_mode):
                raise FormatError(f"{path}: {rel} is a symbolic link: a store is read only from its own files")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path}: {rel} is not a regular file")
            sizes[rel] = st.st_size
            if name in _METADATA and sizes[rel] > MAX_RECORD:  # a sparse file costs nothing on disk
                raise FormatError(f"{path}: {rel} has {sizes[rel]} bytes, larger than any Zarr metadata file "
                                  f"({MAX_RECORD} bytes at most); it is not read")
    return sizes


def _walked_store(path: Path, sizes: dict[str, int]) -> Any:
    """A read-only Zarr store on ``path`` that reads only the files :func:`_file_sizes` found, still regular files
    of the size found (a file swapped for a FIFO or a larger one after the walk is refused, never opened)."""
    from zarr.storage import LocalStore

    class _Walked(LocalStore):
        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            try:
                st = os.lstat(path / key)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            except (OSError, ValueError) as exc:  # a name no file system takes; a NUL byte
                raise FormatError(f"{path}: {key}: {exc}") from None
            if key not in sizes:  # (a directory is no file Zarr reads: no key names one)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    raise FormatError(f"{path}: {key} appeared while the store was read")
                return None
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != sizes[key]:
                raise FormatError(f"{path}: {key} changed while the store was read")
            return await super().get(key, prototype, byte_range)

    return _Walked(root=str(path), read_only=True)


def _check_data_files(path: Path, sizes: dict[str, int], largest: int) -> None:
    """No chunk or shard is larger than the largest array's bytes (plus a codec's overhead): Zarr reads a
    chunk's file whole, so a file forged larger is refused before it is read."""
    limit = largest + largest // 64 + (1 << 20)
    for rel, size in sizes.items():
        if os.path.basename(rel) not in _METADATA and size > limit:
            raise FormatError(f"{path}: {rel} has {size} bytes, larger than any array of the store holds "
                              f"({largest} bytes); it is not read")


def _codec(path: Path, name: str, z: Any) -> str:
    """How array ``z``'s chunk files are decoded: "raw", "zstd" or "blosc", else a :class:`FormatError`."""
    dtype = np.dtype(z.dtype)
    if dtype.hasobject or dtype.kind == "T":
        raise FormatError(f"{path}: array {name!r} has the variable-length dtype {z.dtype}: not imported (what a "
                          "chunk unpacks to is only known by unpacking it)")
    if getattr(z, "shards", None) is not None:
        raise FormatError(f"{path}: array {name!r} is sharded: not imported (rewrite it without shards)")
    serializer = getattr(z, "serializer", None)  # None for a Zarr v2 array
    compressors = [type(c).__name__ for c in z.compressors]
    codec = {(): "raw", ("ZstdCodec",): "zstd", ("Zstd",): "zstd", ("BloscCodec",): "blosc",
             ("Blosc",): "blosc"}.get(tuple(compressors))
    if z.filters or codec is None or (serializer is not None and type(serializer).__name__ != "BytesCodec"):
        raise FormatError(f"{path}: array {name!r}: filters {list(z.filters)}, serializer {serializer} and "
                          f"compressors {compressors} are not imported (none or one Zstd or Blosc compressor: "
                          "the codecs whose decoded size is known before decoding)")
    # A chunk unpacks to its whole shape, edges included: bounded by the array's bytes, or 64 MiB (a chunk larger than
    # the array in a dimension is common: an array shrunk, a series with fixed chunks)
    chunk_bytes = math.prod(z.chunks) * dtype.itemsize
    if chunk_bytes > max(math.prod(z.shape) * dtype.itemsize, _CHUNK_FLOOR):
        raise FormatError(f"{path}: array {name!r}: chunks {tuple(z.chunks)} of {chunk_bytes} bytes, for an array of "
                          f"shape {z.shape}: not imported")
    return codec


def _chunk_index(z: Any, key: str, grid: tuple[int, ...]) -> tuple[int, ...] | None:
    """The chunk of ``z`` that file ``key`` (its path under the array) holds, or None: no chunk's file."""
    parts = key.replace(".", "/").split("/")
    if parts[0] == "c":  # Zarr v3's default encoding (c/0/1, c.0.1; c alone for a 0-d array)
        parts = parts[1:]
    if not z.ndim:
        index: tuple[int, ...] = ()
    elif len(parts) == z.ndim and all(p.isdigit() and p.isascii() for p in parts):
        index = tuple(int(p) for p in parts)
    else:
        return None
    if any(i >= n for i, n in zip(index, grid, strict=True)) or z.metadata.encode_chunk_key(index) != key:
        return None
    return index


def _read_array(path: Path, name: str, z: Any, sizes: dict[str, int]) -> np.ndarray:
    """Array ``z`` (``name``), each chunk file checked before any is decoded and only the stored chunks read."""
    codec = _codec(path, name, z)
    dtype = np.dtype(z.dtype)
    whole = int(np.prod(z.chunks, dtype=object)) * dtype.itemsize
    grid = tuple(int(n) for n in z.cdata_shape)
    prefix = f"{z.path.strip('/')}/"
    present = {}
    for rel, size in sizes.items():
        if rel.startswith(prefix) and rel.rpartition("/")[2] not in _METADATA:
            index = _chunk_index(z, rel[len(prefix):], grid)
            if index is not None:  # any other file there Zarr never reads
                check_chunk_file(path, rel, codec, whole, size)
                present[index] = rel
    if int(np.prod(grid, dtype=object)) <= 2 * len(present) + _WHOLE_READ:
        return np.asarray(z[...])
    out = np.empty(z.shape, dtype)
    out[...] = 0 if z.fill_value is None else z.fill_value  # what Zarr gives a chunk without a file
    for index in present:
        region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, z.chunks, z.shape, strict=True))
        out[region] = z[region]
    return out


def _ids(path: Path, nodes: dict[str, Any]) -> dict[str, int]:
    """Each array's variable id: its ``ftidask_id`` attribute, else the next id no array asked for (in name
    order). Explicit ids are taken first: numbered in turn, an array without one took an id another array asked
    for, and recovery filled that variable with its values."""
    out: dict[str, int] = {}
    taken: dict[int, str] = {}
    for name, z in nodes.items():
        vid = z.attrs.get("ftidask_id")
        if vid is None:
            continue
        if type(vid) is not int or not _ID_RANGE[0] <= vid <= _ID_RANGE[1]:  # a bool is no id
            raise FormatError(f"{path}: array {name!r}: ftidask_id {vid!r} is not a variable id (a 32-bit int)")
        if vid in taken:
            raise FormatError(f"{path}: arrays {taken[vid]!r} and {name!r} both have ftidask_id {vid}")
        taken[vid] = name
        out[name] = vid
    next_id = 1
    for name in nodes:
        if name not in out:
            while next_id in taken:
                next_id += 1
            taken[next_id] = name
            out[name] = next_id
    return out


def _var_name(path: Path, name: str, z: Any) -> str:
    value = z.attrs.get("ftidask_name", name)
    if not isinstance(value, str):
        raise FormatError(f"{path}: array {name!r}: ftidask_name {value!r} is not a string")
    return value


def read_plain_group(path: Path, group: str = "") -> dict[int, tuple[str, np.ndarray]]:
    """The arrays of a Zarr group that ftidask did not write, by id: ``{id: (name, array)}``.

    Ids come from the arrays' ``ftidask_id`` attribute, else the lowest ids no array asked for, in name order.
    Metadata that Zarr cannot read, an array larger than the machine's memory (a shape is not checked against
    the bytes on disk: missing chunks are the fill value), a file larger than Zarr's metadata or chunks can be
    (read whole by Zarr), or a chunk whose decoded size is not known before decoding it is a :class:`FormatError`.
    """
    import zarr

    sizes = _file_sizes(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = zarr.open_group(store=_walked_store(path, sizes), mode="r")
            node = root[group] if group else root
            nodes = dict(sorted(node.arrays()))
            largest = 0
            for name, z in nodes.items():
                nbytes = int(np.prod(z.shape, dtype=object)) * np.dtype(z.dtype).itemsize
                if nbytes > _memory_bytes():
                    raise FormatError(f"{path}: array {name!r} of shape {tuple(z.shape)} ({nbytes} bytes) is larger "
                                      "than this machine's memory")
                largest = max(largest, nbytes)
            _check_data_files(path, {rel: n for rel, n in sizes.items()  # the arrays read: the group's
                                     if not group or rel.startswith(group.strip("/") + "/")}, largest)
            ids = _ids(path, nodes)
            names = {name: _var_name(path, name, z) for name, z in nodes.items()}
            return {ids[name]: (names[name], _read_array(path, name, z, sizes)) for name, z in nodes.items()}
    except FormatError:
        raise
    except MemoryError:
        raise FormatError(f"{path}: its arrays do not fit in memory") from None
    except Exception as exc:  # zarr raises many kinds on metadata it cannot read
        raise FormatError(f"{path}: not a Zarr group that can be read: {type(exc).__name__}: {exc}") from None


def plain_group_attrs(path: Path) -> dict[str, Any]:
    """The attributes of the root group of a Zarr store ftidask did not write (or rewrote with zarr or xarray: its
    ``checkpoint_id``); a :class:`FormatError` when Zarr cannot read them."""
    import zarr

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            attrs = zarr.open_group(store=_walked_store(path, _file_sizes(path)), mode="r").attrs.asdict()
    except Exception as exc:  # noqa: BLE001 - zarr raises many kinds on metadata it cannot read
        raise FormatError(f"{path}: not a Zarr group that can be read: {type(exc).__name__}: {exc}") from None
    return dict(attrs) if isinstance(attrs, dict) else {}
