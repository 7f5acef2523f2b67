"""Zarr groups that ftidask did not write: read as they are, ids from their attributes."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np


def read_plain_group(path: Path, group: str = "") -> dict[int, tuple[str, np.ndarray]]:
    """The arrays of a Zarr group that ftidask did not write, by id: ``{id: (name, array)}``.

    Ids come from the arrays' ``ftidask_id`` attribute, else 1, 2, ... in name order.
    """
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = zarr.open_group(str(path), mode="r")
        node = root[group] if group else root
        names = sorted(name for name, _a in node.arrays())
        out: dict[int, tuple[str, np.ndarray]] = {}
        next_id = 1
        for name in names:
            z = node[name]
            vid = z.attrs.get("ftidask_id")
            if not isinstance(vid, int) or vid in out:
                while next_id in out:
                    next_id += 1
                vid = next_id
            out[vid] = (str(z.attrs.get("ftidask_name", name)), np.asarray(z[...]))
    return out
