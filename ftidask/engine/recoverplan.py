"""What one recovery fills: every protected variable, or only those listed (FTI_RecoverVar), with
the Python states (:mod:`ftidask.engine.pystate`) read and decoded before the first array is touched.

Used by the serial and MPI backends (``Context.recover`` and ``recover_file``); every check
happens before any byte reaches a user array or object, so a refused recovery leaves all as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..model.arrays import check_id
from ..model.errors import FTIError, ProtectError, RecoveryError
from .device import DeviceHolder, realloc_target
from .pystate import Holder, kind_of
from .recovery import check_sizes, load_file


def normalize_request(ckpt_id: Any, level: Any, ids: Any) -> tuple[int | None, int | None, list[int] | None]:
    """``recover(ckpt_id, level, ids=...)``'s arguments checked: a checkpoint id, a level 1-8 (or None for
    any), and :func:`normalize_ids`; a :class:`RecoveryError` naming the argument otherwise (a str "2" would
    name no checkpoint, and the recovery would say that none exists)."""
    try:
        checked = None if ckpt_id is None else check_id(ckpt_id, "recover(ckpt_id=...): a checkpoint id")
    except ProtectError as exc:
        raise RecoveryError(str(exc)) from None
    if level is not None and (isinstance(level, bool) or not isinstance(level, (int, np.integer))
                              or not 1 <= int(level) <= 8):
        raise RecoveryError(f"recover(level=...) takes a checkpoint level 1-8 (or None for any), got {level!r}")
    return checked, None if level is None else int(level), normalize_ids(ids)


def var_id_of(value: Any, call: str) -> int:
    """``value`` as the variable id of ``call`` (e.g. ``recover_var(...)``), or a :class:`RecoveryError` naming it."""
    try:
        return check_id(value, "variable id")
    except ProtectError as exc:
        raise RecoveryError(f"{call}: {exc}") from None


def normalize_ids(ids: Any) -> list[int] | None:
    """``ids`` of ``recover(ids=...)`` as a list of variable ids (None: every protected variable)."""
    if ids is None:
        return None
    if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
        ids = [ids]
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RecoveryError(f"recover(ids=...) takes a list of variable ids, got {ids!r}")
    try:
        out = list(dict.fromkeys(check_id(i, "variable id") for i in ids))
    except ProtectError as exc:
        raise RecoveryError(f"recover(ids=...): {exc}") from None
    if not out:
        raise RecoveryError("recover(ids=[]) names no variable; pass the ids to recover, or ids=None for all")
    return out


@dataclasses.dataclass
class RecoveryPlan:
    """The targets of one recovery from one verified file; ``problem`` says why it is refused ('' if not)."""

    parsed: Any
    arrays: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    states: dict[int, tuple[Holder, np.ndarray]] = dataclasses.field(default_factory=dict)
    contents: dict[int, Any] = dataclasses.field(default_factory=dict)
    problem: str = ""
    moved: str = ""  # a declared block that the file records elsewhere ('' if none): redistributed, not loaded as it is
    devices: dict[int, DeviceHolder] = dataclasses.field(default_factory=dict)  # CuPy arrays: their mirrors filled

    def load_states(self) -> str:
        """Read and decode the Python states (nothing of the user's is touched); an error message or ''."""
        if not self.states:
            return ""
        try:
            load_file(self.parsed, {vid: buf for vid, (_h, buf) in self.states.items()})
            for vid, (holder, buf) in self.states.items():
                self.contents[vid] = holder.decode(buf, f"variable {vid} ({holder.describe()})")
        except (FTIError, OSError) as exc:
            return f"cannot read the Python state in {self.parsed.path}: {exc}"
        return ""

    def apply_states(self) -> None:
        """Set every decoded state into its protected object, and upload every device array's mirror (after the
        arrays were filled)."""
        for vid, (holder, _buf) in self.states.items():
            holder.apply(self.contents[vid])
        upload(self.devices)

    def recovered(self) -> dict[int, Any]:
        """What ``recover`` returns: the arrays filled (a CuPy array, not its mirror), the state objects updated."""
        return {**self.arrays, **{vid: d.obj for vid, d in self.devices.items()},
                **{vid: holder.obj for vid, (holder, _b) in self.states.items()}}


def upload(devices: Mapping[int, DeviceHolder]) -> None:
    """Put each recovered mirror's bytes into its CuPy array; a CUDA error (the device gone) said as such."""
    for vid, holder in devices.items():
        try:
            holder.upload()
        except Exception as exc:  # noqa: BLE001 - CUDA's errors have no common base
            raise RecoveryError(f"variable {vid} was recovered into its host copy, but putting it back on {holder} "
                                f"failed: {exc}") from None


def handed_back(vid: int, p: Any, ckpt_id: int) -> Any:
    """What a recovery of checkpoint ``ckpt_id`` hands back for variable ``vid`` (a Protected) once its host array is
    filled: the CuPy array, its mirror's bytes uploaded (:func:`upload`), for a variable that lives on a device; else
    the host array. Variables are filled one after the other: a failed upload may follow filled ones."""
    if isinstance(getattr(p, "device", None), DeviceHolder):
        try:
            upload({vid: p.device})
        except RecoveryError as exc:
            raise RecoveryError(f"recovering checkpoint {ckpt_id} failed while loading, and the protected arrays may "
                                f"hold part of it: recover again ({exc})") from None
        return p.device.obj
    return p.array


NOTHING_PROTECTED = ("no variable is protected: protect the arrays (and Python states) to fill before recover(), "
                     "as FTI_Recover requires")


def plan(protected: Mapping[int, Any], parsed: Any, ids: list[int] | None) -> RecoveryPlan:
    """Targets for ``ids`` (None: every protected variable) of ``protected`` (id -> Protected)."""
    out = RecoveryPlan(parsed)
    sizes = parsed.var_nbytes()
    if ids is None and not protected and sizes:  # before: {} returned, status 0, and the next checkpoint lost it
        out.problem = f"checkpoint file {parsed.path} holds variables {sorted(sizes)}, and {NOTHING_PROTECTED}"
        return out
    for vid in (list(protected) if ids is None else ids):
        p = protected.get(vid)
        if p is None:
            out.problem = (f"variable {vid} is not protected: protect it (an array or a Python state) before "
                           "recovering it")  # (recover(ids=...) or recover_var: said of either)
            return out
        if vid not in sizes:
            out.problem = (f"variable {vid} is {'asked for' if ids is not None else 'protected'} but not in "
                           f"checkpoint file {parsed.path} (it holds ids {sorted(sizes)}); nothing was recovered")
            return out
        stored = kind_of(parsed.vars.get(vid))
        holder = getattr(p, "state", None)
        if holder is None and stored:
            out.problem = (f"variable {vid}: the checkpoint holds a Python state ({stored}), the protected "
                           "variable is an array; protect what was protected then (ftidask.State, ftidask.Value "
                           "or a numpy.random Generator)")
            return out
        if holder is not None:
            if stored != holder.kind:
                out.problem = (f"variable {vid}: the protected {holder.describe()} is a Python state "
                               f"({holder.kind}), the checkpoint holds {stored or 'an array'}; protect an array "
                               "there, or recover from a checkpoint written with the state")
                return out
            out.states[vid] = (holder, np.empty(sizes[vid], np.uint8))
        else:
            out.arrays[vid] = p.array
            out.moved = out.moved or moved(vid, getattr(p, "decomp", None), parsed)
            if isinstance(getattr(p, "device", None), DeviceHolder):
                out.devices[vid] = p.device
                p.device.mirror_written()  # before any byte of the recovery reaches it
    out.problem = check_sizes(parsed, out.arrays)
    return out


def realloc_array(parsed: Any, vid: int, array: Any, variables: Mapping[int, Any]) -> Any:
    """:meth:`ftidask.Context.realloc`'s new array for variable ``vid`` of ``parsed`` (the checkpoint to recover):
    of its stored shape and dtype (``array``, else the protected array, itself where it already fits), on the device
    where ``array`` is a CuPy array or the variable lives on one."""
    info = parsed.vars.get(vid)
    if kind_of(info):  # a state protected now returned itself before this; an array here could not recover it
        raise RecoveryError(f"realloc({vid}): the checkpoint holds a Python state ({kind_of(info)}); protect what was "
                            "protected then (ftidask.State, ftidask.Value or a numpy.random Generator): realloc "
                            "returns it, and recover() fills it")
    if info is not None:
        new = info.empty()
    else:
        nbytes = parsed.var_nbytes().get(vid)
        if nbytes is None:
            raise RecoveryError(f"variable {vid} is not in the checkpoint")
        dtype = (np.dtype(array.dtype) if array is not None else  # a NumPy or CuPy array
                 variables[vid].array.dtype if vid in variables else np.dtype(np.uint8))
        if nbytes % dtype.itemsize:
            raise RecoveryError(f"variable {vid}: {nbytes} stored bytes are not a whole number of {dtype}")
        new = np.empty(nbytes // dtype.itemsize, dtype)
    # Without ``array``, the protected host array where it fits: its values kept (after a recovery, a fresh
    # array in its place left the program the stored values' garbage in hand)
    held = variables[vid].array if array is None and vid in variables and variables[vid].device is None else None
    fit = array if array is not None else held
    # A file of bytes only (FTI's POSIX or MPI-IO I/O, no shape): the array of its dtype and byte size fits as it is
    same = fit.shape == new.shape or (info is None and fit.nbytes == new.nbytes) if fit is not None else False
    if isinstance(fit, np.ndarray) and fit.dtype == new.dtype and same:
        new = fit
    return realloc_target(new, array, variables[vid].device if vid in variables else None)


def moved(vid: int, decl: Mapping[str, Any] | None, parsed: Any) -> str:
    """Why variable ``vid``, declared ``decl`` here, is not where the checkpoint's file records it ('' when it is,
    or when either side declares nothing: rank r then gets old rank r's array, as FTI does).

    The same number of ranks on the same nodes need not mean the same blocks: loading old rank r's block into a
    rank that declares another one would put the data at the wrong place of the global array."""
    if not decl:  # declared nothing here (most variables): nothing to compare
        return ""
    info = getattr(parsed, "vars", {}).get(vid)
    if info is not None and "dask" in info.extra:  # a Dask worker's chunks, never a block
        return f"variable {vid} is declared {dict(decl)} here, the checkpoint's file holds chunks of a Dask array"
    stored = {k: info.extra[k] for k in ("global_shape", "offset", "replicated") if k in info.extra} if info else {}
    if not stored:
        return ""
    here = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in decl.items()}
    there = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in stored.items()}
    return "" if here == there else f"variable {vid} is declared {here} here, the checkpoint's file records {there}"
