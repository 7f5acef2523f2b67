"""Review 60: the Dask backend's incremental checkpoints refuse what the engine's refuse, in its words: a variable
added twice, a variable whose size changed since init_icp. The checkpoint stays open: the call repeated correctly
commits it."""

from __future__ import annotations

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import CheckpointError

da = pytest.importorskip("dask.array")

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


def _serial_messages(root):
    """The engine's refusals (one process) of the same two calls."""
    ctx = ftidask.init(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=2)
    ctx.protect(1, np.arange(12.0))
    ctx.protect(2, np.arange(6.0))
    ctx.init_icp(1, 1)
    ctx.add_var_icp(1)
    out = []
    for call in (lambda: ctx.add_var_icp(1), lambda: (ctx.protect(2, np.arange(10.0)), ctx.add_var_icp(2))):
        with pytest.raises(CheckpointError) as exc:
            call()
        out.append(str(exc.value))
    ctx.finalize()
    return out


def test_dask_icp_refuses_a_second_add_and_a_size_change(dask_client, dirs, tmp_path):
    twice, resized = _serial_messages(tmp_path / "serial")
    ctx = ftidask.init(client=dask_client, **dirs)
    x, n = da.arange(12.0, chunks=4), np.arange(6.0)
    ctx.protect(1, x)
    ctx.protect(2, n)
    ctx.init_icp(1, 1)
    ctx.add_var_icp(1)
    with pytest.raises(CheckpointError) as exc:
        ctx.add_var_icp(1)
    assert str(exc.value) == twice == "variable 1 was already added to checkpoint 1"
    ctx.protect(2, np.arange(10.0))
    with pytest.raises(CheckpointError) as exc:
        ctx.add_var_icp(2)
    assert str(exc.value) == resized
    assert "has 80 bytes, 48 when checkpoint 1 started; its size must not change" in resized
    ctx.protect(2, n)  # as it was: the checkpoint is still open, the add is repeated
    ctx.add_var_icp(2)
    info = ctx.finalize_icp()
    assert info.id == 1 and ctx.stored_size(1) == 96 and ctx.stored_size(2) == 48
    ctx.finalize()
