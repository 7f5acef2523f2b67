"""Compression on the Dask backend, on a real LocalCluster: each chunk's container is compressed by the
worker that writes it (the engine's encoding), and every chunk read back is hash-checked before decoding.

Each test protects with a compressor (an argument or the config key), which the Dask backend refused before.
"""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
pytest.importorskip("numcodecs")

from test_dask_backend import live_workers  # noqa: E402

import ftidask  # noqa: E402
from ftidask.backends.dask import lineage  # noqa: E402
from ftidask.ftiff.reader import parse_ftiff  # noqa: E402
from ftidask.tools.cli import main  # noqa: E402

# 240 s, as test_dask_backend.py (the cluster it shares): the timeout counts the fixture's setup, which may close
# the previous cluster (up to 60 s) and wait for 4 new workers (up to 60 s), and the first test pays the fresh
# workers' first computation. On a loaded 2-core machine the round trip took up to 98 s of the former 120.
pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 4  # one L2 ring / L3 group of four workers (the cluster of the other Dask tests)


@pytest.fixture
def client(dask_client):
    return dask_client


def _smooth(shape, chunks, dtype):
    """A field that compresses well (a smooth ramp)."""
    n = int(np.prod(shape))
    return da.from_array((np.sin(np.arange(n) / 500.0) * 1000).astype(dtype).reshape(shape), chunks=chunks)


def _random_bytes(shape, chunks):
    """Bytes no codec shrinks: stored raw in their containers (``codec_plain``)."""
    return da.random.default_rng(7).integers(0, 256, shape, chunks=chunks, dtype=np.uint8)


def _arrays():
    """var id -> array: several dtypes, data that compresses and data that does not, a NumPy array too."""
    return {1: _smooth((96, 80), (24, 20), np.float64),
            2: _smooth((300,), (70,), np.int32),
            3: _random_bytes((64, 64), (16, 32)),
            4: da.from_array(np.zeros((40, 30), np.complex64) + 1j, chunks=(10, 15)),
            5: da.random.default_rng(3).random((50, 20), chunks=(25, 10)).astype(np.float32),
            6: np.arange(5000, dtype=np.int16) % 7,
            # a chunk of more than 4 MiB: its container is encoded in frames (codec_frames), one of less
            7: da.from_array((np.arange(1_100_000) // 1000).astype(np.float64), chunks=(600_000,))}


def _values(arrays):
    return {vid: np.asarray(a.compute() if hasattr(a, "compute") else a).copy() for vid, a in arrays.items()}


def _files(dirs, level):
    root = Path(dirs["glbl_dir"] if level == 4 else dirs["ckpt_dir"])
    return sorted(root.glob(f"**/l{level}/ckpt*/Ckpt*-Rank*.fti"))


def _tables(path):
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    return parsed, {vid: info.extra for vid, info in parsed.vars.items()}


def _assert_compressed(dirs, level, codec_id, plain_vars=(3,), raw=()):
    """Every variable with bytes in a file names the codec; some container of a compressible variable is
    stored smaller than its raw size, and random bytes are stored raw (``raw``: variables not compressed)."""
    files = _files(dirs, level)
    assert files
    shrunk = False
    for path in files:
        parsed, extras = _tables(path)
        for _b, _c, meta in parsed.containers():
            extra = extras[meta.id]
            if meta.id in raw:
                assert "codec" not in extra
            elif parsed.vars[meta.id].nbytes:
                assert extra["codec"]["id"] == codec_id
            if meta.id in plain_vars:
                assert meta.containerid in extra.get("codec_plain", [])
                assert meta.chunksize == meta.containersize
            elif meta.id == 4:  # a constant field: every codec shrinks it
                shrunk |= meta.chunksize < meta.containersize
    assert shrunk


def _assert_same(out, saved):
    for vid, ref in saved.items():
        got = np.asarray(out[vid].compute() if hasattr(out[vid], "compute") else out[vid])
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert got.tobytes() == ref.tobytes(), vid


def _targets(arrays, saved):
    """What a restart protects: the same Dask arrays (recovery returns new ones), a NumPy array to fill."""
    return {vid: np.zeros_like(saved[vid]) if vid == 6 else a for vid, a in arrays.items()}


def _protect_all(ctx, arrays, compressor=None):
    for vid, a in arrays.items():
        ctx.protect(vid, a, name=f"v{vid}", compressor=compressor)


@pytest.mark.parametrize("spec, codec_id", [("zstd:1", "zstd"), ("lz4", "lz4"), ("blosc", "blosc"),
                                            ("blosc-zstd:5", "blosc")])
def test_round_trip_bit_for_bit_per_codec(client, dirs, spec, codec_id):
    ctx = ftidask.init(client=client, **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    _protect_all(ctx, arrays, spec)
    info = ctx.checkpoint(1, 1)
    assert info.file_bytes > 0
    _assert_compressed(dirs, 1, codec_id)
    assert any(_tables(p)[1][7].get("codec_frames") for p in _files(dirs, 1))
    _assert_same(ctx.protected, saved)  # the lineage-cut arrays
    ctx2 = ftidask.init(client=client, **dirs)
    _protect_all(ctx2, _targets(arrays, saved))
    out = ctx2.recover()
    _assert_same(out, saved)
    assert main(["verify", str(Path(dirs["ckpt_dir"]))]) == 0


def test_config_key_l4_and_the_compressor_kept_after_recovery(client, dirs):
    ctx = ftidask.init(client=client, compressor="lz4", **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    _protect_all(ctx, arrays)
    ctx.protect(5, arrays[5], compressor="none")  # this one stays raw
    ctx.checkpoint(1, 4)
    _assert_compressed(dirs, 4, "lz4", raw=(5,))
    ctx2 = ftidask.init(client=client, **dirs)  # no compressor configured: the files say what to decode
    _protect_all(ctx2, {vid: a for vid, a in arrays.items() if vid != 6})
    ctx2.protect(6, np.zeros_like(saved[6]), compressor="zstd")
    _assert_same(ctx2.recover(), saved)
    ctx2.checkpoint(2, 1)  # after recover(), the Dask arrays are new: their compressor (none here) stays theirs
    ctx2.protect(1, ctx2.protected[1], compressor="blosc")
    ctx2.checkpoint(3, 1)
    tables = [_tables(p) for p in _files(dirs, 1) if p.parent.name.startswith("ckpt3.")]
    for parsed, extras in tables:
        assert "codec" not in extras[2]
        for vid, codec_id in ((1, "blosc"), (6, "zstd")):
            assert extras[vid]["codec"]["id"] == codec_id if parsed.vars[vid].nbytes else "codec" not in extras[vid]
    assert len(tables) == NWORKERS and any(parsed.vars[6].nbytes for parsed, _e in tables)


@pytest.mark.parametrize("level", [2, 3])
def test_lost_file_rebuilt_from_l2_l3(client, dirs, level):
    ctx = ftidask.init(client=client, compressor="zstd", **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    _protect_all(ctx, arrays)
    ctx.checkpoint(1, level)
    _assert_compressed(dirs, level, "zstd")
    (lost,) = [p for p in _files(dirs, level) if p.name.endswith("-Rank1.fti")]
    lost.unlink()
    ctx2 = ftidask.init(client=client, **dirs)
    _protect_all(ctx2, _targets(arrays, saved))
    _assert_same(ctx2.recover(), saved)
    assert ctx2.recovered_from == (1, level) and lost.exists()
    parsed, extras = _tables(lost)  # the rebuilt file: compressed as it was written
    assert extras[1]["codec"]["id"] == "zstd"


def _flip_in_container(paths, vid, prefer=0):
    """Flip a byte in the stored (compressed) bytes of the first container of ``vid`` in ``paths[prefer]``, or, if
    that file holds none (Dask placed no chunk of ``vid`` on its worker), in the first of the others that does;
    the file flipped."""
    for path in [paths[prefer]] + [p for i, p in enumerate(paths) if i != prefer]:
        parsed, extras = _tables(path)
        meta = next((m for _b, _c, m in parsed.containers() if m.id == vid and m.hascontent
                     and m.containerid not in extras.get(vid, {}).get("codec_plain", [])), None)
        if meta is not None:
            break
    else:
        raise AssertionError(f"no file holds a container of variable {vid}")
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(meta.fptr + meta.chunksize // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_compressed_container_refused_arrays_untouched(client, dirs, caplog):
    ctx = ftidask.init(client=client, **dirs)
    arrays = _arrays()
    _protect_all(ctx, arrays, "zstd")
    ctx.checkpoint(1, 1)
    _flip_in_container(_files(dirs, 1), 1)
    assert main(["verify", str(Path(dirs["ckpt_dir"]))]) != 0
    ctx2 = ftidask.init(client=client, **dirs)
    held = {vid: (np.full_like(np.asarray(a), 3) if vid == 6 else a) for vid, a in arrays.items()}
    _protect_all(ctx2, held)
    with pytest.raises(ftidask.NoCheckpointError, match="hash does not match"):
        ctx2.recover()
    assert all(ctx2.protected[vid] is a for vid, a in held.items())  # nothing rebound
    assert (held[6] == 3).all()  # nothing filled
    # A read on a worker (recovery's and the lineage cut's) checks the stored bytes before decoding them.
    from ftidask.backends.dask import tasks

    path = _files(dirs, 1)[0]
    parsed, extras = _tables(path)
    block = extras[1]["dask"]["blocks"][0]
    with pytest.raises(ftidask.FormatError, match="hash does not match"):
        tasks.read_chunk(str(path), 1, block[2], "<f8", block[1], parsed.fb.hash.hex())


def test_lineage_read_after_a_worker_loss_decodes(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    _protect_all(ctx, arrays, "blosc")
    ctx.checkpoint(1, 1)
    pids = client.run(os.getpid)
    address = sorted(pids)[2]
    os.kill(pids[address], signal.SIGKILL)  # its file stays on the (shared) disk: read back, decoded
    end = time.monotonic() + 60
    while address in live_workers(client):
        assert time.monotonic() < end
        time.sleep(0.1)
    _assert_same(ctx.protected, saved)
    events = lineage.restores(client, ctx.exec_id)
    assert events and {e["how"] for e in events} == {"its file"}


def test_recover_file_of_a_worker_in_one_process(client, dirs, tmp_path):
    ctx = ftidask.init(client=client, **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    _protect_all(ctx, arrays, "zstd:3")
    ctx.checkpoint(1, 1)
    path = next(p for p in _files(dirs, 1) if _tables(p)[0].vars[1].nbytes)
    parsed, extras = _tables(path)
    # The file holds, per variable, the chunks this worker wrote back to back (its table says which).
    expected = {}
    for vid, info in parsed.vars.items():
        chunks = extras[vid]["dask"]["chunks"]
        pieces = []
        for index, _shape, _dptr in extras[vid]["dask"]["blocks"]:
            where = tuple(slice(sum(c[:i]), sum(c[:i + 1])) for c, i in zip(chunks, index, strict=True))
            pieces.append(np.ascontiguousarray(saved[vid][where]).reshape(-1))
        expected[vid] = np.concatenate(pieces) if pieces else np.zeros(0, info.dtype)
    one = ftidask.init(ckpt_dir=str(tmp_path / "L1"), glbl_dir=str(tmp_path / "G1"), meta_dir=str(tmp_path / "M1"))
    targets = {vid: np.zeros(info.shape, info.dtype) for vid, info in parsed.vars.items()}
    for vid, target in targets.items():
        one.protect(vid, target)
    one.recover_file(path)
    for vid, target in targets.items():
        assert target.tobytes() == expected[vid].tobytes(), vid
    assert main(["inspect", str(path)]) == 0
    one.finalize()
    # The worker files stitched into global arrays by the export, each chunk decoded.
    from ftidask.tools.zarr_export import export_checkpoint

    zarr = pytest.importorskip("zarr")
    export_checkpoint(None, tmp_path / "out.zarr", **dirs)
    for vid in (1, 3, 4):
        assert zarr.open_array(str(tmp_path / "out.zarr"), path=f"v{vid}", mode="r")[...].tobytes() == \
            saved[vid].tobytes()


def test_refused_and_uncompressed_combinations(client, dirs):
    ctx = ftidask.init(client=client, enable_dcp=1, **dirs)
    arrays = _arrays()
    saved = _values(arrays)
    with pytest.raises(ftidask.ConfigError, match="unknown"):
        ctx.protect(1, arrays[1], compressor="gzip")
    _protect_all(ctx, arrays, "zstd")
    # Incremental checkpoints at levels 1-4 refuse a compressor, as on every backend.
    with pytest.raises(ftidask.CheckpointError, match="incremental checkpoints are written uncompressed"):
        ctx.init_icp(1, 1)
    # Differential checkpoints (levels 5-8) are written uncompressed, as on every backend.
    ctx.checkpoint(2, 5)
    files = _files(dirs, 1)
    assert files and all("codec" not in e for p in files for e in _tables(p)[1].values())
    ctx2 = ftidask.init(client=client, enable_dcp=1, **dirs)
    _protect_all(ctx2, _targets(arrays, saved))
    _assert_same(ctx2.recover(), saved)
