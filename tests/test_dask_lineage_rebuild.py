"""An array handed back by a Dask checkpoint (its lineage cut: its chunks read back from the checkpoint's files) whose
worker is lost: the chunk rebuilt from the L3 parity into the run's own directories only. A rank file replaced by a
directory is rebuilt in its place (as recover() does); a checkpoint directory replaced by a link out of the run is
refused, by the lineage read and by recover() (both wrote the rebuilt file through it). Found by the lineage review."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask.model.errors import NoCheckpointError, RecoveryError  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.slow, pytest.mark.timeout(300)]
NWORKERS = 4


@pytest.fixture
def client(dask_client):
    return dask_client


def _kill_with(client, victim, harm) -> None:
    """Stop the worker, harm its disk (``harm()``), then kill it: the cluster sees the loss only after the harm."""
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGSTOP)
    try:
        harm()
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("harm", ["directory", "link"])
def test_a_lost_chunk_is_rebuilt_only_inside_the_run(client, tmp_path, harm):
    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 4}
    outside = tmp_path / "outside"
    outside.mkdir()
    ctx = ftidask.init(client=client, **dirs)
    x = client.persist(da.random.default_rng(0).random((64, 48), chunks=(16, 16)))
    expected = x.compute()
    ctx.protect(1, x)
    ctx.checkpoint(1, 3)
    y = ctx.protected[1]  # reads checkpoint 1's files
    workers = ctx.last_checkpoint.workers
    held = {}
    for key, who in client.who_has(y).items():
        if len(who) == 1:
            held[who[0]] = held.get(who[0], 0) + 1
    victim = max(held, key=held.get)
    rank = workers.index(victim)
    (own,) = Path(dirs["ckpt_dir"]).glob(f"node{rank}/*/l3/ckpt1.*/Ckpt1-Rank{rank}.fti")

    def damage():
        if harm == "directory":  # the worker dies, its disk stays: its file is now a directory
            own.unlink()
            own.mkdir()
        else:  # the node lost, and a link planted where its checkpoint's directory was
            shutil.rmtree(Path(dirs["ckpt_dir"]) / f"node{rank}")
            own.parent.parent.mkdir(parents=True)
            own.parent.symlink_to(outside)

    _kill_with(client, victim, damage)
    if harm == "directory":
        assert client.compute(y).result(timeout=120).tobytes() == expected.tobytes()
    else:
        with pytest.raises(RecoveryError, match="is a symbolic link"):
            client.compute(y).result(timeout=120)
        del y
        client.wait_for_workers(NWORKERS, timeout=90)
        again = ftidask.init(client=client, **dirs)
        with pytest.raises(NoCheckpointError, match="symbolic link"):
            again.recover()
        again._close()
    assert list(outside.iterdir()) == []
    ctx._close()


def test_a_second_context_of_the_run_keeps_what_the_firsts_arrays_read(client, tmp_path):
    """A notebook's init cell run again: a second context of the run, whose checkpoints retired checkpoint 1 that
    the first context's array still read (each context asked about the keys it made only). A worker lost then, the
    array could not be computed."""

    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 4}
    ctx = ftidask.init(client=client, **dirs)
    x = client.persist(da.random.default_rng(0).random((64, 48), chunks=(16, 16)))
    expected = x.compute()
    ctx.protect(1, x)
    ctx.checkpoint(1, 2)
    y = ctx.protected[1]  # the application holds the array that reads checkpoint 1
    again = ftidask.init(client=client, **dirs)  # the init cell run again: the same run
    assert again.exec_id == ctx.exec_id
    again.protect(1, client.persist(x + 1))
    for i in (2, 3):
        again.checkpoint(i, 2)
        again.protect(1, again.protected[1] + 1)
    assert list(Path(dirs["ckpt_dir"]).rglob("ckpt1.*/Ckpt1-Rank*.fti"))  # kept: read by y
    held = {}
    for who in client.who_has(y).values():
        if len(who) == 1:
            held[who[0]] = held.get(who[0], 0) + 1
    victim = max(held, key=held.get)
    rank = ctx.last_checkpoint.workers.index(victim)
    _kill_with(client, victim, lambda: shutil.rmtree(Path(dirs["ckpt_dir"]) / f"node{rank}"))
    assert client.compute(y).result(timeout=120).tobytes() == expected.tobytes()
    again._close()
    ctx._close()
