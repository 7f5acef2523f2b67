"""Zarr groups that ftidask did not write: read as they are, ids from their attributes."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from ..model.errors import FormatError


def _memory_bytes() -> int:
    """The machine's physical memory (no array of a foreign store may need more: its shape is untrusted)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):  # pragma: no cover - every Linux has both
        return 1 << 62


def read_plain_group(path: Path, group: str = "") -> dict[int, tuple[str, np.ndarray]]:
    """The arrays of a Zarr group that ftidask did not write, by id: ``{id: (name, array)}``.

    Ids come from the arrays' ``ftidask_id`` attribute, else 1, 2, ... in name order. Nothing in such a
    store is hash-checked: metadata that Zarr cannot read, or an array larger than the machine's memory
    (a shape is not checked against the bytes on disk: missing chunks are the fill value), is a
    :class:`FormatError`.
    """
    import zarr

    for dirpath, _dirs, files in os.walk(path):
        for name in files:  # a FIFO would block Zarr's read for ever, a device never end
            if not os.path.isfile(os.path.join(dirpath, name)):
                raise FormatError(f"{path}: {os.path.relpath(os.path.join(dirpath, name), path)} is not a regular file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            root = zarr.open_group(str(path), mode="r")
            node = root[group] if group else root
            names = sorted(name for name, _a in node.arrays())
            out: dict[int, tuple[str, np.ndarray]] = {}
            next_id = 1
            for name in names:
                z = node[name]
                nbytes = int(np.prod(z.shape, dtype=object)) * np.dtype(z.dtype).itemsize
                if nbytes > _memory_bytes():
                    raise FormatError(f"{path}: array {name!r} of shape {tuple(z.shape)} ({nbytes} bytes) is larger "
                                      "than this machine's memory")
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
