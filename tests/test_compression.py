"""Compressed FTI-FF containers: round trips per codec, recorded codec, damage detection."""

import json
import os

import numpy as np
import pytest
from test_hostile_inputs import _rewrite_table, _table

import ftidask
from ftidask.ftiff import compression
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import ConfigError, FormatError, NoCheckpointError
from ftidask.tools.cli import main as cli_main

CODECS = ["zstd", "zstd:9", "lz4", "blosc", "blosc-zstd:3", "blosc-lz4hc"]


def _dirs(tmp_path, **kw):
    return dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m", **kw)


def _fields():
    x = np.linspace(0, 4 * np.pi, 200_000)
    smooth = np.round(np.sin(x) * np.cos(x / 3), 6).reshape(400, 500)
    noise = np.random.default_rng(7).random(60_000)
    fortran = np.asfortranarray(np.arange(3000, dtype=np.int32).reshape(50, 60))
    record = np.zeros(100, dtype=[("a", "<i4"), ("b", "<f8")])
    record["a"] = np.arange(100)
    return smooth, noise, fortran, record


def _files(tmp_path):
    return sorted(tmp_path.glob("l/node0/*/l1/*/Ckpt*-Rank0.fti")) + sorted(tmp_path.glob("g/*/l4/*/*.fti"))


@pytest.mark.parametrize("codec", CODECS)
def test_roundtrip_every_codec(tmp_path, codec):
    arrays = _fields()
    ctx = ftidask.init(**_dirs(tmp_path))
    for i, a in enumerate(arrays):
        ctx.protect(i + 1, a, compressor=codec)
    info = ctx.checkpoint(1, 1)
    raw = sum(a.nbytes for a in arrays)
    assert info.bytes_written < raw  # the smooth field and the ramp compress
    ctx2 = ftidask.init(**_dirs(tmp_path))
    outs = [np.zeros_like(a) for a in arrays]
    for i, o in enumerate(outs):
        ctx2.protect(i + 1, o)  # no compressor given: recovery reads the codec from the file
    ctx2.recover()
    for a, o in zip(arrays, outs):
        assert o.tobytes() == a.tobytes() and o.flags.f_contiguous == a.flags.f_contiguous


def test_codec_is_recorded_and_chunksize_is_stored_size(tmp_path):
    smooth, noise, *_ = _fields()
    ctx = ftidask.init(**_dirs(tmp_path, compressor="zstd"))
    ctx.protect(1, smooth)
    ctx.protect(2, noise)
    ctx.protect(3, np.arange(10.0), compressor="none")
    ctx.checkpoint(1, 1)
    (path,) = _files(tmp_path)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
    assert parsed.vars[1].extra["codec"]["id"] == "zstd"
    assert "codec" not in parsed.vars[3].extra
    metas = {m.id: m for _b, _c, m in parsed.containers()}
    assert metas[1].chunksize < metas[1].containersize == smooth.nbytes  # containers sized by raw bytes
    assert metas[3].chunksize == metas[3].containersize == 80
    # random doubles do not shrink: stored as is and listed as such
    if metas[2].chunksize == noise.nbytes:
        assert parsed.vars[2].extra["codec_plain"] == [0]
    assert parsed.fb.ckpt_size == sum(m.chunksize for m in metas.values())


def test_incompressible_container_stored_plain(tmp_path):
    data = np.frombuffer(np.random.default_rng(1).bytes(1 << 16), np.uint8).copy()
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, data, compressor="lz4")
    info = ctx.checkpoint(1, 1)
    assert info.bytes_written == data.nbytes
    (path,) = _files(tmp_path)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    assert parsed.vars[1].extra["codec_plain"] == [0]
    out = np.zeros_like(data)
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, out)
    ctx2.recover()
    assert out.tobytes() == data.tobytes()


def test_growing_and_shrinking_compressed_variable(tmp_path):
    """Compressed sizes vary between checkpoints: containers keep their raw size rule."""
    ctx = ftidask.init(**_dirs(tmp_path, compressor="blosc"))
    a = np.zeros(10_000)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    b = np.random.default_rng(2).random(25_000)  # grows, and is less compressible
    ctx.protect(1, b)
    ctx.checkpoint(2, 1)
    c = np.arange(5_000.0)  # shrinks
    ctx.protect(1, c)
    ctx.checkpoint(3, 1)
    out = np.zeros_like(c)
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, out)
    ctx2.recover()
    assert out.tobytes() == c.tobytes()


def test_damaged_compressed_container_never_decoded(tmp_path):
    smooth = _fields()[0]
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, smooth, compressor="zstd")
    ctx.checkpoint(1, 1)
    (path,) = _files(tmp_path)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    meta = next(m for _b, _c, m in parsed.containers())
    with open(path, "r+b") as fh:  # flip one byte inside the stored (compressed) bytes
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(meta.fptr + meta.chunksize // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    out = np.full_like(smooth, 7.0)
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, out)
    with pytest.raises(NoCheckpointError, match="hash"):
        ctx2.recover()
    assert (out == 7.0).all()  # untouched


def test_damaged_container_falls_back_to_older_checkpoint(tmp_path):
    smooth = _fields()[0]
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    ctx.protect(1, smooth, compressor="blosc-zstd")
    ctx.checkpoint(1, 4)
    first = smooth.copy()
    smooth += 1
    ctx.checkpoint(2, 1)
    l1 = next(tmp_path.glob("l/node0/*/l1/*/Ckpt2-Rank0.fti"))
    with open(l1, "r+b") as fh:
        parsed = parse_ftiff(fh, str(l1))
        meta = next(m for _b, _c, m in parsed.containers())
        fh.seek(meta.fptr + 3)
        fh.write(b"\0\0\0\0")
    out = np.zeros_like(smooth)
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, out)
    ctx2.recover()
    assert ctx2.recovered_from == (1, 4)
    assert out.tobytes() == first.tobytes()


def test_unknown_codec_in_file_is_refused():
    with pytest.raises(FormatError, match="not one ftidask decodes"):
        compression.var_codec({"codec": {"id": "pickle"}})


@pytest.mark.parametrize("spec", ["gzip", "zstd:x", "blosc-foo", {"id": "pickle"},
                                  {"id": "blosc", "typesize": 2**70}, {"id": "blosc", "typesize": "x"}])
def test_bad_compressor_specs(tmp_path, spec):
    with pytest.raises(ConfigError):
        compression.parse_compressor(spec)
    if isinstance(spec, str):
        with pytest.raises(ConfigError):
            ftidask.init(**_dirs(tmp_path, compressor=spec))


def test_config_and_numcodecs_objects(tmp_path):
    import numcodecs

    assert compression.parse_compressor("none") is None
    assert compression.parse_compressor(numcodecs.Zstd(level=1)) == {"id": "zstd", "level": 1, "checksum": False}
    cfg = tmp_path / "fti.cfg"
    cfg.write_text(f"[basic]\nckpt_dir = {tmp_path}/l\nglbl_dir = {tmp_path}/g\nmeta_dir = {tmp_path}/m\n"
                   "[advanced]\ncompressor = lz4\n")
    ctx = ftidask.init(cfg)
    a = np.zeros(50_000)
    ctx.protect(1, a)
    assert ctx.checkpoint(1, 1).bytes_written < a.nbytes // 10


def test_inspect_shows_the_codec(tmp_path, capsys):
    from ftidask.tools.cli import main

    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.zeros(10_000), name="zeros", compressor="blosc-zstd:2")
    ctx.checkpoint(1, 1)
    (path,) = _files(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "'zeros'" in out and "'cname': 'zstd'" in out and "'clevel': 2" in out
    assert main(["verify", str(path)]) == 0


# --- large containers: frames encoded and decoded on several threads ----------------------------------------

def _walk(n: int, seed: int = 5) -> np.ndarray:
    """A random walk rounded to 2 decimals: every codec shrinks it."""
    return np.round(np.cumsum(np.random.default_rng(seed).standard_normal(n)), 2)


def _vars_extra(path) -> dict:
    with open(path, "rb") as fh:
        return {vid: info.extra for vid, info in parse_ftiff(fh, str(path)).vars.items()}


@pytest.mark.parametrize("codec", ["zstd", "lz4", "blosc"])
def test_a_large_container_is_stored_in_frames(tmp_path, codec):
    n = 3 * compression.FRAME_BYTES // 8 + 1001  # four frames, the last one short
    data, small = _walk(n), _walk(1000, 6)
    grown = np.asfortranarray(_walk(2 * n, 7).reshape(2, n))  # grown in a second checkpoint: another container
    ctx = ftidask.init(**_dirs(tmp_path, compressor=codec))
    ctx.protect(1, data)
    ctx.protect(2, small)
    ctx.protect(3, grown[:, : n // 2].copy(order="F"))
    ctx.checkpoint(1, 1)
    ctx.protect(3, grown)
    ctx.checkpoint(2, 1)
    ctx._close()
    path = sorted(tmp_path.glob("l/node0/*/l1/ckpt2*/Ckpt2-Rank0.fti"))[0]
    extra = _vars_extra(path)
    assert [len(s) for s in extra[1]["codec_frames"].values()] == [4]
    assert extra[1]["codec_frame_bytes"] == compression.FRAME_BYTES and "codec_frames" not in extra[2]
    assert sorted(extra[3]["codec_frames"]) == ["0", "1"]  # both of the grown variable's containers
    for fresh in (False, True):  # into touched arrays, and into fresh ones (read, checked, decoded once)
        ctx2 = ftidask.init(**_dirs(tmp_path))
        outs = [np.empty_like(a) if fresh else np.full_like(a, -1) for a in (data, small, grown)]
        for i, o in enumerate(outs):
            ctx2.protect(i + 1, o)
        ctx2.recover()
        ctx2._close()
        assert all(o.tobytes() == a.tobytes() for o, a in zip(outs, (data, small, grown)))
    assert cli_main(["verify", str(path)]) == 0


def _two_frames(tmp_path) -> tuple:
    """A file of one zstd container in two frames: its path, its variable table, the variable's ``extra``."""
    ctx = ftidask.init(**_dirs(tmp_path, compressor="zstd"))
    ctx.protect(1, _walk(compression.FRAME_BYTES // 4))
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = _files(tmp_path)
    table = _table(path)
    return path, table, table["vars"][0]["extra"]


@pytest.mark.parametrize("forged", [{"codec_frames": {"0": [1, 2]}}, {"codec_frames": {"0": "x"}},
                                    {"codec_frames": [3]}, {"codec_frame_bytes": 0},
                                    {"codec_frame_bytes": True}, "shift"])
def test_a_forged_frame_record_is_damage(tmp_path, forged):
    """Frame sizes that do not add up to the stored bytes or make another number of frames, records of the
    wrong type, a frame boundary moved (each frame then fails to decode): a FormatError before any array."""
    path, table, extra = _two_frames(tmp_path)
    if forged == "shift":
        sizes = extra["codec_frames"]["0"]
        extra["codec_frames"]["0"] = [sizes[0] - 7, sizes[1] + 7]
    else:
        extra.update(forged)
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(FormatError):
        verify_data(fh, parse_ftiff(fh, str(path)))
    assert cli_main(["verify", str(path)]) == 1


def _frames_forged(tmp_path, frame: int) -> tuple:
    """A two-frame container whose record is rewritten to ``frame`` raw bytes a frame, its stored bytes cut
    into as many frames (none of which decodes): the path and how many frames the record declares."""
    path, table, extra = _two_frames(tmp_path)
    stored, count = sum(extra["codec_frames"]["0"]), -(-2 * compression.FRAME_BYTES // frame)
    extra["codec_frames"]["0"] = [stored // count + (i < stored % count) for i in range(count)]
    extra["codec_frame_bytes"] = frame
    _rewrite_table(path, json.dumps(table).encode())
    return path, count


def _counting_decodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    decode = compression.decode_span
    monkeypatch.setattr(compression, "decode_span", lambda *a, **k: calls.append(1) or decode(*a, **k))
    return calls


def test_frames_too_small_to_be_ftidask_s_are_refused_from_the_record(tmp_path, monkeypatch):
    """A forged record of tiny frames (a frame per byte, a list as long as the span) cost a task, a future and
    a decoding per frame, thousands of times the file's bytes in memory: refused before any is decoded."""
    path, count = _frames_forged(tmp_path, 256)
    calls = _counting_decodes(monkeypatch)
    with open(path, "rb") as fh, pytest.raises(FormatError, match="codec_frame_bytes"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    assert count == 32768 and calls == []


def test_decoding_stops_at_the_first_frames_that_fail(tmp_path, monkeypatch):
    """Frames that do not decode: the first ones' failure refuses the container; the frames after them are
    never submitted (all of them queued at once cost a future each, however many the record lists)."""
    path, count = _frames_forged(tmp_path, 64 << 10)  # the smallest frame a file may declare
    calls = _counting_decodes(monkeypatch)
    with open(path, "rb") as fh, pytest.raises(FormatError, match="frame 0: cannot be decoded"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    assert count == 128 and 0 < len(calls) < count


def _frames_in_child() -> bool:
    import numcodecs

    data = _walk(compression.FRAME_BYTES // 4)
    pieces, plain, sizes = compression.encode_container(numcodecs.Zstd(), memoryview(data).cast("B"), 8)
    return not plain and len(sizes) == 2


def _copy_in_child() -> bool:
    from ftidask.engine import snapshot

    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    snapshot._parallel_copy(dst, src)
    return bool(np.array_equal(dst, src))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("module, pool, use", [("ftidask.ftiff.compression", "_frames", _frames_in_child),
                                               ("ftidask.engine.snapshot", "_copiers", _copy_in_child)])
def test_a_child_forked_while_a_thread_makes_the_pool_makes_its_own(module, pool, use):
    """A thread of the parent inside the pool's lock when another thread forks: the child's copy of the lock
    was held, by no thread of the child, and its first frame (or parallel copy) waited for it forever."""
    import importlib
    import warnings

    lazy = getattr(importlib.import_module(module), pool)
    with lazy._lock, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a process with threads
        pid = os.fork()
        if pid == 0:  # the child: a lock it can take (not to wait forever here), then the pool works
            free = lazy._lock.acquire(blocking=False)
            if free:
                lazy._lock.release()
            os._exit(0 if free and use() else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_an_unexpected_error_while_decoding_is_damage_named_as_it_is(tmp_path, monkeypatch, capsys):
    """A codec failing otherwise than by a decoding error (a MemoryError, say) came out of verification as a
    BufferError (the memory map could not be closed under the exception's views): it is the container's damage."""
    ctx = ftidask.init(**_dirs(tmp_path, compressor="zstd"))
    ctx.protect(1, _walk(100_000))
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = _files(tmp_path)

    def no_memory(*args, **kwargs):
        raise MemoryError("no room to decode")

    monkeypatch.setattr(compression, "decode_container", no_memory)
    with open(path, "rb") as fh, pytest.raises(FormatError, match="MemoryError: no room to decode"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    assert cli_main(["verify", str(path)]) == 1 and "MemoryError" in capsys.readouterr().out


def test_an_encoding_error_in_a_frame_leaves_no_view_of_the_source_behind():
    """A frame whose encoding fails: the error reaches the caller as it was raised, and once the caller has
    dropped it the source buffer is no longer exported (it stayed exported, held in a cycle of the future,
    its exception and the frames, until a garbage collection ran)."""
    import gc

    class Failing:
        def encode(self, data):
            raise RuntimeError("encoder out of memory")

    source = bytearray(3 * compression.FRAME_BYTES)
    gc.disable()
    try:
        try:
            compression.encode_container(Failing(), source, 8)
        except RuntimeError as exc:
            assert str(exc) == "encoder out of memory"
        else:
            raise AssertionError("the encoding error was not raised")
        source.extend(b"x")  # a BufferError while any view of it is alive
    finally:
        gc.enable()
    assert len(source) == 3 * compression.FRAME_BYTES + 1


@pytest.mark.parametrize("how", ["recover", "recover_var", "recover_file"])
def test_stored_size_after_a_recovery_is_the_variables_size(tmp_path, how):
    """FTI_GetStoredSize gives a variable's bytes, compressed or not. After a recovery (no stored_size asked
    before it) it summed the recovered file's containers as stored: a compressed variable's compressed bytes,
    and a realloc sized by it would have been too small."""
    smooth, *_ = _fields()
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, smooth, compressor="zstd")
    ctx.protect(2, np.arange(10.0))
    ctx.checkpoint(1, 1)
    assert ctx.stored_size(1) == smooth.nbytes
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, np.zeros_like(smooth))
    ctx2.protect(2, np.zeros(10))
    if how == "recover_file":
        ctx2.recover_file(_files(tmp_path)[0])
    else:
        getattr(ctx2, how)(*([1] if how == "recover_var" else []))
    assert ctx2.protected[1].tobytes() == smooth.tobytes()
    assert (ctx2.stored_size(1), ctx2.stored_size(2)) == (smooth.nbytes, 80)


def test_a_blosc_typesize_in_range_or_none_is_taken(tmp_path):
    """typesize was not range-checked: 2**70 failed every checkpoint with numcodecs' raw OverflowError."""
    for typesize in (None, 4):
        assert compression.parse_compressor({"id": "blosc", "typesize": typesize})["typesize"] == typesize
