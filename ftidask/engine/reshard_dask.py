"""A Dask checkpoint recovered by MPI ranks or one process: the workers' files hold chunks, not blocks.

A worker's file holds, per variable, the chunks of the Dask array that the worker had, one after the other
(``VarInfo.extra["dask"]``: the global ``shape``, the ``chunks`` grid, and ``[grid index, chunk shape, dptr]``
per held chunk, each chunk C-ordered at byte ``dptr`` of the variable's stream). Loading such a file into a rank's
array as it is would scramble the array (the chunks are in the worker's order, not the array's), so a Dask
checkpoint always goes through the redistribution of :mod:`ftidask.engine.reshard`: each new rank's block (the
whole array with one process and no declaration, or ``global_shape``/``offset``, or ``replicated``) is filled
from the chunks that overlap it, each read from its container and checked against its hash first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..model.decomposition import Piece, Placement, overlap
from ..model.errors import FormatError, FTIError


class Refused(FTIError):
    """The declarations of this run do not match the checkpoint's (an older checkpoint would not fit either)."""


def holds_chunks(entries: Mapping[int, Any]) -> bool:
    """Whether the old files' table entries of a variable (by old rank) record Dask chunks."""
    return any(isinstance(e, dict) and "dask" in e.get("extra", {}) for e in entries.values())


def _grid(vid: int, record: Any) -> tuple[tuple[int, ...], list[list[int]]]:
    """The global shape and the chunk grid a worker's entry records (FormatError when malformed)."""
    try:
        shape = tuple(int(n) for n in record["shape"])
        grid = [[int(c) for c in dim] for dim in record["chunks"]]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of JSON's Infinity
        raise FormatError(f"variable {vid}: bad Dask chunk record: {exc}") from None
    if len(grid) != len(shape) or any(n < 0 for dim in grid for n in dim) or [sum(d) for d in grid] != list(shape):
        raise FormatError(f"variable {vid}: its Dask chunk grid does not tile its shape {shape}")
    return shape, grid


def pieces(vid: int, entries: Mapping[int, Any], array: np.ndarray, new: Placement,
           dtype: np.dtype) -> tuple[Placement, list[tuple[int, Piece]]]:
    """This rank's block of variable ``vid`` (``new`` as declared; the whole array when nothing or ``replicated``
    is declared) and ``(old rank, piece)`` for every chunk that overlaps it, the piece's byte span placed at the
    chunk's ``dptr`` in the old file's stream. :class:`Refused` when the declaration does not fit the checkpoint,
    FormatError when a worker's record is malformed."""
    records = {old: e["extra"].get("dask") for old, e in entries.items() if e is not None}
    shape, grid = _grid(vid, next(iter(records.values())))
    if new.kind == "block":
        if new.global_shape != shape:
            raise Refused(f"variable {vid}: global shape {new.global_shape} here, {shape} in the checkpoint")
    elif tuple(array.shape) != shape:
        raise Refused(f"variable {vid}: the checkpoint holds a Dask array of shape {shape}, the protected array is "
                      f"{tuple(array.shape)} (protect the whole array, or declare this rank's block: "
                      "global_shape=..., offset=...)")
    else:
        new = Placement("block", shape, (0,) * len(shape))
    starts = [np.cumsum([0, *dim]).tolist() for dim in grid]
    out: list[tuple[int, Piece]] = []
    seen: set[tuple[int, ...]] = set()
    for old, record in sorted(records.items()):
        if _grid(vid, record) != (shape, grid):
            raise FormatError(f"variable {vid}: old rank {old} records another Dask array than old rank "
                              f"{min(records)}")
        var_bytes = math.prod(int(n) for n in entries[old]["shape"]) * dtype.itemsize
        try:
            held = [(tuple(int(i) for i in index), tuple(int(n) for n in cshape), int(dptr))
                    for index, cshape, dptr in record.get("blocks", [])]
        except (TypeError, ValueError, OverflowError) as exc:
            raise FormatError(f"variable {vid}: bad Dask chunk record of old rank {old}: {exc}") from None
        _check_tiling(vid, old, [(dptr, math.prod(cshape) * dtype.itemsize) for _i, cshape, dptr in held], var_bytes)
        for index, cshape, dptr in held:
            nbytes = math.prod(cshape) * dtype.itemsize  # Python ints: a forged shape cannot wrap around
            if (len(index) != len(shape) or len(cshape) != len(shape) or index in seen or dptr < 0
                    or dptr + nbytes > var_bytes
                    or any(not 0 <= i < len(dim) or dim[i] != n for i, n, dim in zip(index, cshape, grid))):
                raise FormatError(f"variable {vid}: chunk {list(index)} of old rank {old} does not fit its grid or "
                                  "its worker's file")
            seen.add(index)
            offset = tuple(starts[d][i] for d, i in enumerate(index))
            piece = overlap(offset, cshape, "C", dtype.itemsize, new.offset, array.shape)
            if piece is not None:
                out.append((old, dataclasses.replace(piece, span=(piece.span[0] + dptr, piece.span[1] + dptr),
                                                     first=piece.first + dptr)))
    return new, out


def _check_tiling(vid: int, old: int, spans: list[tuple[int, int]], var_bytes: int) -> None:
    """A worker writes its chunks back to back: their ``(dptr, bytes)`` spans tile its variable's stream exactly.
    Chunks said to overlap (a forged record) would put one chunk's verified bytes in two places (FormatError)."""
    pos = 0
    for dptr, nbytes in sorted(spans):
        if dptr != pos:
            raise FormatError(f"variable {vid}: the Dask chunks of old rank {old} do not tile its stream (a gap or an "
                              f"overlap at byte {pos})")
        pos += nbytes
    if pos != var_bytes:
        raise FormatError(f"variable {vid}: the Dask chunks of old rank {old} hold {pos} bytes, its file {var_bytes}")


def piece_of_stream(piece: Piece, whole: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The piece as a view of a variable read whole (a Zarr store's: verified whole first)."""
    stream = whole.reshape(-1).view(np.uint8)
    return np.ndarray(piece.shape, dtype, buffer=stream, offset=piece.first, strides=piece.strides)
