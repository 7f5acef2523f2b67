"""Dask backend: a restart that protects as a Dask array what was checkpointed as a NumPy array, and a Client made
with ``asynchronous=True``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = pytest.mark.dask


def test_a_numpy_variable_protected_as_a_dask_array_at_the_restart_is_rebound(dask_client, dirs):
    """Before: recover() returned the values but the context kept the stale Dask array (zeros), which the next
    checkpoint committed without a word."""
    a = np.arange(60.0).reshape(6, 10)
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, a, name="a")
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    held = da.zeros((6, 10), chunks=(3, 4))
    ctx.protect(1, held)
    out = ctx.recover()[1]
    assert ctx.protected[1] is out and out.chunks == held.chunks
    assert out.compute().tobytes() == a.tobytes()
    ctx.checkpoint(2, 1)
    ctx._close()
    ctx = ftidask.init(client=dask_client, **dirs)
    assert np.asarray(ctx.recover()[1]).tobytes() == a.tobytes()
    ctx.finalize()


def test_an_asynchronous_client_is_refused_at_init(dask_client, dirs):
    """Before: a raw TypeError ('coroutine' object is not subscriptable) from deep inside init, after the fence
    take-over and the garbage collection were skipped (their coroutines never awaited)."""
    async def main() -> str:
        client = await distributed.Client(dask_client.scheduler.address, asynchronous=True)
        try:
            with pytest.raises(ftidask.FTIError, match="must be a synchronous distributed.Client") as refused:
                ftidask.init(client=client, **dirs)
            return str(refused.value)
        finally:
            await client.close()

    assert "run_in_executor" in asyncio.run(main())
