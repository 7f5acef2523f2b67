"""A notebook's cluster closed while an asynchronous checkpoint of its context runs: the handle's result was
distributed's AttributeError ('NoneType' object has no attribute 'identity') or CommClosedError from deep inside
(found by a review). Now a CheckpointError that says the client is closed; the previous checkpoint is kept."""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = pytest.mark.dask


def _dirs(base) -> dict:
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 1}


def test_a_client_closed_under_an_asynchronous_checkpoint_fails_it_cleanly(tmp_path):
    x = da.random.default_rng(0).random((2000, 2000), chunks=(500, 2000))
    want = x.compute()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster:
        client = distributed.Client(cluster)
        ctx = ftidask.init(client=client, **_dirs(tmp_path))
        ctx.protect(1, client.persist(x))
        ctx.checkpoint(1, 2)
        handle = ctx.checkpoint(2, 2, wait=False)
        client.close()
        with pytest.raises(ftidask.CheckpointError, match="checkpoint 2 failed; the previous checkpoint is kept: the "
                                                          "Dask client is clos(ed|ing)"):
            handle.result()
        with pytest.raises(ftidask.FTIError, match="the Dask client is clos(ed|ing)"):
            ctx.finalize()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        again = ftidask.init(client=client, **_dirs(tmp_path))
        got = again.recover()[1]
        assert again.recovered_from == (1, 2) and np.array_equal(got.compute(), want)
        again.finalize()


def test_dasks_progress_bar_follows_verbosity_and_the_delay(dask_client, monkeypatch, capsys):
    """In a notebook (``auto``) the bar showed at verbosity 4 and for a step of a split second, as the docs say ftidask's
    bars do not (found by a review): gated on ``verbosity <= 2`` and drawn after DELAY seconds only."""
    import time

    from ftidask.backends.dask import cluster as cluster_module

    monkeypatch.setattr(cluster_module, "is_kernel", lambda: True)
    # A delay no step of a loaded machine reaches for the short step, one every machine passes for the long one:
    # what is checked is which side of the delay draws a bar, never how long a step takes.
    monkeypatch.setattr(cluster_module, "DELAY", 30.0)
    quiet = cluster_module.Cluster(dask_client, "auto", verbosity=4)
    assert quiet._show_progress([dask_client.submit(int, 1)]) is None
    shown = cluster_module.Cluster(dask_client, "auto", verbosity=2)
    futures = [dask_client.submit(int, 2, pure=False)]
    shown.wait_all(futures, (), "a short step")
    time.sleep(1.0)
    assert "[" not in capsys.readouterr().out  # done before the delay: no bar
    monkeypatch.setattr(cluster_module, "DELAY", 0.2)
    futures = [dask_client.submit(time.sleep, 1.5, pure=False)]
    shown.wait_all(futures, (), "a long step")
    out, deadline = "", time.monotonic() + 30  # the bar's thread prints its last line on its own poll
    while "Completed" not in out and time.monotonic() < deadline:
        time.sleep(0.1)
        out += capsys.readouterr().out
    assert "Completed" in out
