"""Forged and planted files in a level-4 Zarr store (found by a review of session 57): chunk keys of another encoding
escaped the chunk checks, Zarr's probe of v2 metadata names opened files no manifest lists (a FIFO blocked the
restart for ever), two variables of one array recovered memory never written, and a listed file that is no chunk was
hashed whatever its size. Each is refused now (or never opened), the arrays untouched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_hostile_reads3 import N, _manifest, _refused, _reseal, _zarr_checkpoint

import ftidask
from ftidask.model.errors import FormatError, NoCheckpointError
from ftidask.tools.zarr_export import read_zarr

pytest.importorskip("zarr")


def _uncompressed(store: Path, encoding: dict | None, cut: int) -> None:
    """Variable 1's array rewritten uncompressed, its chunk keys of ``encoding``, each chunk file ``cut`` bytes
    short; the root's consolidated metadata along."""
    import zarr

    values = zarr.open_array(str(store / "v"), mode="r")[...]
    meta = json.loads((store / "v" / "zarr.json").read_text())
    meta["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if encoding is not None:
        meta["chunk_key_encoding"] = encoding
    (store / "v" / "zarr.json").write_text(json.dumps(meta))
    root = json.loads((store / "zarr.json").read_text())
    if root.get("consolidated_metadata"):
        root["consolidated_metadata"]["metadata"]["v"] = meta
        (store / "zarr.json").write_text(json.dumps(root))
    for chunk in sorted((store / "v" / "c").rglob("*"), reverse=True):
        chunk.unlink() if chunk.is_file() else chunk.rmdir()
    (store / "v" / "c").rmdir()
    z = zarr.open_array(str(store / "v"), mode="r")
    step = z.chunks[0]
    for i in range(-(-N // step)):
        dest = store / "v" / z.metadata.encode_chunk_key((i,))
        dest.parent.mkdir(parents=True, exist_ok=True)
        raw = values[i * step:(i + 1) * step].astype("<f8").tobytes().ljust(8 * step, b"\0")
        dest.write_bytes(raw[:len(raw) - cut])


def _recovers(dirs: dict) -> None:
    """A restart recovers the store's checkpoint, ``arange(N)``, bit for bit."""
    ctx = ftidask.init(**dirs, l4_format="zarr")
    out = np.full(N, -1.0)
    ctx.protect(1, out)
    ctx.recover()
    assert np.array_equal(out, np.arange(float(N)))
    ctx._close()


@pytest.mark.parametrize("encoding", [{"name": "default", "configuration": {"separator": "."}},
                                      {"name": "v2", "configuration": {"separator": "."}}])
def test_a_short_uncompressed_chunk_under_another_key_encoding_is_damage(dirs, encoding):
    """Only keys ``c/...`` were size-checked; an uncompressed chunk is hashed, never decoded: a chunk one element
    short under ``c.0`` or ``0`` passed verification and failed while loading, after the arrays were written."""
    store = _zarr_checkpoint(dirs)
    _uncompressed(store, encoding, 8)
    _reseal(dirs, store)
    _refused(dirs, store, "not a chunk's")


def test_the_same_chunks_whole_are_recovered(dirs):
    """The control: whole chunks under another key encoding are a sound store (Zarr reads them)."""
    store = _zarr_checkpoint(dirs)
    _uncompressed(store, {"name": "v2", "configuration": {"separator": "."}}, 0)
    _reseal(dirs, store)
    _recovers(dirs)


def test_a_codec_bomb_under_another_key_encoding_is_refused_before_it_is_decoded(dirs):
    from numcodecs import Zstd

    store = _zarr_checkpoint(dirs)
    meta = json.loads((store / "v" / "zarr.json").read_text())
    meta["chunk_key_encoding"] = {"name": "v2", "configuration": {"separator": "."}}
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [N]
    (store / "v" / "zarr.json").write_text(json.dumps(meta))
    for chunk in sorted((store / "v" / "c").iterdir()):
        chunk.unlink()
    (store / "v" / "c").rmdir()
    (store / "v" / "0").write_bytes(Zstd(level=1).encode(bytes(64 << 20)))
    _reseal(dirs, store)
    _refused(dirs, store, f"declares {64 << 20} raw bytes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [".zarray", ".zattrs"])
def test_a_fifo_at_a_v2_metadata_name_is_never_opened(dirs, name):
    """Zarr probed v2's metadata names too, through the verified store, which read a file before it asked the
    manifest: a FIFO there blocked recover() and ``ftidask import`` for ever. A store is opened as Zarr v3 now, and
    a file the manifest does not list is never opened: the planted FIFO changes nothing."""
    store = _zarr_checkpoint(dirs)
    os.mkfifo(store / "v" / name)
    _recovers(dirs)
    (only,) = read_zarr(store).values()
    assert np.array_equal(only[1], np.arange(float(N)))


def test_two_variables_of_one_array_are_damage(dirs):
    """Two manifest entries naming one array: one buffer was filled, the other (fresh pages, or a copy of an
    array in use) recovered as it was, memory never written, with no error."""
    ctx = ftidask.init(**dirs, l4_format="zarr")
    ctx.protect(1, np.arange(float(N)), name="v")
    ctx.protect(2, np.arange(float(N)) + 1, name="w")
    ctx.checkpoint(1, 4)
    ctx._close()
    (store,) = Path(dirs["glbl_dir"]).glob("**/Ckpt1-Rank0.zarr")
    manifest = _manifest(store)
    second = next(e for e in manifest["vars"] if e["array"] != "v")
    second["array"] = "v"
    _reseal(dirs, store, manifest)
    ctx = ftidask.init(**dirs, l4_format="zarr")
    outs = [np.full(N, -1.0), np.full(N, -1.0)]
    ctx.protect(1, outs[0])
    ctx.protect(2, outs[1])
    with pytest.raises(NoCheckpointError, match="to two variables"):
        ctx.recover()
    assert all((o == -1).all() for o in outs)
    with pytest.raises(FormatError, match="to two variables"):
        read_zarr(store)


def test_a_listed_file_that_is_no_chunk_is_bounded(dirs):
    """A file of holes larger than any record at the store's root, listed and resealed: hashed whole at each restart
    (1.3 s for 4 GiB here, hours for terabytes). A file that is no array's chunk is metadata: refused above any
    record's size, unread."""
    store = _zarr_checkpoint(dirs)
    with open(store / "notes", "wb") as fh:
        fh.truncate((256 << 20) + 1)
    manifest = _manifest(store)
    _reseal(dirs, store, manifest)
    _refused(dirs, store, "no chunk of an array")
