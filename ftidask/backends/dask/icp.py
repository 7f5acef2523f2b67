"""Incremental checkpoints (InitICP / AddVarICP / FinalizeICP) on a Dask cluster.

Dask arrays are immutable values, so a variable is "done" when its array is: ``add_var_icp``
pins the protected array as it is now (persisted on the workers, which starts computing its
chunks; a NumPy variable is copied, since the application may change it right after), and
``finalize_icp`` has the workers write every pinned array as one checkpoint, committed as any
other. A checkpoint that misses a protected variable is refused and the previous one stays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...engine.icp import check_activate, protected_var
from ...engine.variables import encode_states
from ...model.arrays import check_ckpt_id
from ...model.errors import CheckpointError


@dataclasses.dataclass
class DaskIcp:
    """An open incremental checkpoint: its id and level, each variable's bytes when it opened, and the arrays
    added so far."""

    ckpt_id: int
    level: int
    arrays: dict[int, Any] = dataclasses.field(default_factory=dict)
    sizes: dict[int, int] = dataclasses.field(default_factory=dict)  # var id -> bytes at init_icp


def init_icp(ctx: Any, ckpt_id: int, level: int, activate: bool = True) -> None:
    """``Context.init_icp`` on Dask: open incremental checkpoint ``ckpt_id`` at ``level`` (FTI_InitICP)."""
    ctx._check_open()
    ctx._icp_slot.check_none_open()
    cid = check_ckpt_id(ckpt_id)
    parsed = ctx._check_level(level)  # refuse a bad level now, not at the commit
    check_activate(activate)
    if not activate:  # FTI's loops call the three at every iteration: add and finalize do nothing
        ctx._icp_slot.skip()
        return
    ctx._icp_slot.inactive = False
    if not parsed.differential and ctx._writer.codecs():
        # The engine's rule, on every backend alike (its incremental files are streamed, never compressed):
        # a program that runs here runs on MPI too.
        raise CheckpointError(f"incremental checkpoint {cid}: incremental checkpoints are written uncompressed "
                              "as FTI-FF files: set compressor = none (or protect with compressor='none'), "
                              "or use levels 5-8; the previous checkpoint is kept")
    # Python states are taken when the checkpoint begins (as on MPI)
    error = encode_states(ctx.variables, ctx.transport.rank)
    if error:
        raise CheckpointError(f"incremental checkpoint {cid}: {error}; the previous checkpoint is kept")
    ctx._icp_slot.current = DaskIcp(cid, level, sizes={vid: p.array.nbytes for vid, p in ctx.variables.items()})


def add_var_icp(ctx: Any, var_id: int) -> None:
    """``Context.add_var_icp`` on Dask: take variable ``var_id``'s values now (persisted: the array may change), for
    the checkpoint :func:`finalize_icp` writes."""
    ctx._check_open()
    if ctx._icp_slot.skipping():
        return
    icp: DaskIcp = ctx._icp_slot.get()
    arr = protected_var(ctx.variables, var_id).array
    vid = int(var_id)
    # The engine's rules (ftidask.engine.pending), in its words: a wrong call is refused, the checkpoint stays open.
    if vid in icp.arrays:
        raise CheckpointError(f"variable {vid} was already added to checkpoint {icp.ckpt_id}")
    if vid in icp.sizes and icp.sizes[vid] != arr.nbytes:
        raise CheckpointError(f"variable {vid} has {arr.nbytes} bytes, {icp.sizes[vid]} when checkpoint "
                              f"{icp.ckpt_id} started; its size must not change in between")
    icp.arrays[vid] = ctx.client.persist(arr) if hasattr(arr, "__dask_graph__") else np.array(arr)


def finalize_icp(ctx: Any) -> Any:
    """``Context.finalize_icp`` on Dask: write the values :func:`add_var_icp` took as one checkpoint (every protected
    variable must have been added); its info, or None when the checkpoint was not activated."""
    ctx._check_open()
    if ctx._icp_slot.skipping():
        ctx._icp_slot.inactive = False
        return None
    icp: DaskIcp = ctx._icp_slot.get()
    ctx._icp_slot.take()
    missing = sorted(set(ctx.variables) - set(icp.arrays))
    if missing:
        raise CheckpointError(f"incremental checkpoint {icp.ckpt_id} misses protected variables {missing}; "
                              "the previous checkpoint is kept")
    current = {vid: p.array for vid, p in ctx.variables.items()}
    try:
        for vid, arr in icp.arrays.items():
            ctx.variables[vid].array = arr
        ctx._keep_state_bytes = True  # the states as init_icp took them
        with ctx._calls.nested("checkpoint"):  # finalize_icp's own checkpoint
            return ctx.checkpoint(icp.ckpt_id, icp.level)
    finally:
        ctx._keep_state_bytes = False
        for vid, arr in current.items():  # what the application protected stays protected
            ctx.variables[vid].array = arr
