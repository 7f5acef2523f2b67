"""Dask arrays of many chunks: more than 64 along an axis come back (the record's check took a chunk list for a
shape, whose length NumPy bounds at 64), and a recovery parses each rank file once per worker, not once per chunk
(a file of n chunks cost n parses of its n-entry table: quadratic)."""

from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(180)]


@pytest.fixture
def client(dask_client):
    return dask_client


def test_more_than_64_chunks_along_an_axis_recover(client, dirs):
    x = da.arange(65 * 3, chunks=3).astype(np.float64)  # 65 chunks along its one axis
    y = da.random.default_rng(1).random((130, 6), chunks=(2, 3))  # 65 x 2 chunks
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, x)
    ctx.protect(2, y)
    ctx.checkpoint(1, 1)
    saved = {vid: a.compute() for vid, a in ctx.protected.items()}
    ctx._close()  # as a job that died: the checkpoint stays
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
    ctx.protect(2, da.zeros(y.shape, chunks=y.chunks))
    out = ctx.recover()
    assert out[1].chunks == x.chunks and out[2].chunks == y.chunks  # 65 and 65 x 2 chunks
    for vid, ref in saved.items():
        assert out[vid].compute().tobytes() == ref.tobytes()
    ctx.finalize()


def _rchar() -> int:
    """Bytes this worker process read from files (``rchar``: read and pread; sockets are received with recv)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_a_file_of_many_chunks_is_parsed_once_per_worker(client, dirs):
    # 20 x 10 chunks of 64 bytes (at most 64 along an axis: this test is about the parses): metadata outweighs data
    x = da.from_array(np.arange(1600, dtype=np.float64).reshape(160, 10), chunks=(8, 1))
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, x)
    ctx.checkpoint(1, 1)
    ctx._close()
    stored = sum(p.stat().st_size for p in find_paths(Path(dirs["ckpt_dir"]), "*.fti"))
    counted = []
    for attempt in ("warm", "counted", "counted"):  # the first imports what a recovery needs (modules are read too)
        restart = ftidask.init(client=client, **dirs)
        restart.protect(1, da.zeros(x.shape, chunks=x.chunks))
        before = client.run(_rchar)
        out = restart.recover()[1]
        read = sum(client.run(_rchar)[w] - before[w] for w in before)
        assert out.compute().tobytes() == x.compute().tobytes()
        restart._close()
        if attempt == "counted":
            counted.append(read)
    # Each file's metadata parsed once (the check) and each chunk read once; a parse per chunk read every file's
    # table of its 50 chunks 50 times (59 times the files' bytes, measured), in every recovery. The fewer of two:
    # a worker of the shared cluster may read something else meanwhile (once, in a full run: 18x the files' bytes).
    assert min(counted) < 3 * stored, (counted, stored)


def test_a_checkpoint_and_its_recovery_never_tokenize_their_task_graphs(client, dirs, monkeypatch):
    """Each step sends its tasks as one graph; recent Dask names such a graph by hashing every task's arguments on
    the client (0.5 ms a task on a loaded 2-core machine: 0.53 s for 1024 chunks, per step). ftidask's keys are its
    own and never reused, so its graphs are named at random: with expressions' tokenization made to fail on the
    client, a checkpoint and a recovery of 65 chunks still come back bit for bit."""
    expr = pytest.importorskip("dask._expr")
    x = da.random.default_rng(2).random((65, 4), chunks=(1, 4))
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, x)
    saved = x.compute()

    def refused(self):
        raise AssertionError(f"{type(self).__name__} tokenized on the client")

    monkeypatch.setattr(expr.LLGExpr, "__dask_tokenize__", refused, raising=False)
    ctx.checkpoint(1, 1)
    ctx._close()
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.zeros(x.shape, chunks=x.chunks))
    assert ctx.recover()[1].compute().tobytes() == saved.tobytes()
    ctx.finalize()
