"""Misuse on the Dask backend (a LocalCluster of 2 worker processes): a closed client, Dask collections that are
not arrays, chunks and recover arguments that name nothing: a clear ftidask error at the call, and the previous
checkpoint stays recoverable."""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import ftidask  # noqa: E402
from ftidask import FTIError, NoCheckpointError, ProtectError, RecoveryError  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 2


def _checkpointed_then_client_closed(dask_client, dirs):
    """A context on a client of its own, checkpoint 1 of a Dask array committed, then that client closed."""
    own = distributed.Client(dask_client.scheduler.address, set_as_default=False)
    ctx = ftidask.init(**dirs, client=own)
    x = da.arange(12.0, chunks=4)
    ctx.protect(1, x)
    ctx.checkpoint(1, 1)
    own.close()
    return own, ctx, x


def test_a_closed_client_is_a_clear_error_and_the_run_restarts(dask_client, dirs) -> None:
    own, ctx, x = _checkpointed_then_client_closed(dask_client, dirs)
    # Before: AttributeError: 'NoneType' object has no attribute 'identity' (deep in distributed).
    for call in (lambda: ctx.checkpoint(2, 1), ctx.recover, lambda: ctx.stored_size(1), ctx.finalize):
        with pytest.raises(FTIError, match="the Dask client is closed"):
            call()
    with pytest.raises(FTIError, match="the Dask client is closed"):
        ftidask.init(**dirs, client=own)
    with ftidask.init(**dirs, client=dask_client) as again:  # finalize removed nothing: checkpoint 1 is there
        assert again.status() == 1
        got = again.recover()[1]
        assert again.recovered_from == (1, 1) and (got.compute() == np.arange(12.0)).all()


def _bag():
    import dask.bag

    return dask.bag.from_sequence([1])


@pytest.mark.parametrize("make", [lambda: dask.delayed(np.zeros)(3), _bag])
def test_dask_collections_that_are_not_arrays_are_refused(dask_client, dirs, make) -> None:
    with ftidask.init(**dirs, client=dask_client) as ctx:
        # Before: a Delayed answers every attribute, was taken for an array: TypeError "Cannot interpret ..."
        with pytest.raises(ProtectError, match=r"protect takes Dask arrays \(dask.array.Array\), got (Delayed|Bag)"):
            ctx.protect(1, make())
        assert 1 not in ctx.protected


def test_recover_arguments_are_checked(dask_client, dirs) -> None:
    with ftidask.init(**dirs, client=dask_client) as ctx:
        ctx.protect(1, da.arange(10.0, chunks=3))
        ctx.checkpoint(1, 1)
        # Before: ZeroDivisionError from dask.array.core.
        with pytest.raises(RecoveryError, match="variable 1: chunks 0 do not fit its shape"):
            ctx.recover(chunks={1: 0})
        with pytest.raises(RecoveryError, match=r"chunks=\.\.\.\) names variables \[2, 'x'\] that checkpoint 1 does "):
            ctx.recover(chunks={1: 5, 2: 5, "x": 5})  # before: ignored (a mistyped id)
        # Before: "1" named no checkpoint: NoCheckpointError with checkpoint 1 there.
        for kwargs in ({"ckpt_id": "1"}, {"level": "1"}, {"level": 9}):
            with pytest.raises(RecoveryError, match=r"recover\((ckpt_id|level)=\.\.\.\)") as info:
                ctx.recover(**kwargs)
            assert not isinstance(info.value, NoCheckpointError)
        got = ctx.recover(ckpt_id=1, level=1)[1]
        assert (got.compute() == np.arange(10.0)).all()
    with pytest.raises(FTIError, match="this context is finalized"):
        ctx.stored_size(1)  # before: answered after finalize on this backend


def test_a_context_whose_client_closed_still_shows_itself(dask_client, dirs) -> None:
    """A notebook shows the context after every cell: with its client closed, repr and the HTML table raised
    AttributeError (the scheduler asked for its workers); they say the client is closed, and compute nothing."""
    own, ctx, x = _checkpointed_then_client_closed(dask_client, dirs)
    assert "workers=? (client closed)" in repr(ctx) and "1:var1 float64[12]" in repr(ctx)
    assert "? (client closed) workers" in ctx._repr_html_()
    with pytest.raises(FTIError, match="the Dask client is closed"):
        ctx.finalize()
    assert "finalized" in repr(ctx) and "<table>" in ctx._repr_html_()
    with ftidask.init(**dirs, client=dask_client) as again:  # re-created on another client: recovers checkpoint 1
        assert "workers=2" in repr(again)
        got = again.recover()[1]
        assert again.recovered_from == (1, 1) and (got.compute() == np.arange(12.0)).all()


def test_l4_format_zarr_is_said_to_be_unused(dask_client, dirs, caplog) -> None:
    """docs/dask.md: l4_format = zarr is not used on Dask (level 4 is FTI-FF). It was ignored silently; init now warns,
    as it does for a ckpt_io that ftidask does not write, and level 4 is written as FTI-FF files."""
    caplog.set_level("WARNING", logger="ftidask")
    ctx = ftidask.init(**dirs, client=dask_client, l4_format="zarr")
    assert "l4_format = zarr is not used on Dask" in caplog.text, caplog.text
    ctx.protect(1, da.arange(12.0, chunks=4))
    ctx.checkpoint(1, 4)
    from pathlib import Path

    assert list(Path(dirs["glbl_dir"]).glob("*/l4/ckpt1.s*/Ckpt1-Rank*.fti"))
    ctx.finalize()
