"""The plan of a redistribution (:mod:`ftidask.engine.reshard`): which old file holds which piece of which of this
rank's arrays, from the old files' variable tables. Pure (no I/O); the same tables give every rank the same verdict.

Two kinds of refusal: :class:`~ftidask.engine.reshard_dask.Refused` when this run's declarations do not fit the
checkpoint (an older checkpoint would not fit either), ``FormatError`` when the old records cannot be right (a
forged or damaged table: an older checkpoint may be recovered).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..model.decomposition import Piece, Placement, check_tiling, overlap, placement
from ..model.errors import FormatError
from . import reshard_dask
from .reshard_files import stored_dtype

_Refused = reshard_dask.Refused


def plan(tables: dict[int, dict[str, Any]], arrays: dict[int, np.ndarray], decls: dict[int, Any],
          rank: int, n: int, m: int) -> dict[int, list[tuple[int, Piece]]]:
    """old rank -> [(var id, piece)]: the pieces of this rank's arrays each old file holds."""
    plan: dict[int, list[Any]] = {}
    for vid, array in arrays.items():
        decl = decls.get(vid) or {}
        new = placement(decl, array.shape)
        entries = {old: tables.get(old, {}).get(str(vid)) for old in range(n)}
        if reshard_dask.holds_chunks(entries):
            _dask_plan(vid, entries, array, new, plan)
            continue
        if n == m and (new.kind == "none" or new.kind == "replicated" and _undeclared(entries[rank])):
            # rank r gets old rank r's array, whatever the others recorded (declared replicated on one side only:
            # loaded as it is, as on the same layout; a loop's counter of a checkpoint written before it was)
            place, shape, order = _own(vid, entries[rank], rank, array)  # (undeclared: per-rank data, any dtype)
            piece = overlap(place.offset, shape, order, array.dtype.itemsize, place.offset, array.shape)
            _add(plan, vid, array, place, [(rank, piece)] if piece is not None else [])
            continue
        missing = [old for old, e in entries.items() if e is None]
        if missing:  # declared blocks that old ranks of the others hold whole, or a replicated array, still come back
            entries = _held_by_some(vid, entries, missing)
        olds = old_blocks(vid, entries)
        dtype = stored_dtype(next(iter(entries.values()))["dtype"])  # structured dtypes are recorded as JSON objects
        if dtype != array.dtype:
            raise _Refused(f"variable {vid}: the checkpoint holds {dtype}, the protected array is {array.dtype}")
        kinds = {p.kind for p, _s, _o in olds.values()}
        if new.kind == "none" and m == 1 and n > 1 and len(kinds) == 1 and kinds != {"none"}:
            new = _whole(vid, olds, next(iter(kinds)), array)  # one process, an undeclared array: the whole one
        if new.kind == "none":  # (the same number of ranks: above)
            raise _Refused(f"variable {vid} declares no decomposition")
        if kinds != {new.kind}:
            raise _Refused(f"variable {vid} is declared {new.kind} here, the checkpoint records it as "
                           f"{' / '.join(sorted(kinds))}")
        elif new.kind == "replicated":
            keep = sorted(olds)[rank % len(olds)]  # spread the reads over the old files
            place, shape, order = olds[keep]
            if shape != tuple(array.shape):
                raise _Refused(f"variable {vid} (replicated): the checkpoint holds shape {shape}, the protected "
                               f"array is {tuple(array.shape)}")
            sources = {keep: olds[keep]}
        else:
            shapes = {p.global_shape for p, _s, _o in olds.values()}
            if shapes != {new.global_shape}:
                raise _Refused(f"variable {vid}: global shape {new.global_shape} here, {min(shapes)} in the "
                               "checkpoint")
            sources = olds
        found = [(old, overlap(place.offset, shape, order, array.dtype.itemsize, new.offset, array.shape))
                 for old, (place, shape, order) in sources.items()]
        _add(plan, vid, array, new, [(old, piece) for old, piece in found if piece is not None])
    return plan


def _undeclared(entry: Any) -> bool:
    """Whether an old rank's record holds an undeclared variable (a malformed one is left to :func:`_own`)."""
    extra = entry.get("extra") if isinstance(entry, dict) else None
    return isinstance(extra, dict) and not {"global_shape", "offset", "replicated"} & set(extra)


def _own(vid: int, entry: Any, rank: int, array: np.ndarray) -> tuple[Placement, tuple[int, ...], str]:
    """Old rank ``rank``'s record of variable ``vid``, placed as this rank's whole array (an undeclared array on
    the same number of ranks); :class:`_Refused` when it is not there or does not fit ``array``."""
    if entry is None:
        raise _Refused(f"variable {vid} is not in the checkpoint file of old rank {rank}, and it declares no "
                       "decomposition")
    try:
        placement(entry["extra"], entry["shape"])  # a malformed record is damage (FormatError), as below
        shape, order, dtype = tuple(entry["shape"]), entry["order"], stored_dtype(entry["dtype"])
    except FormatError as exc:
        raise FormatError(f"variable {vid}, old rank {rank}: {exc}") from None
    if dtype is None:
        raise FormatError(f"variable {vid}: old rank {rank} records the dtype {entry['dtype']!r}")
    if dtype != array.dtype:
        raise _Refused(f"variable {vid}: the checkpoint holds {dtype}, the protected array is {array.dtype}")
    if shape != tuple(array.shape):
        raise _Refused(f"variable {vid}: old rank {rank} holds shape {shape}, the protected array is "
                       f"{tuple(array.shape)}")
    return Placement("block", shape, (0,) * len(shape)), shape, order


def _held_by_some(vid: int, entries: dict[int, Any], missing: list[int]) -> dict[int, Any]:
    """The entries of the old ranks that hold variable ``vid`` when the others do not (they protected other
    variables): enough when its blocks tile its global array, or it is replicated; else :class:`_Refused`."""
    present = {old: e for old, e in entries.items() if e is not None}
    why = f"variable {vid} is not in the checkpoint file(s) of old rank(s) {missing[:8]}"
    if not present:
        raise _Refused(why)
    try:
        kinds = {p.kind for p, _s, _o in old_blocks(vid, present).values()}  # the tiling of the blocks held
    except FormatError as exc:
        raise _Refused(f"{why}, and those of the others do not make it whole: {exc}") from None
    if kinds == {"none"}:
        raise _Refused(f"{why}, and it declares no decomposition")
    return present


def old_blocks(vid: int, entries: dict[int, Any]) -> dict[int, tuple[Placement, tuple[int, ...], str]]:
    """Each old rank's placement, block shape and order of variable ``vid`` (``entries``: its table entries, by old
    rank). FormatError (damage: an older checkpoint may be recovered) when the records cannot be right: a malformed
    dtype or block record, old ranks that disagree on the dtype or on the kind, replicated arrays of several shapes,
    blocks that overlap or leave a hole in their global array (:func:`check_tiling`)."""
    olds = {}
    for old, e in entries.items():
        try:
            olds[old] = (placement(e["extra"], e["shape"]), tuple(e["shape"]), e["order"])
        except FormatError as exc:
            raise FormatError(f"variable {vid}, old rank {old}: {exc}") from None
    dtypes = {json.dumps(e["dtype"], sort_keys=True) for e in entries.values()}
    if len(dtypes) != 1 or stored_dtype(next(iter(entries.values()))["dtype"]) is None:
        raise FormatError(f"variable {vid}: the old ranks record the dtypes {sorted(dtypes)[:4]}")
    kinds = {p.kind for p, _s, _o in olds.values()}
    if len(kinds) != 1:
        raise FormatError(f"variable {vid}: the old ranks record it as {' / '.join(sorted(kinds))}")
    if kinds == {"block"}:
        check_tiling(vid, {old: (p, shape) for old, (p, shape, _o) in olds.items()})
    elif kinds == {"replicated"} and len({shape for _p, shape, _o in olds.values()}) != 1:
        raise FormatError(f"variable {vid}: the old ranks record replicated arrays of different shapes")
    return olds


def _whole(vid: int, olds: dict[int, Any], kind: str, array: np.ndarray) -> Placement:
    """The declaration of an undeclared array of one process that restarts a checkpoint of several ranks: the
    whole global array (of blocks) or the replicated array, when its shape is theirs (else :class:`_Refused`)."""
    shapes = {p.global_shape if kind == "block" else shape for p, shape, _o in olds.values()}
    if shapes != {tuple(array.shape)}:
        raise _Refused(f"variable {vid}: the checkpoint holds a {'global' if kind == 'block' else 'replicated'} array "
                       f"of shape {min(shapes)}, the protected array is {tuple(array.shape)} (protect the whole array, "
                       "or declare its block: global_shape=..., offset=...)")
    return Placement(kind, tuple(array.shape), (0,) * array.ndim)


def _dask_plan(vid: int, entries: dict[int, Any], array: np.ndarray, new: Placement,
               plan: dict[int, list[Any]]) -> None:
    """A Dask checkpoint's variable (:mod:`.reshard_dask`): the chunks that overlap this rank's block."""
    bad = next((e["dtype"] for e in entries.values() if e is not None and stored_dtype(e["dtype"]) != array.dtype),
               None)
    if bad is not None or all(e is None for e in entries.values()):
        raise _Refused(f"variable {vid}: the checkpoint holds {stored_dtype(bad) or bad}, the protected array is "
                       f"{array.dtype}")
    new, found = reshard_dask.pieces(vid, entries, array, new, array.dtype)
    _add(plan, vid, array, new, found)


def _add(plan: dict[int, list[Any]], vid: int, array: np.ndarray, new: Placement,
         found: list[tuple[int, Piece]]) -> None:
    """Plan ``found`` (old rank, piece) for variable ``vid``; :class:`_Refused` when they leave an element unfilled."""
    mask = np.zeros(array.shape, bool)
    for old, piece in found:
        plan.setdefault(old, []).append((vid, piece))
        mask[piece.dst] = True
    if not mask.all():
        hole = tuple(int(i[0]) + o for i, o in zip(np.nonzero(~mask), new.offset))
        raise _Refused(f"variable {vid}: no old file holds element {hole} of the global array {new.global_shape}")
