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

from ..arrays import check_ckpt_id
from ..errors import CheckpointError, ProtectError


@dataclasses.dataclass
class DaskIcp:
    """An open incremental checkpoint: its id and level, and the arrays added so far."""

    ckpt_id: int
    level: int
    arrays: dict[int, Any] = dataclasses.field(default_factory=dict)


def init_icp(ctx: Any, ckpt_id: int, level: int) -> None:
    ctx._check_open()
    if ctx._icp is not None:
        raise CheckpointError(f"incremental checkpoint {ctx._icp.ckpt_id} is still open; finalize it first")
    cid = check_ckpt_id(ckpt_id)
    ctx._check_level(level)  # refuse a bad level now, not at the commit
    ctx._icp = DaskIcp(cid, level)


def _open(ctx: Any) -> DaskIcp:
    ctx._check_open()
    if ctx._icp is None:
        raise CheckpointError("no incremental checkpoint is open; call init_icp(id, level) first")
    return ctx._icp  # type: ignore[no-any-return]


def add_var_icp(ctx: Any, var_id: int) -> None:
    icp = _open(ctx)
    protected = ctx._vars.get(var_id) if isinstance(var_id, int) and not isinstance(var_id, bool) else None
    if protected is None:
        raise ProtectError(f"variable {var_id!r} is not protected; protect it before init_icp")
    arr = protected.array
    icp.arrays[protected.id] = ctx.client.persist(arr) if hasattr(arr, "__dask_graph__") else np.array(arr)


def finalize_icp(ctx: Any) -> Any:
    icp = _open(ctx)
    ctx._icp = None
    missing = sorted(set(ctx._vars) - set(icp.arrays))
    if missing:
        raise CheckpointError(f"incremental checkpoint {icp.ckpt_id} misses protected variables {missing}; "
                              "the previous checkpoint is kept")
    current = {vid: p.array for vid, p in ctx._vars.items()}
    try:
        for vid, arr in icp.arrays.items():
            ctx._vars[vid].array = arr
        return ctx.checkpoint(icp.ckpt_id, icp.level)
    finally:
        for vid, arr in current.items():  # what the application protected stays protected
            ctx._vars[vid].array = arr
