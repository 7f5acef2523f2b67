"""Which NumPy dtypes a Zarr v3 store gives back as they were written: refused at write time otherwise.

Zarr v3 reads an array in native byte order (a plain dtype's byte order is the ``bytes`` codec's, and its values
come back right). A structured dtype is another matter: Zarr's structured type has no per-field byte order, no
padding and no offsets, so big-endian fields (``[('a', '>i4')]``) read back as little-endian ones over the same
bytes (silently wrong values), and an aligned or offset dtype (``align=True``) reads back as another dtype (a
checkpoint that no recovery takes, committed in place of the previous one). A generic ``datetime64`` (no unit)
is written, then its metadata cannot be read (``Invalid fill_value``). What Zarr would read is found from the
metadata just made, before any byte is written: a dtype that does not come back is refused (the checkpoint fails
and the previous one is kept; an export says so).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..model.errors import FormatError


def same_dtype(read: np.dtype, source: np.dtype) -> bool:
    """Whether Zarr's dtype ``read`` gives back the values of ``source``: equal, but for a plain dtype's byte order
    (a structured one's fields must be equal, byte order, offsets and itemsize included)."""
    if read.fields is not None or source.fields is not None or read.subdtype or source.subdtype:
        return read == source
    return read.newbyteorder("<") == source.newbyteorder("<")


def _generic_time(dtype: np.dtype) -> bool:
    if dtype.fields is not None:
        return any(_generic_time(field[0]) for field in dtype.fields.values())
    if dtype.subdtype is not None:
        return _generic_time(dtype.subdtype[0])
    return dtype.kind == "M" and np.datetime_data(dtype)[0] == "generic"


def refuse(vid: int, name: str, dtype: Any, why: str) -> FormatError:
    """The error for a variable whose dtype Zarr cannot store (the checkpoint's or the export's to raise)."""
    return FormatError(f"variable {vid} ({name!r}): Zarr cannot store dtype {dtype}: {why}; keep it in FTI-FF files "
                       "(l4_format = ftiff)")


def check_before(vid: int, name: str, dtype: np.dtype) -> None:
    """Refuse what Zarr would fail on later, with a traceback: a generic datetime64 (Zarr writes it, then cannot
    read its own metadata: found only by ``consolidate_metadata``, out of any handler)."""
    if _generic_time(dtype):
        raise refuse(vid, name, dtype, "a datetime64 without a unit (give one: datetime64[s], ...)")


def check_created(z: Any, vid: int, name: str, dtype: np.dtype) -> None:
    """Refuse array ``z`` (just created, nothing written) unless a reader of its metadata gets ``dtype`` back."""
    try:  # the metadata as it is written, then read back (in memory: nothing more on disk)
        meta = type(z.metadata).from_dict(json.loads(json.dumps(z.metadata.to_dict(), default=str)))
        read = np.dtype(meta.dtype.to_native_dtype())
    except Exception as exc:  # zarr raises many kinds on metadata it cannot read (TypeError, ValueError, ...)
        raise refuse(vid, name, dtype, f"its metadata cannot be read back ({type(exc).__name__}: {exc})") from None
    if not same_dtype(read, dtype):
        raise refuse(vid, name, dtype, f"a Zarr reader gets {read} back (Zarr's structured type has no byte order, "
                     "padding or offsets per field: use a packed, little-endian dtype)")
