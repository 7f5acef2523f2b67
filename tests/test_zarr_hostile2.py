"""Zarr stores, written and read: dtypes Zarr does not give back are refused when written; foreign stores are
bounded before Zarr reads them (links, chunk counts, codec bombs, vlen counts); chunk files of ftidask's own
stores are one Zstd frame; foreign ids are the ones the store asked for."""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
numcodecs = pytest.importorskip("numcodecs")

import ftidask  # noqa: E402
from ftidask.model.arrays import VarInfo  # noqa: E402
from ftidask.model.errors import FormatError, FTIError  # noqa: E402
from ftidask.tools.zarr_export import export_checkpoint, main, read_zarr  # noqa: E402
from ftidask.zarrfmt import store as zs  # noqa: E402

BE_FIELDS = np.dtype([("a", ">i4"), ("b", ">f8")])
ALIGNED = np.dtype([("a", "u1"), ("b", "f8")], align=True)
OFFSETS = np.dtype({"names": ["a", "b"], "formats": ["i1", "i4"], "offsets": [4, 0], "itemsize": 12})
NESTED_BE = np.dtype([("x", [("p", ">i2")]), ("y", "<f4")])
GENERIC_M8 = np.dtype("M8")
REFUSED = {"be-fields": BE_FIELDS, "aligned": ALIGNED, "offsets": OFFSETS, "nested-be": NESTED_BE,
           "generic-M8": GENERIC_M8}


def _values(dtype: np.dtype) -> np.ndarray:
    """Values whose bytes change when read in another byte order or layout (not zeros)."""
    if dtype.kind == "M":
        return np.array(["NaT", "NaT"], dtype)
    out = np.zeros(2, dtype)
    for i, name in enumerate(dtype.names):
        field = out[name]
        if field.dtype.names:
            field[field.dtype.names[0]] = [i + 1, i + 2]
        else:
            field[...] = [i + 1, i + 3]
        out[name] = field
    return out


# --- 1, 2, 8: dtypes Zarr cannot give back: refused when written ----------------------------------------------


@pytest.mark.parametrize("dtype", list(REFUSED.values()), ids=list(REFUSED))
def test_a_dtype_zarr_does_not_give_back_fails_the_l4_checkpoint_and_keeps_the_previous(dirs, dtype, caplog):
    """Big-endian fields came back byte-swapped (silently); aligned or offset fields committed a checkpoint no
    recovery takes, retiring the previous one; a generic datetime64 logged Zarr's traceback."""
    dirs = dict(dirs, l4_format="zarr")
    ctx = ftidask.init(**dirs)
    first = np.arange(4.0)
    ctx.protect(2, first, name="first")
    ctx.checkpoint(1, 4)
    x = _values(dtype)
    ctx.protect(1, x, name="x")
    with pytest.raises(ftidask.CheckpointError, match="Zarr cannot store dtype"):
        ctx.checkpoint(2, 4)
    assert ctx.last_checkpoint.id == 1
    assert "unexpected" not in caplog.text and "Traceback" not in caplog.text
    ctx._close()
    ctx = ftidask.init(**dirs)
    back = np.zeros(4)
    ctx.protect(2, back, name="first")
    ctx.recover()
    assert ctx.recovered_from[0] == 1 and back.tobytes() == first.tobytes()
    ctx._close()


@pytest.mark.parametrize("dtype", [np.dtype(">f8"), np.dtype([("a", "<i4"), ("b", "<f8")]),
                                   np.dtype([("x", [("p", "<i2")]), ("y", "S2")]), np.dtype(">M8[ns]")],
                         ids=["big-endian", "packed", "nested", "datetime-ns"])
def test_dtypes_zarr_gives_back_still_round_trip_at_l4(dirs, dtype):
    dirs = dict(dirs, l4_format="zarr")
    ctx = ftidask.init(**dirs)
    x = np.arange(2).astype(dtype) if dtype.names is None else _values(dtype)
    ctx.protect(1, x, name="x")
    ctx.checkpoint(1, 4)
    ctx._close()
    ctx = ftidask.init(**dirs)
    y = np.zeros_like(x)
    ctx.protect(1, y, name="x")
    ctx.recover()
    assert y.dtype == x.dtype and y.tobytes() == x.tobytes()
    ctx._close()


@pytest.mark.parametrize("dtype", [BE_FIELDS, ALIGNED, GENERIC_M8], ids=["be-fields", "aligned", "generic-M8"])
def test_an_export_of_a_dtype_zarr_does_not_give_back_is_refused_cleanly(tmp_path, dtype, capsys):
    cfg = tmp_path / "c.fti"
    cfg.write_text(f"[basic]\nckpt_dir = {tmp_path}/L\nglbl_dir = {tmp_path}/G\nmeta_dir = {tmp_path}/M\n")
    ctx = ftidask.init(str(cfg))
    x = _values(dtype)
    ctx.protect(1, x, name="x")
    ctx.checkpoint(1, 1)
    ctx._close()
    with pytest.raises(FTIError, match="Zarr cannot store dtype"):
        export_checkpoint(str(cfg), tmp_path / "e.zarr")
    assert main(["export", str(cfg), "--to-zarr", str(tmp_path / "cli.zarr")]) == 2
    err = capsys.readouterr().err
    assert "Zarr cannot store dtype" in err and "Traceback" not in err
    assert not (tmp_path / "e.zarr").exists() and not (tmp_path / "cli.zarr").exists()


def test_a_manifest_dtype_of_other_field_byte_orders_than_the_array_is_refused(tmp_path):
    """The check compared both dtypes with every field made little-endian: a store whose array has
    little-endian fields and whose manifest says big-endian ones (the bytes read back swapped) passed."""
    native = np.dtype([("a", "<i4"), ("b", "<f8")])
    path = tmp_path / "s.zarr"
    zs.write_store(path, {1: _values(native)}, [VarInfo.of(1, "x", _values(native))], {})
    manifest = json.loads((path / zs.MANIFEST).read_text())
    manifest["vars"][0]["dtype"] = VarInfo.of(1, "x", _values(BE_FIELDS)).to_json()["dtype"]
    (path / zs.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="the manifest says"):
        zs.verify_store(path)


# --- 6: ftidask's own stores: a chunk file is one Zstd frame ---------------------------------------------------


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("data", [b"", bytes(1000), bytes(range(256)) * 4000, os.urandom(300_000)],
                         ids=["empty", "zeros", "pattern", "random"])
def test_zstd_frame_size_is_the_size_of_every_frame_zarr_writes(data, checksum):
    from zarr.codecs import ZstdCodec

    from ftidask.zarrfmt.chunkfile import zstd_frame_size

    codec = ZstdCodec(level=3, checksum=checksum)._zstd_codec  # numcodecs' Zstd, as Zarr writes with it
    frame = codec.encode(np.frombuffer(data, np.uint8))
    assert zstd_frame_size(io.BytesIO(frame), len(frame)) == len(frame)
    assert zstd_frame_size(io.BytesIO(frame + frame), 2 * len(frame)) == len(frame)
    assert zstd_frame_size(io.BytesIO(frame[:-1]), len(frame) - 1) is None


def test_a_second_zstd_frame_after_a_chunk_is_refused_before_it_is_decoded(tmp_path):
    """A chunk's own frame (its header declaring exactly a chunk) followed by a bomb frame, hashes resealed:
    numcodecs decoded both frames (a frame of 40 KiB: 1 GiB); refused from the frames' headers."""
    path = tmp_path / "s.zarr"
    info = VarInfo.of(1, "v", np.zeros(4096), codec={"id": "zstd", "level": 3})
    zs.write_store(path, {1: np.zeros(4096)}, [info], {})
    (chunk,) = [p for p in (path / "v").rglob("*") if p.is_file() and p.name != "zarr.json"]
    chunk.write_bytes(chunk.read_bytes() + numcodecs.Zstd(level=3).encode(bytes(8 << 20)))
    manifest = json.loads((path / zs.MANIFEST).read_text())
    manifest["files"] = {rel: list(zs._file_digest(full)) for rel, full in zs._walk(path)}
    (path / zs.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="does not decode as one zstd frame"):
        zs.verify_store(path)


# --- 3, 4, 5, 7: foreign stores ------------------------------------------------------------------------------


def _meta(shape, chunks, dtype="float64", codecs=None, fill=0.0, sep="/"):
    return {"zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": sep}}, "fill_value": fill,
            "codecs": codecs or [{"name": "bytes", "configuration": {"endian": "little"}}], "attributes": {}}


def _foreign(path: Path, **arrays: dict) -> Path:
    path.mkdir(parents=True)
    (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for name, meta in arrays.items():
        (path / name).mkdir()
        (path / name / "zarr.json").write_text(json.dumps(meta))
    return path


def test_a_foreign_chunk_directory_linked_to_a_fifo_is_refused_not_read(tmp_path):
    """os.walk did not enter a linked directory: its FIFO chunk blocked Zarr's read for ever."""
    store = _foreign(tmp_path / "s.zarr", a=_meta([8], [8]))
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.mkfifo(other / "0")
    os.symlink(other, store / "a" / "c")

    def unblock():  # on code that opens the FIFO: let its read end (then the test fails, never hangs)
        time.sleep(3)
        try:
            fd = os.open(other / "0", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    threading.Thread(target=unblock, daemon=True).start()
    with pytest.raises(FormatError, match="symbolic link"):
        read_zarr(store)


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_foreign_chunk_behind_a_link_is_refused(tmp_path, what):
    """A linked chunk directory (or file) was never walked: a sparse file of gigabytes there skipped the size
    limit. Here the linked chunk is a plain one: it was read."""
    store = _foreign(tmp_path / "s.zarr", a=_meta([8], [8]))
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "0").write_bytes(np.arange(8.0).tobytes())
    if what == "directory":
        os.symlink(other, store / "a" / "c")
    else:
        (store / "a" / "c").mkdir()
        os.symlink(other / "0", store / "a" / "c" / "0")
    with pytest.raises(FormatError, match="symbolic link"):
        read_zarr(store)


def test_a_foreign_grid_of_millions_of_missing_chunks_reads_only_the_chunks_stored(tmp_path):
    """2**22 chunks of one element, two of them stored: Zarr ran one task per chunk (minutes; 2**32: days)."""
    store = _foreign(tmp_path / "s.zarr", a=_meta([1 << 22], [1], dtype="uint8", fill=7))
    (store / "a" / "c").mkdir()
    (store / "a" / "c" / "5").write_bytes(b"\x01")
    (store / "a" / "c" / "4194303").write_bytes(b"\x02")
    start = time.monotonic()
    ((name, got),) = read_zarr(store).values()
    assert time.monotonic() - start < 10
    expected = np.full(1 << 22, 7, np.uint8)
    expected[5], expected[-1] = 1, 2
    assert name == "a" and np.array_equal(got, expected)


def test_a_foreign_zstd_chunk_declaring_more_than_a_chunk_is_refused_before_it_is_decoded(tmp_path):
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}},
              {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]
    store = _foreign(tmp_path / "s.zarr", a=_meta([8192], [8192], codecs=codecs), b=_meta([8192], [8192],
                                                                                          codecs=codecs))
    for name in "ab":
        (store / name / "c").mkdir()
    (store / "a" / "c" / "0").write_bytes(numcodecs.Zstd(level=3).encode(bytes(64 << 20)))
    real = numcodecs.Zstd(level=3).encode(np.arange(8192.0).tobytes())
    (store / "b" / "c" / "0").write_bytes(real + numcodecs.Zstd(level=3).encode(bytes(64 << 20)))
    with pytest.raises(FormatError, match="declares 67108864 raw bytes"):
        read_zarr(store)
    shutil.rmtree(store / "a")
    with pytest.raises(FormatError, match="does not decode as one zstd frame"):
        read_zarr(store)
    (store / "b" / "c" / "0").write_bytes(real)
    assert read_zarr(store)[1][1].tobytes() == np.arange(8192.0).tobytes()


@pytest.mark.parametrize("kind", ["vlen-bytes", "gzip", "chunks-larger-than-shape"])
def test_a_foreign_array_whose_decoded_size_is_unknown_is_refused(tmp_path, kind):
    """A vlen chunk of 68 bytes declaring 2**26 items made numcodecs allocate them; a codec whose output is
    known only by decoding it, or a chunk larger than its array, is refused before any chunk is read."""
    if kind == "vlen-bytes":
        meta = _meta([8], [8], dtype="bytes", codecs=[{"name": "vlen-bytes"}], fill="")
    elif kind == "gzip":
        meta = _meta([8], [8], codecs=[{"name": "bytes", "configuration": {"endian": "little"}},
                                       {"name": "gzip", "configuration": {"level": 1}}])
    else:
        meta = _meta([8], [1 << 30])
    store = _foreign(tmp_path / "s.zarr", a=meta)
    (store / "a" / "c").mkdir()
    (store / "a" / "c" / "0").write_bytes((1 << 26).to_bytes(4, "little") + b"\xff" * 64)
    with pytest.raises(FormatError, match="not imported|larger than its shape"):
        read_zarr(store)


def test_foreign_stores_zarr_writes_are_read(tmp_path):
    """What the checks above must not refuse: Zarr v3 (default Zstd, Blosc, none, '.' keys, missing chunks, a 0-d
    array) and v2 (Blosc, Zstd, none, '/' keys, Fortran order)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = zarr.open_group(str(tmp_path / "v3.zarr"), mode="w")
        data = np.arange(60.0).reshape(6, 10)
        g.create_array("auto", shape=(6, 10), chunks=(4, 3), dtype="f8")[...] = data
        g.create_array("blosc", shape=(6, 10), chunks=(4, 3), dtype="f8",
                       compressors=zarr.codecs.BloscCodec(cname="lz4"))[...] = data
        g.create_array("raw", shape=(6, 10), chunks=(4, 3), dtype=">f8", compressors=None,
                       chunk_key_encoding={"name": "default", "separator": "."})[...] = data
        sparse = g.create_array("sparse", shape=(50,), chunks=(1,), dtype="i2", fill_value=-1)
        sparse[3] = 9
        g.create_array("scalar", shape=(), dtype="i4")[...] = 5
        g2 = zarr.open_group(str(tmp_path / "v2.zarr"), mode="w", zarr_format=2)
        g2.create_array("blosc", shape=(6, 10), chunks=(4, 3), dtype="f8", compressors=numcodecs.Blosc())[...] = data
        g2.create_array("zstd", shape=(6, 10), chunks=(4, 3), dtype="f8", compressors=numcodecs.Zstd(),
                        chunk_key_encoding={"name": "v2", "separator": "/"})[...] = data
        g2.create_array("raw", shape=(6, 10), chunks=(4, 3), dtype="<i8", compressors=None, order="F")[...] = data
    got = {name: a for name, a in read_zarr(tmp_path / "v3.zarr").values()}
    assert all(np.array_equal(got[n], data) for n in ("auto", "blosc", "raw"))
    assert got["sparse"].tolist() == [-1] * 3 + [9] + [-1] * 46 and got["scalar"] == 5
    got = {name: a for name, a in read_zarr(tmp_path / "v2.zarr").values()}
    assert all(np.array_equal(got[n], data) for n in ("blosc", "zstd", "raw"))


def test_foreign_ids_are_the_ones_the_store_asked_for(tmp_path):
    """'aux' (no id) took id 1 in name order, moving 'u' (ftidask_id 1) to 2: recover() filled u with aux."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
        g.create_array("u", shape=(2,), dtype="f8", attributes={"ftidask_id": 1, "ftidask_name": "u"})[:] = 1
        g.create_array("v", shape=(2,), dtype="f8", attributes={"ftidask_id": 2})[:] = 2
        g.create_array("aux", shape=(2,), dtype="f8")[:] = 9
        g.create_array("more", shape=(2,), dtype="f8")[:] = 8
    got = {vid: (name, a.tolist()) for vid, (name, a) in read_zarr(tmp_path / "s.zarr").items()}
    assert got == {1: ("u", [1, 1]), 2: ("v", [2, 2]), 3: ("aux", [9, 9]), 4: ("more", [8, 8])}


@pytest.mark.parametrize("attrs, said", [({"ftidask_id": True}, "not a variable id"),
                                         ({"ftidask_id": 2**40}, "not a variable id"),
                                         ({"ftidask_id": "1"}, "not a variable id"),
                                         ({"ftidask_id": 1}, "both have ftidask_id 1"),
                                         ({"ftidask_name": {"x": 1}}, "is not a string")])
def test_foreign_ids_and_names_that_are_none_are_refused(tmp_path, attrs, said):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
        g.create_array("a", shape=(2,), dtype="f8", attributes=attrs)[:] = 1
        g.create_array("b", shape=(2,), dtype="f8", attributes={"ftidask_id": 1})[:] = 2
    with pytest.raises(FormatError, match=said):
        read_zarr(tmp_path / "s.zarr")


@pytest.mark.parametrize(("fmt", "shape", "chunks", "resize"), [
    (3, (5,), (10,), None), (2, (5,), (10,), None), (3, (100,), (40,), (30,)), (2, (3, 7), (4, 4), None)])
def test_chunks_larger_than_a_small_array_are_read(tmp_path, fmt, shape, chunks, resize):
    """Legal Zarr that a first bound (each chunk dimension at most the array's) refused: a small array, one shrunk
    after it was written, edge chunks. A chunk's bytes are bounded instead (the array's, or 64 MiB)."""
    import zarr

    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=fmt)
    z = group.create_array("a", shape=shape, chunks=chunks, dtype="f8")
    z[...] = np.arange(np.prod(shape), dtype="f8").reshape(shape)
    if resize:
        z.resize(resize)
    expected = z[...]
    ((name, got),) = read_zarr(tmp_path / "s.zarr").values()
    assert name == "a" and got.tobytes() == expected.tobytes()
