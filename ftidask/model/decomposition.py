"""Where a rank's array sits in a global array, and which bytes of the old blocks fill a new block.

A protected variable may declare a block of a global array (``global_shape`` and ``offset``, or a
:class:`Block`) or that it is *replicated* (every rank holds the same array). The declaration goes
into the variable table (``VarInfo.extra``: ``global_shape`` and ``offset``, or ``replicated``), so
that a restart on another number of ranks can redistribute the data (:mod:`ftidask.engine.reshard`).

The planner here is pure geometry (no I/O): the intersection of hyper-rectangles, and the byte span
of the old rank's stream (C or Fortran order) that holds it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import FormatError, ProtectError


@dataclasses.dataclass(frozen=True)
class Block:
    """A block of a global array: ``global_shape`` of the whole array, ``offset`` of this block's first element."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", _ints(self.global_shape, "global_shape"))
        object.__setattr__(self, "offset", _ints(self.offset, "offset"))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    try:
        out = tuple(int(v) for v in value)
        if any(isinstance(v, bool) or int(v) != v for v in value):
            raise ValueError
    except (TypeError, ValueError):
        raise ProtectError(f"{what} must be a sequence of ints, got {value!r}") from None
    if any(abs(v) >= 2**63 for v in out):  # before: recorded, and a restart on another layout failed deep inside
        raise ProtectError(f"{what} {out} does not fit NumPy's 64-bit sizes")
    return out


def declaration(array: np.ndarray, global_shape: Any = None, offset: Any = None,
                replicated: bool = False) -> dict[str, Any] | None:
    """The ``VarInfo.extra`` keys that record where ``array`` sits; None when nothing is declared.

    ``global_shape`` may be a :class:`Block` (then ``offset`` is not given). Refuses (with
    :class:`ProtectError`) a block that does not lie inside the global array.
    """
    if not isinstance(replicated, (bool, np.bool_)):  # "no" would be true, and declare it replicated
        raise ProtectError(f"replicated must be True or False, got {replicated!r}")
    if isinstance(global_shape, Block):
        if offset is not None:
            raise ProtectError("pass a Block, or global_shape and offset, not both")
        global_shape, offset = global_shape.global_shape, global_shape.offset
    if replicated:
        if global_shape is not None or offset is not None:
            raise ProtectError("a replicated variable has no global_shape or offset (every rank holds all of it)")
        return {"replicated": True}
    if global_shape is None and offset is None:
        return None
    if global_shape is None or offset is None:
        raise ProtectError("declare a block with both global_shape and offset (or ftidask.Block(global_shape, offset))")
    shape, start = _ints(global_shape, "global_shape"), _ints(offset, "offset")
    if len(shape) != array.ndim or len(start) != array.ndim:
        raise ProtectError(f"global_shape {shape} and offset {start} must have one entry per dimension of the "
                           f"array ({array.ndim}-d, shape {tuple(array.shape)})")
    for d, (g, o, n) in enumerate(zip(shape, start, array.shape)):
        if g < 0 or o < 0 or o + n > g:
            raise ProtectError(f"the block (shape {tuple(array.shape)}, offset {start}) does not lie inside the "
                               f"global array {shape} (dimension {d})")
    return {"global_shape": list(shape), "offset": list(start)}


def still_fits(array: np.ndarray, decl: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``decl`` (an earlier declaration of the same variable) if it still fits ``array``, else None."""
    if not decl:
        return None
    try:
        return declaration(array, decl.get("global_shape"), decl.get("offset"), bool(decl.get("replicated")))
    except ProtectError:
        return None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank's array sits: ``kind`` is ``block``, ``replicated`` or ``none``."""

    kind: str
    global_shape: tuple[int, ...] = ()
    offset: tuple[int, ...] = ()


def placement(extra: Mapping[str, Any], shape: Sequence[int]) -> Placement:
    """The placement a variable's table entry records (``FormatError`` when it is malformed: entries that are not
    JSON ints, one per dimension, a block that does not lie inside its global array)."""
    if "replicated" in extra:
        if extra["replicated"] is not True or "global_shape" in extra or "offset" in extra:
            raise FormatError(f"invalid block record {dict(extra)!r}: replicated is true, without a block")
        return Placement("replicated", tuple(shape), (0,) * len(shape))
    if "global_shape" not in extra and "offset" not in extra:
        return Placement("none")
    g = _record_ints(extra, "global_shape")
    o = _record_ints(extra, "offset")
    if len(g) != len(shape) or len(o) != len(shape) or any(
            oo < 0 or oo + n > gg for gg, oo, n in zip(g, o, shape)):
        raise FormatError(f"block record global_shape={list(g)} offset={list(o)} does not fit a block of shape "
                          f"{list(shape)}")
    return Placement("block", g, o)


def _record_ints(extra: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """``extra[key]`` as ints: a list of JSON ints (never a bool, a float or a str that int() would take, nor a
    number past 2**62: a forged record's, which no array has)."""
    value = extra.get(key)
    if not isinstance(value, list) or any(isinstance(n, bool) or not isinstance(n, int) or abs(n) > 2**62
                                          for n in value):
        raise FormatError(f"invalid block record {dict(extra)!r}: {key} is not a list of ints")
    return tuple(value)


def check_tiling(vid: int, blocks: Mapping[int, tuple[Placement, Sequence[int]]]) -> None:
    """``FormatError`` unless the blocks ``blocks`` (old rank -> (its placement, its block's shape)), each inside its
    global array (:func:`placement`), record one global shape and tile it exactly: no two overlap, none is missing.
    Records that overlap would put one element's bytes from two files (which one depends on the reading order), and
    blocks that leave a hole hold less than the array: both are a damaged or forged checkpoint, never used."""
    shapes = {p.global_shape for p, _s in blocks.values()}
    if len(shapes) != 1:
        raise FormatError(f"variable {vid}: the old ranks record different global shapes {sorted(shapes)}")
    (whole,) = shapes
    boxes = [(old, p.offset, tuple(int(n) for n in s)) for old, (p, s) in sorted(blocks.items()) if math.prod(s)]
    if len(boxes) > 1:  # pairwise, one old block against all the later ones at a time
        lo = np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), -1)
        hi = lo + np.array([b[2] for b in boxes], np.int64).reshape(len(boxes), -1)
        for i in range(len(boxes) - 1):
            hit = np.all((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i]), axis=1)
            if hit.any():
                j = i + 1 + int(np.argmax(hit))
                raise FormatError(f"variable {vid}: the blocks that old ranks {boxes[i][0]} and {boxes[j][0]} record "
                                  f"overlap (offsets {list(boxes[i][1])} and {list(boxes[j][1])}; blocks with halos "
                                  "restart on their own layout only: declare each rank's block without its halo to "
                                  "restart on another)")
    held = sum(math.prod(s) for _o, _off, s in boxes)
    if held != math.prod(whole):
        raise FormatError(f"variable {vid}: the old ranks' blocks hold {held} elements of the global array "
                          f"{list(whole)} ({math.prod(whole)}): they do not tile it")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of a new block held by an old block.

    ``src``: slices in the old block, ``dst``: slices in the new one, ``span``: the byte range
    ``[start, stop)`` of the old block's stream that holds it, ``strides``: the old block's
    byte strides (a view of the span with them, starting at ``first``, is the piece).
    """

    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    span: tuple[int, int]
    first: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def stream_strides(shape: Sequence[int], order: str, itemsize: int) -> tuple[int, ...]:
    """Byte strides of an array of ``shape`` stored contiguously in ``order`` ('C' or 'F')."""
    out = [0] * len(shape)
    step = itemsize
    dims = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for d in dims:
        out[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(out)


def overlap(old_offset: Sequence[int], old_shape: Sequence[int], order: str, itemsize: int,
            new_offset: Sequence[int], new_shape: Sequence[int]) -> Piece | None:
    """The piece of the new block (``new_offset``, ``new_shape``) that the old block holds, or None."""
    lo = [max(a, b) for a, b in zip(old_offset, new_offset)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(old_offset, old_shape, new_offset, new_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    strides = stream_strides(old_shape, order, itemsize)
    first = sum((l - o) * s for l, o, s in zip(lo, old_offset, strides))
    last = sum((h - 1 - o) * s for h, o, s in zip(hi, old_offset, strides))
    return Piece(tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, old_offset)),
                 tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, new_offset)),
                 (first, last + itemsize), first, tuple(h - l for l, h in zip(lo, hi)), strides)


def piece_view(piece: Piece, buf: Any, base: int, dtype: np.dtype) -> np.ndarray:
    """The piece as a strided view of ``buf``, which holds the old stream's bytes from ``base``."""
    return np.ndarray(piece.shape, dtype, buffer=buf, offset=piece.first - base, strides=piece.strides)


def bands(piece: Piece, limit: int) -> list[Piece]:
    """``piece`` cut along its outermost axis in the stream (the largest stride) into pieces whose spans hold about
    ``limit`` bytes or less each (at least one index of that axis a band), in stream order: a strided piece read
    from the stream a band at a time, through a buffer of a band's span, not of the whole piece's."""
    axes = [d for d, n in enumerate(piece.shape) if n > 1]
    if not axes or piece.span[1] - piece.span[0] <= limit:
        return [piece]
    d = max(axes, key=lambda a: piece.strides[a])
    itemsize = piece.span[1] - piece.first - sum((n - 1) * s for n, s in zip(piece.shape, piece.strides))
    step = max(1, limit // piece.strides[d])
    out = []
    for lo in range(0, piece.shape[d], step):
        hi = min(piece.shape[d], lo + step)
        shape = (*piece.shape[:d], hi - lo, *piece.shape[d + 1:])
        first = piece.first + lo * piece.strides[d]
        last = first + sum((n - 1) * s for n, s in zip(shape, piece.strides))

        def cut(slices: tuple[slice, ...], lo: int = lo, hi: int = hi) -> tuple[slice, ...]:
            return (*slices[:d], slice(slices[d].start + lo, slices[d].start + hi), *slices[d + 1:])

        out.append(Piece(cut(piece.src), cut(piece.dst), (first, last + itemsize), first, shape, piece.strides))
    return out
