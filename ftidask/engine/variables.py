"""The protected variables of a context: each one's array (or Python state) and what is recorded with it.

Shared by the context that registers them (:meth:`ftidask.Context.protect`), the writer that
checkpoints them (:mod:`ftidask.engine.writing`) and recovery, which fills them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..ftiff import compression
from ..model.arrays import check_protectable
from ..model.decomposition import declaration, still_fits
from ..model.errors import FTIError, ProtectError
from . import device as device_vars
from . import pystate


@dataclasses.dataclass
class Protected:
    """One protected variable."""

    id: int
    name: str
    array: np.ndarray
    compressor: dict[str, Any] | None = None  # numcodecs config; None: the config's [advanced] compressor
    decomp: dict[str, Any] | None = None  # its place in a global array (model.decomposition), for resharding
    state: pystate.Holder | None = None  # a Python state (ftidask.engine.pystate): ``array`` holds its bytes
    # a CuPy array (ftidask.engine.device): ``array`` is its host mirror. A snapshot's frozen copy keeps the device's
    # name (a str: the mirror holds the call's bytes), or the DeviceCopy of the call that its job downloads first;
    # never the live array, whose later values the background would write.
    device: device_vars.DeviceHolder | str | None = None


def protected_var(vid: int, array: Any, name: str | None, compressor: Any, old: Protected | None, *,
                  global_shape: Any, offset: Any, replicated: bool) -> Protected:
    """Variable ``vid`` as :meth:`ftidask.Context.protect` registers it (``old``: its previous registration)."""
    check_name(name)
    state = pystate.holder_of(array)  # a Python state (stored as JSON bytes), or None for an array
    device = None if state is not None else device_vars.holder_of(array, old.device if old is not None else None)
    array = state.encode() if state is not None else check_protectable(device.mirror if device else array)
    if name is None:
        name = old.name if old is not None else f"var{vid}"
    codec = compressor_config(compressor, old)
    if state is not None and (global_shape is not None or offset is not None):
        raise ProtectError(f"variable {vid}: a Python state takes no global_shape or offset (it is recovered whole: "
                           "on the checkpoint's number of ranks, or on any with replicated=True)")
    decomp = declaration(array, global_shape, offset, replicated)
    if decomp is None and old is not None and global_shape is None and not replicated:
        decomp = still_fits(array, old.decomp)  # protect again (or realloc): the declaration stays if it fits
    return Protected(vid, str(name), array, codec, decomp=decomp, state=state, device=device)


def check_name(name: Any, vid: int | None = None, variables: Mapping[int, Any] | None = None,
               given: int | None = None) -> None:
    """Refuse a variable name that is not a str: 123 or b"x" would be stored as another name than the one given,
    which var_id and the Zarr export then do not find; an empty one (var_id refuses it); and one that names another
    variable: protected under it (``variables``), or given to another id by var_id (``given``), var_id would find
    one of the two."""
    if name is not None and not isinstance(name, str):
        raise ProtectError(f"protect(..., name=...) takes a str, got {type(name).__name__} {name!r}")
    if name == "":
        raise ProtectError("protect(..., name=...) takes a non-empty str (or None: the variable is named var{id})")
    if name is None:  # the default, var{id}: nothing to look for (a scan per protect made n of them quadratic)
        return
    indexed = getattr(variables, "other_named", None)  # the context's VarTable: a scan per name made n of them O(n^2)
    other = indexed(name, vid) if indexed is not None else next(
        (v for v, p in (variables or {}).items() if v != vid and p.name == name), None)
    if other is None and given is not None and given != vid:
        other = given
    if other is not None:
        raise ProtectError(f"protect({vid}, ..., name={name!r}): the name is variable {other}'s; a name names one "
                           "variable (var_id finds it): give this one another name")


def compressor_config(compressor: Any, old: Protected | None) -> dict[str, Any] | None:
    """The numcodecs config a variable protected with ``compressor`` keeps (``old``: its previous registration,
    whose choice stays when none is given); ``{"id": "none"}`` for an explicit no, None for the config's."""
    if compressor is None:
        return old.compressor if old is not None else None
    return compression.parse_compressor(compressor) or {"id": "none"}


def encode_states(variables: Mapping[int, Protected], rank: int, dcp: bool = False,
                  skip: Mapping[int, Any] = ()) -> str:
    """Store each protected Python state's current value as its bytes, and bring each device array's into its
    mirror (``dcp``: only its changed pages written; ``skip``: ids whose bytes an asynchronous checkpoint copied
    on the device); why one cannot be, or ''."""
    for p in variables.values():
        if isinstance(p.device, device_vars.DeviceHolder) and p.id not in skip:
            problem = download(p, rank, dcp)
            if problem:
                return problem
        if p.state is not None:
            try:
                p.array = p.state.encode()
            except FTIError as exc:  # reported on every rank by the commit, nothing written
                return f"rank {rank}: variable {p.id} ({p.name}): {exc}"
    return ""


def user_array(p: Protected) -> Any:
    """The array the application protected: a CuPy array itself, not its mirror."""
    return p.device.obj if isinstance(p.device, device_vars.DeviceHolder) else p.array


def download(p: Protected, rank: int, dcp: bool = False) -> str:
    """Bring device variable ``p``'s bytes into its mirror; why that failed (a CUDA error), or ''."""
    try:
        p.device.download(compare=dcp)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001 - CUDA's errors have no common base: reported on every rank
        return f"rank {rank}: variable {p.id} ({p.name}) on {p.device}: copying it from the device failed: {exc}"
    return ""


def var_extras(variables: Mapping[int, Protected]) -> dict[int, dict[str, Any]]:
    """What the variable table records beyond the array: a Python state's kind, a block's place
    in a global array (resharding)."""
    out: dict[int, dict[str, Any]] = {}
    for vid, p in variables.items():
        if p.decomp is None and p.state is None and p.device is None:  # a plain array (most): no dict made for it
            continue
        extra = dict(p.decomp or {})
        if p.state is not None:
            extra[pystate.EXTRA_KEY] = p.state.kind
        if p.device is not None:
            extra[device_vars.EXTRA_KEY] = str(p.device)
        if extra:
            out[vid] = extra
    return out


def declared(variables: Mapping[int, Protected]) -> dict[str, list[Any]]:
    """This rank's declared global arrays, ``{id: [global_shape or "replicated", dtype]}`` (JSON): what every rank
    that declares the same id must declare alike (:func:`declarations_problem`)."""
    return {str(vid): [p.decomp.get("global_shape", "replicated"), np.dtype(p.array.dtype).str]
            for vid, p in variables.items() if p.decomp}


def declarations_problem(per_rank: list[dict[str, list[Any]]]) -> str:
    """Why the ranks' declarations (:func:`declared`, by rank) cannot make one global array per id, or "". A rank
    declaring another global shape or dtype would commit a checkpoint no restart on another layout can redistribute
    (nor one on this layout load), retiring the last good one: refused before anything is written."""
    seen: dict[str, dict[str, list[int]]] = {}
    for rank, mine in enumerate(per_rank):
        for vid, decl in (mine or {}).items():
            seen.setdefault(vid, {}).setdefault(repr(decl), []).append(rank)
    for vid, kinds in sorted(seen.items(), key=lambda kv: int(kv[0])):
        if len(kinds) > 1:
            said = "; ".join(f"rank(s) {ranks[:8]}{'...' if len(ranks) > 8 else ''}: {decl}"
                             for decl, ranks in kinds.items())
            return (f"variable {vid} is declared as different global arrays (global shape or replicated, dtype) by "
                    f"the ranks: {said}")
    return ""


def undeclared_problem(variables: Mapping[int, Protected], per_rank: list[dict[str, list[Any]]], rank: int) -> str:
    """Why this rank's checkpoint would hold, undeclared, a variable other ranks declare as (a block of) a global
    array (:func:`declared`, by rank), or "": no restart on another layout could place its data (and the mix would be
    read as damage there). Local: each rank checks its own variables against every rank's declarations."""
    ids = {int(vid) for mine in per_rank for vid in (mine or {})}
    mixed = sorted(vid for vid in ids if vid in variables and not variables[vid].decomp)
    if not mixed:
        return ""
    by = {vid: [r for r, mine in enumerate(per_rank) if str(vid) in (mine or {})] for vid in mixed[:4]}
    return (f"rank {rank} protects, without a decomposition, variable(s) other ranks declare: "
            + "; ".join(f"variable {vid} (declared by rank(s) {ranks[:8]})" for vid, ranks in by.items())
            + ". Declare each on every rank that protects it (global_shape=..., offset=..., or replicated=True)")

