"""Zarr groups that ftidask did not write: read as they are, ids from their attributes."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from ..model.errors import FormatError
from ..storage.files import MAX_RECORD


def _memory_bytes() -> int:
    """The machine's physical memory (no array of a foreign store may need more: its shape is untrusted)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):  # pragma: no cover - every Linux has both
        return 1 << 62


#: Zarr's metadata files: read whole by Zarr, so bounded like ftidask's own JSON records.
_METADATA = {"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"}


def _file_sizes(path: Path) -> dict[str, int]:
    """Every file of the store and its size; a :class:`FormatError` for a file that is no regular file (a FIFO
    would block Zarr's read for ever, a device never end) or for metadata larger than any record."""
    sizes = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if not os.path.isfile(full):
                raise FormatError(f"{path}: {rel} is not a regular file")
            sizes[rel] = os.stat(full).st_size
            if name in _METADATA and sizes[rel] > MAX_RECORD:  # a sparse file costs nothing on disk
                raise FormatError(f"{path}: {rel} has {sizes[rel]} bytes, larger than any Zarr metadata file "
                                  f"({MAX_RECORD} bytes at most); it is not read")
    return sizes


def _check_data_files(path: Path, sizes: dict[str, int], largest: int) -> None:
    """No chunk or shard is larger than the largest array's bytes (plus a codec's overhead): Zarr reads a
    chunk's file whole, so a file forged larger is refused before it is read."""
    limit = largest + largest // 64 + (1 << 20)
    for rel, size in sizes.items():
        if os.path.basename(rel) not in _METADATA and size > limit:
            raise FormatError(f"{path}: {rel} has {size} bytes, larger than any array of the store holds "
                              f"({largest} bytes); it is not read")


def read_plain_group(path: Path, group: str = "") -> dict[int, tuple[str, np.ndarray]]:
    """The arrays of a Zarr group that ftidask did not write, by id: ``{id: (name, array)}``.

    Ids come from the arrays' ``ftidask_id`` attribute, else 1, 2, ... in name order. Nothing in such a
    store is hash-checked: metadata that Zarr cannot read, an array larger than the machine's memory
    (a shape is not checked against the bytes on disk: missing chunks are the fill value), or a file larger
    than Zarr's metadata or chunks can be (read whole by Zarr) is a :class:`FormatError`.
    """
    import zarr

    sizes = _file_sizes(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = zarr.open_group(str(path), mode="r")
            node = root[group] if group else root
            names = sorted(name for name, _a in node.arrays())
            out: dict[int, tuple[str, np.ndarray]] = {}
            next_id = 1
            largest = 0
            for name in names:
                z = node[name]
                nbytes = int(np.prod(z.shape, dtype=object)) * np.dtype(z.dtype).itemsize
                if nbytes > _memory_bytes():
                    raise FormatError(f"{path}: array {name!r} of shape {tuple(z.shape)} ({nbytes} bytes) is larger "
                                      "than this machine's memory")
                largest = max(largest, nbytes)
            _check_data_files(path, {rel: n for rel, n in sizes.items()  # the arrays read: the group's
                                     if not group or rel.startswith(group.strip("/") + os.sep)}, largest)
            for name in names:
                z = node[name]
                vid = z.attrs.get("ftidask_id")
                if not isinstance(vid, int) or vid in out:
                    while next_id in out:
                        next_id += 1
                    vid = next_id
                out[vid] = (str(z.attrs.get("ftidask_name", name)), np.asarray(z[...]))
    except FormatError:
        raise
    except MemoryError:
        raise FormatError(f"{path}: its arrays do not fit in memory") from None
    except Exception as exc:  # zarr raises many kinds on metadata it cannot read
        raise FormatError(f"{path}: not a Zarr group that can be read: {type(exc).__name__}: {exc}") from None
    return out
