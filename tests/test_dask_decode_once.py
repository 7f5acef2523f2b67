"""A Dask recovery decodes each compressed container once, and the codec's frame threads on a worker are
bounded by its ``nthreads``; on a real LocalCluster of worker processes and real files.

Decodes are counted in every worker process by a seam around :func:`ftidask.ftiff.compression.decode_span`,
through which every decoding goes (a container of one frame, and each frame of a larger one). A restart that
must hash every byte first (an L2/L3 file or its redundancy to rebuild) used to decode each container there,
then again in the read that fills its chunk; now the read alone decodes it, and a container that does not
decode fails its read like a damaged one, which sends the recovery back to a full check (that decodes).
"""

import json
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
numcodecs = pytest.importorskip("numcodecs")

from test_dask_compression import _files  # noqa: E402
from test_hostile_inputs import _forge_container  # noqa: E402

import ftidask  # noqa: E402
from ftidask.backends.dask import codecthreads, reads, restore  # noqa: E402
from ftidask.engine.runstate import seal_json  # noqa: E402
from ftidask.ftiff import compression  # noqa: E402
from ftidask.ftiff.reader import parse_ftiff  # noqa: E402
from ftidask.model.pools import LazyPool  # noqa: E402
from ftidask.storage import files as storage  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 4  # one L2 ring / L3 group of four workers (the cluster of the other Dask tests)
BIG = 1_100_000  # float64 elements of variable 2: a chunk of 600,000 (4.8 MB, two frames) and one of 500,000


@pytest.fixture
def client(dask_client):
    return dask_client


# --- the seams, in each worker process ------------------------------------------------------------------

SEEN = {"decodes": 0, "threads": set()}  # in a worker: decodings, and the frame threads that ran a codec


def _seams(on: bool) -> None:
    real_decode = getattr(compression.decode_span, "real", compression.decode_span)
    real_typed = getattr(compression._typed, "real", compression._typed)
    if not on:
        compression.decode_span, compression._typed = real_decode, real_typed
        return

    def _note() -> None:
        name = threading.current_thread().name
        if name.startswith("ftidask-frames"):
            SEEN["threads"].add(name)

    def decode_span(*args, **kw):
        SEEN["decodes"] += 1
        _note()
        return real_decode(*args, **kw)

    def typed(*args, **kw):  # every encoding hands its span to the codec through it
        _note()
        return real_typed(*args, **kw)

    decode_span.real, typed.real = real_decode, real_typed
    compression.decode_span, compression._typed = decode_span, typed
    SEEN["decodes"], SEEN["threads"] = 0, set()


def _seen() -> dict:
    return {"decodes": SEEN["decodes"], "threads": sorted(SEEN["threads"])}


@pytest.fixture
def seams(client):
    client.run(_seams, True)
    yield
    client.run(_seams, False)


def _decodes(client) -> int:
    return sum(s["decodes"] for s in client.run(_seen).values())


# --- data ---------------------------------------------------------------------------------------------

def _arrays():
    """Compressible fields: 8 chunks of 256 KiB (one frame each), and chunks of more than 4 MiB (frames)."""
    n = 512 * 512
    smooth = np.round(np.sin(np.arange(n) / 500.0) * 1000).reshape(512, 512)  # every codec shrinks it
    return {1: da.from_array(smooth, chunks=(128, 256)),
            2: da.from_array((np.arange(BIG) // 1000).astype(np.float64), chunks=(600_000,))}


def _protect(ctx, arrays, compressor=None):
    for vid, a in arrays.items():
        ctx.protect(vid, a, name=f"v{vid}", compressor=compressor)


def _restart(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    _protect(ctx, {1: da.zeros((512, 512), chunks=(128, 256)), 2: da.zeros(BIG, chunks=600_000)})
    return ctx


def _encoded_frames(paths) -> int:
    """Decodings a recovery of the files ``paths`` needs: a frame per encoded container (several for one
    stored in frames)."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            parsed = parse_ftiff(fh, str(path))
        for _b, _c, meta in parsed.containers():
            info = parsed.vars.get(meta.id)
            if meta.hascontent and compression.encoded(info, meta):
                total += len(info.extra.get("codec_frames", {}).get(str(meta.containerid), [0]))
    return total


def _same(out, saved):
    for vid, ref in saved.items():
        assert np.asarray(out[vid].compute()).tobytes() == ref.tobytes(), vid


# --- decode once ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("level", "loss"), [(2, "redundancy"), (3, "redundancy"), (2, "file"), (3, "file")])
def test_a_restart_that_rebuilds_decodes_each_container_once(client, dirs, seams, level, loss):
    """Partner copies or parity erased (rebuilt from the sound own files), or an own file lost (rebuilt from the
    level): the files' data is hashed before the rebuild, and each container decoded once, by its read. Then
    a restart with nothing missing: once too."""
    ctx = ftidask.init(client=client, compressor="zstd", **dirs)
    arrays = _arrays()
    saved = {vid: a.compute() for vid, a in arrays.items()}
    _protect(ctx, arrays)
    ctx.checkpoint(1, level)
    ctx._close()  # as a job that ends: the checkpoint stays
    root = Path(dirs["ckpt_dir"])
    erased = (list(root.glob("**/Ckpt1-Pcof*.fti")) + list(root.glob("**/Ckpt1-RSed*.fti")) if loss == "redundancy"
              else [p for p in _files(dirs, level) if p.name.endswith("-Rank1.fti")])
    assert erased
    for path in erased:
        path.unlink()
    client.run(_seams, True)  # counts from zero
    restart = _restart(client, dirs)
    out = restart.recover()
    _same(out, saved)
    assert restart.recovered_from == (1, level) and all(p.exists() for p in erased)  # rebuilt
    expected = _encoded_frames(_files(dirs, level))
    assert expected == 8 + 3  # each chunk of variable 1 encoded, and the frames of variable 2 (2 + 1)
    assert _decodes(client) == expected  # before: every container decoded twice (the check, then the read)
    restart._close()
    client.run(_seams, True)
    again = _restart(client, dirs)  # nothing missing now: the search checks metadata, the reads decode
    _same(again.recover(), saved)
    assert _decodes(client) == expected
    again._close()


def _forge_rank_file(dirs, level, rank, data):
    """Overwrite the start of each of variable 1's containers in ``rank``'s file of checkpoint 2 with ``data``,
    every hash resealed, the commit record too: bytes that pass every hash but are not what the codec wrote."""
    (path,) = [p for p in _files(dirs, level) if p.name == f"Ckpt2-Rank{rank}.fti"]
    fb_hash = _forge_container(path, 1, data)
    (record,) = [r for r in Path(dirs["meta_dir"]).glob("*/commits/s*.json")
                 if json.loads(r.read_text())["ckpt_id"] == 2]
    raw = json.loads(record.read_text())
    (entry,) = [f for f in raw["files"] if f["rank"] == rank]
    entry["fb_hash"] = fb_hash
    record.write_text(json.dumps(seal_json(raw)))


NOT_A_FRAME = bytes(16)
ANOTHER_SIZE = bytes(numcodecs.Zstd(level=1).encode(np.zeros((1 << 20) + 3, np.uint8)))  # no container's span


@pytest.mark.parametrize(("forged", "says"), [(NOT_A_FRAME, "declares no size"),
                                              (ANOTHER_SIZE, "declares 1048579 raw bytes")],
                         ids=["not a frame", "another size"])
@pytest.mark.parametrize("older", [True, False])
def test_a_container_that_does_not_decode_is_found_by_its_read(client, dirs, caplog, forged, says, older):
    """Partner copies erased: the check before their rebuild hashes the files without decoding them. A
    container whose bytes pass their hash but do not decode (not a frame, or a header declaring another size)
    then fails its read: the recovery goes back to a full check, which decodes and finds it, and passes over
    the checkpoint (to the older one, or NoCheckpointError): never a partial recovery, never a traceback."""
    ctx = ftidask.init(client=client, compressor="zstd", **dirs)
    arrays = _arrays()
    kept = np.arange(300.0)
    ctx.protect(3, kept.copy(), name="numpy")
    _protect(ctx, arrays)
    if older:
        ctx.checkpoint(1, 4)
    _protect(ctx, {vid: (a + 1) for vid, a in arrays.items()})
    ctx.protected[3][:] += 1
    ctx.checkpoint(2, 2)
    ctx._close()
    for path in Path(dirs["ckpt_dir"]).glob("**/Ckpt2-Pcof*.fti"):
        path.unlink()
    _forge_rank_file(dirs, 2, 1, forged)
    restart = _restart(client, dirs)
    numpy_var = np.full(300, -1.0)
    restart.protect(3, numpy_var)
    held = {vid: restart.protected[vid] for vid in (1, 2)}
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        if older:
            out = restart.recover()
        else:
            with pytest.raises(ftidask.NoCheckpointError, match="checkpoint 2 \\(level 2\\)"):
                restart.recover()
    # the damage was met by a read (the check before it decoded nothing), and then checked in full
    assert "checking every file of it in full" in caplog.text and says in caplog.text
    if older:
        assert restart.recovered_from == (1, 4)
        _same(out, {vid: a.compute() for vid, a in arrays.items()})
        assert numpy_var.tobytes() == kept.tobytes()
    else:
        assert (numpy_var == -1).all() and all(restart.protected[vid] is a for vid, a in held.items())
    restart._close()


def test_a_chunk_read_from_a_file_rebuilt_from_parity_decodes_its_container_only(client, dirs, monkeypatch):
    """The read of a lost worker's chunk (a lineage read, or a recovery read moved off a dead worker) rebuilds
    its L3 file from the group's parity where it runs: the rebuilt file is hash-checked, and only the chunk's
    own container is decoded (before: every container of the file, then that one again)."""
    ctx = ftidask.init(client=client, compressor="zstd", **dirs)
    arrays = _arrays()
    saved = arrays[1].compute()
    _protect(ctx, arrays)
    ctx.checkpoint(1, 3)
    record = ctx.state.records()[-1]
    own = {f.rank: ctx.node_file(3, 1, record.seq, f.rank, storage.rank_file(1, f.rank)) for f in record.files}
    src = restore.file_sources(ctx, record, {r: ("tcp://gone:1", p) for r, p in own.items()})[1]
    index, _rank, dptr, _n = next(row for row in record.extra["chunks"]["1"] if row[1] == 1)
    Path(src["path"]).unlink()
    count = [0]
    real = compression.decode_span

    def counting(*args, **kw):
        count[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(compression, "decode_span", counting)
    chunk = reads.read_lineage_chunk(src, 1, "v1", index, dptr, "<f8", [128, 256])  # here: in this process
    assert Path(src["path"]).exists() and _encoded_frames([src["path"]]) > 1
    assert count[0] == 1
    rows, cols = index
    assert chunk.tobytes() == saved[rows * 128:(rows + 1) * 128, cols * 256:(cols + 1) * 256].tobytes()
    ctx.finalize()


# --- frame threads --------------------------------------------------------------------------------------

def test_frame_threads_on_a_worker_are_bounded_by_twice_its_nthreads(client, dirs, seams):
    """A checkpoint (encoding) and a recovery (decoding) of chunks stored in frames run their codec on at most twice
    the worker's nthreads frame threads (the shared cluster's workers have one thread each; before: min(8, cores))."""
    ctx = ftidask.init(client=client, compressor="lz4", **dirs)
    arrays = _arrays()
    saved = {vid: a.compute() for vid, a in arrays.items()}
    _protect(ctx, arrays)
    ctx.checkpoint(1, 1)
    _same(_restart(client, dirs).recover(), saved)
    used = {w: s["threads"] for w, s in client.run(_seen).items()}
    pools = client.run(compression.frame_threads)
    share = {w: min(2 * n, compression._FRAME_THREADS) for w, n in client.nthreads().items()}
    assert any(used.values())  # frames were encoded and decoded on the pool
    assert pools == share and all(len(names) <= share[w] for w, names in used.items()), (used, pools)
    ctx.finalize()


def test_the_plugin_gives_the_frame_pool_twice_the_workers_nthreads(monkeypatch):
    """In this process, the default being 8 threads: a worker of 3 threads, of 1, of more threads than the default
    allows; then the default."""
    monkeypatch.setattr(compression, "_FRAME_THREADS", 8)
    try:
        for nthreads, expected in ((3, 6), (1, 2), (64, 8)):
            codecthreads.CodecThreadsPlugin().setup(SimpleNamespace(state=SimpleNamespace(nthreads=nthreads),
                                                                    address="tcp://w:1"))
            assert compression.frame_threads() == expected
            raw = np.arange(3 * compression.FRAME_BYTES // 8, dtype=np.float64)  # three frames, on that pool
            codec = numcodecs.LZ4()
            pieces, plain, sizes = compression.encode_container(codec, memoryview(raw).cast("B"), 8)
            assert not plain and len(sizes) == 3
            assert compression._frames.get()._max_workers == expected
        assert compression.limit_frame_threads(None) == 8
    finally:  # this process's own default again
        monkeypatch.undo()
        compression.limit_frame_threads(None)


def test_a_resized_pool_finishes_what_was_submitted_to_the_old_one():
    pool = LazyPool(2, "ftidask-test")
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait()
        return 7

    first = pool.submit(slow)
    started.wait()
    pool.resize(1)
    assert pool.threads == 1 and pool.get()._max_workers == 1
    second = pool.submit(lambda: 8)
    release.set()
    assert first.result() == 7 and second.result() == 8
    pool.resize(1)  # the same size: the pool is kept
    assert pool.get()._max_workers == 1
    pool.get().shutdown()
