"""Hostile inputs found in review: damaged tables, commit records and API misuse give ftidask errors."""

import dataclasses
import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine.runstate import seal_json
from ftidask.ftiff import hashing
from ftidask.ftiff.reader import parse_ftiff
from ftidask.ftiff.structs import FileBlock
from ftidask.ftiff.trailer import pack_trailer
from ftidask.tools.cli import main as cli_main


def _checkpoint(dirs, level=1):
    """One checkpoint of one float64 array; (its file, the array's values)."""
    ctx = ftidask.init(**dirs)
    values = np.arange(100.0)
    ctx.protect(1, values.copy())
    info = ctx.checkpoint(1, level)
    (path,) = Path(dirs["ckpt_dir" if level < 4 else "glbl_dir"]).glob(f"**/ckpt1.s{info.seq}/Ckpt1-Rank0.fti")
    return path, values


def _rewrite_table(path: Path, payload: bytes) -> None:
    """Replace a file's variable table by ``payload`` and reseal the metadata checksum and FB hash, so
    that only the table itself is hostile (as a forged file would be). A dCP file keeps its section."""
    raw = path.read_bytes()
    fb = FileBlock.unpack(raw[:96])
    start = len(raw) - 16 - struct.unpack("<Q", raw[-16:-8])[0]
    tail = pack_trailer(payload)
    hasher = hashing.new_hasher(fb.hash_id)
    offset = 96
    while offset < fb.fs:
        numvars, dbsize = struct.unpack("<iq", raw[offset:offset + 12])
        hasher.update(raw[offset:offset + 12 + 64 * numvars])
        offset += dbsize
    hasher.update(tail)
    sealed = dataclasses.replace(fb, checksum=hasher.hexdigest()[:32]).sealed()
    path.write_bytes(sealed.pack() + raw[96:start] + tail)


def _table(path: Path) -> dict:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[-16:-8])[0]
    return json.loads(raw[len(raw) - 16 - length:len(raw) - 16])


def test_table_with_a_huge_integer_is_a_format_error(dirs, capsys):
    """json.loads refuses integers of more than 4300 digits with a ValueError (not a JSONDecodeError)."""
    path, _values = _checkpoint(dirs)
    _rewrite_table(path, b'{"vars":[],"x":' + b"9" * 5000 + b"}")
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="not valid JSON"):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    assert cli_main(["inspect", str(path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("seq", None), ("ckpt_id", "x"), ("level", 1.5), ("rank", True),
                                          ("exec_id", ["a"]), ("time", "noon"), ("time", 1e308),
                                          ("time", float("nan"))])
def test_table_header_of_the_wrong_type_is_damage(dirs, capsys, field, value):
    """``list`` and ``export`` formatted these fields as they were (int(), time.localtime()): a forged
    table with valid hashes crashed them with a traceback."""
    path, values = _checkpoint(dirs)
    table = _table(path)
    table[field] = value
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match=f"'{field}'"):
        parse_ftiff(fh, str(path))
    root = str(Path(dirs["ckpt_dir"]).parent)
    assert cli_main(["list", root]) == 0
    assert "DAMAGED (1 of 1 files)" in capsys.readouterr().out
    assert cli_main(["export", str(path), "--to-zarr", str(Path(root) / "out.zarr")]) == 2
    assert f"'{field}'" in capsys.readouterr().err


@pytest.mark.parametrize("shape, dtype", [([100] + [1] * 70, "<f8"),
                                          ([100] + [1] * 50, {"base": "<f8", "shape": [1] * 20})])
def test_table_with_more_dimensions_than_numpy_has_is_damage(dirs, capsys, shape, dtype):
    """A shape NumPy cannot make (more than 64 dimensions, sub-array ones included) passed the table's
    checks and failed later in np.empty with a ValueError (``export`` showed a traceback). (A sub-array of
    at most 32 dimensions: NumPy 1.26 refuses a longer one in the dtype itself, before any shape is made.)"""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    table["vars"][0].update(shape=shape, dtype=dtype)
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="dimensions"):
        parse_ftiff(fh, str(path))
    assert cli_main(["export", str(path), "--to-zarr", str(Path(dirs["ckpt_dir"]) / "out.zarr")]) == 2
    assert "dimensions" in capsys.readouterr().err


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="NumPy 1.x takes the alias without a warning")
def test_table_with_a_deprecated_dtype_alias_is_damage_where_warnings_are_errors(dirs):
    """NumPy warns of the alias "a3" (never written by ftidask): where warnings are errors (python -W error, a
    test run's filterwarnings) the DeprecationWarning left the parser raw instead of a FormatError."""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    table["vars"][0].update(dtype="a8")
    _rewrite_table(path, json.dumps(table).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="dtype"):
            parse_ftiff(fh, str(path))


@pytest.mark.parametrize("change", [{"seq": float("inf")}, {"seq": 1e300}, {"ckpt_id": float("-inf")},
                                    {"timestamp": float("inf")}, {"timestamp": float("nan")}, {"nranks": 0},
                                    {"files": []}, {"level": 0}, {"level": 99}, {"ckpt_id": 0}, {"ckpt_id": 2**40},
                                    {"files": [{"rank": 5, "node": 0, "size": 1, "fb_hash": "00"}]}])
def test_forged_commit_record_is_ignored_like_a_torn_one(dirs, capsys, change):
    """A commit record with values no commit holds (JSON's Infinity made int() raise OverflowError, which
    failed the whole init) is ignored: the previous checkpoint is recovered, ``list`` shows no traceback."""
    ctx = ftidask.init(**dirs)
    a = np.arange(100.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 1)
    (record,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    raw = json.loads(record.read_text())
    raw.update(change)
    record.write_text(json.dumps(seal_json(raw)))  # a forgery: its digest matches, its values are impossible
    ctx = ftidask.init(**dirs)
    b = np.full(100, -1.0)
    ctx.protect(1, b)
    assert ctx.status() == 1
    ctx.recover()
    assert ctx.recovered_from == (1, 4) and (b == np.arange(100.0)).all()
    assert cli_main(["list", str(Path(dirs["meta_dir"]).parent)]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("key", ["block_size", "block_hash_id", "section_len"])
def test_dcp_entry_with_an_infinite_number_is_damage(dirs, capsys, key):
    """JSON's Infinity in the table's 'dcp' entry made int() raise OverflowError out of parse_ftiff
    (a traceback from inspect, verify and list)."""
    ctx = ftidask.init(**dirs, enable_dcp=1, dcp_block_size=512)
    ctx.protect(1, np.arange(1000.0))
    info = ctx.checkpoint(1, 5)
    (path,) = Path(dirs["ckpt_dir"]).glob(f"**/ckpt1.s{info.seq}/Ckpt1-Rank0.fti")
    table = _table(path)
    table["dcp"][key] = float("inf")
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="invalid 'dcp' entry"):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def _forge_container(path: Path, var_id: int, data: bytes) -> str:
    """Overwrite the start of ``var_id``'s container in a one-block file with ``data`` and reseal its hash,
    the metadata checksum and the FB hash (a forged file: every hash matches); the new FB hash (hex)."""
    from ftidask.ftiff.structs import ContainerMeta

    raw = bytearray(path.read_bytes())
    fb = FileBlock.unpack(bytes(raw[:96]))
    numvars = struct.unpack("<i", raw[96:100])[0]
    for i in range(numvars):
        at = 108 + 64 * i
        meta = ContainerMeta.unpack(bytes(raw[at:at + 64]))
        if meta.id == var_id:
            raw[meta.fptr:meta.fptr + len(data)] = data
            digest = hashing.digest(fb.hash_id, bytes(raw[meta.fptr:meta.fptr + meta.chunksize]))
            raw[at:at + 64] = dataclasses.replace(meta, hash=digest).pack()
    hasher = hashing.new_hasher(fb.hash_id)
    hasher.update(bytes(raw[96:108 + 64 * numvars]) + bytes(raw[fb.fs:]))
    sealed = dataclasses.replace(fb, checksum=hasher.hexdigest()[:32]).sealed()
    path.write_bytes(sealed.pack() + bytes(raw[96:]))
    return sealed.hash.hex()


def forge_committed(dirs: dict, seq: int, var_id: int, data: bytes) -> Path:
    """:func:`_forge_container` on the one-rank checkpoint ``seq`` of checkpoint id 1, its commit record resealed
    to the new FB hash: a forged checkpoint that recovery takes as committed. The file's path."""
    (path,) = Path(dirs["ckpt_dir"]).glob(f"**/ckpt1.s{seq}/Ckpt1-Rank0.fti")
    fb_hash = _forge_container(path, var_id, data)
    (record,) = Path(dirs["meta_dir"]).glob(f"*/commits/s{seq:08d}.json")
    raw = json.loads(record.read_text())
    raw["files"][0]["fb_hash"] = fb_hash
    record.write_text(json.dumps(seal_json(raw)))
    return path


def test_compressed_container_that_does_not_decode_touches_no_array(dirs, capsys):
    """A compressed container whose hash matches but whose bytes do not decode was found only while the
    arrays were filled: the variables copied before it were recovered, the others not (a partial
    recovery), and ``verify`` said OK. It is now damage found with the hashes: nothing is touched."""
    ctx = ftidask.init(**dirs, compressor="zstd")
    ctx.protect(1, np.zeros(10_000))
    ctx.protect(2, np.zeros(10_000))
    path = forge_committed(dirs, ctx.checkpoint(1, 1).seq, 2, bytes(16))
    assert cli_main(["verify", str(path)]) == 1
    assert "cannot be decoded" in capsys.readouterr().out
    refused_untouched(dirs, "cannot be decoded")


def refused_untouched(dirs: dict, match: str) -> None:
    """A restart that protects ids 1 and 2 (10,000 float64 each) cannot recover (``match``); both untouched."""
    ctx = ftidask.init(**dirs)
    a, b = np.full(10_000, -1.0), np.full(10_000, -1.0)
    ctx.protect(1, a)
    ctx.protect(2, b)
    with pytest.raises(ftidask.NoCheckpointError, match=match):
        ctx.recover()
    assert (a == -1).all() and (b == -1).all()


@pytest.mark.parametrize("extra", [{"codec": {"id": "zstd", "level": 1, "foo": 1}},
                                   {"codec": {"id": "zstd", "level": float("inf")}},
                                   {"codec": {"id": "blosc", "cname": "nope", "clevel": 5}},
                                   {"codec": {"id": "zstd", "level": 1}, "codec_plain": [float("inf")]}])
def test_codec_record_that_numcodecs_refuses_is_damage(dirs, capsys, extra):
    """A codec record with an unknown key (numcodecs raised TypeError), an infinite number (OverflowError
    in int()) or a parameter out of range was not checked as a user's config is: a raw traceback from
    inspect, verify, list and export, a wrapped TypeError in recovery."""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    table["vars"][0]["extra"] = extra
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError):
        parse_ftiff(fh, str(path))
    assert cli_main(["inspect", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert cli_main(["verify", str(path)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_user_codec_config_errors_stay_config_errors(dirs):
    with pytest.raises(ftidask.ConfigError):
        ftidask.init(**dirs, compressor={"id": "zstd", "level": 1, "foo": 1})
    with pytest.raises(ftidask.ConfigError, match="cname"):
        ftidask.init(**dirs, compressor={"id": "blosc", "cname": "nope"})


@pytest.mark.parametrize("dask", [{"shape": [float("inf")], "chunks": [[100]], "kind": "numpy",
                                   "blocks": [[[0], [100], 0]]},
                                  {"shape": [100], "chunks": [[100]], "kind": "numpy", "blocks": [[[0], [100], -800]]},
                                  {"shape": [100], "chunks": [[60, 60]], "kind": "numpy",
                                   "blocks": [[[0], [60], 0], [[1], [60], 480]]}])
def test_export_of_a_forged_dask_chunk_record_is_refused(dirs, capsys, dask):
    """``export`` stitches Dask arrays from the table's chunk record: JSON's Infinity raised OverflowError, a
    negative dptr a ValueError in reshape, and a grid that does not tile the shape was not checked."""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    table["vars"][0]["extra"] = {"dask": dask}
    _rewrite_table(path, json.dumps(table).encode())
    assert cli_main(["export", str(path), "--to-zarr", str(Path(dirs["ckpt_dir"]) / "out.zarr")]) == 2
    err = capsys.readouterr().err
    assert "variable 1" in err and "Traceback" not in err


def test_export_of_a_dask_grid_of_a_million_chunks_is_refused_in_linear_time(dirs, capsys):
    """A forged grid of 10**6 empty chunks and one of the variable's 100 elements (a 2 MB table): each chunk's
    start was summed from the axis's start, 5 * 10**11 additions (100 000 chunks took half a minute); now one
    pass, and the record is refused for the chunks it does not place."""
    import time

    path, _values = _checkpoint(dirs)
    table = _table(path)
    n = 10**6
    table["vars"][0]["extra"] = {"dask": {"shape": [100], "chunks": [[0] * n + [100]], "kind": "numpy",
                                          "blocks": [[[n], [100], 0]]}}
    _rewrite_table(path, json.dumps(table).encode())
    # CPU time of this thread (the export's parsing runs here), not the wall clock: on a loaded 2-core machine the
    # wall clock measures the other processes too; a quadratic pass costs the CPU time all the same.
    start = time.thread_time()
    assert cli_main(["export", str(path), "--to-zarr", str(Path(dirs["ckpt_dir"]) / "out.zarr")]) == 2
    assert time.thread_time() - start < 20
    err = capsys.readouterr().err
    assert f"hold 1 of its {n + 1} chunks" in err and "Traceback" not in err


def test_block_record_with_an_infinite_number_is_a_format_error():
    """A restart on another number of ranks reads each file's block record (``global_shape``, ``offset``);
    JSON's Infinity there raised OverflowError instead of the FormatError every other bad record gives."""
    from ftidask.model.decomposition import placement

    table = json.loads('{"global_shape": [Infinity], "offset": [0]}')
    with pytest.raises(ftidask.FormatError, match="invalid block record"):
        placement(table, (100,))


@pytest.mark.parametrize("value", [2**20000, "\udcff", {"\udcff": 1}, [1, {"a": -(3**10000)}]],
                         ids=["huge-int", "surrogate", "surrogate-key", "nested-huge-int"])
def test_state_json_cannot_write_is_refused_at_protect(dirs, value):
    """JSON types that json.dumps/UTF-8 still refuse (an int beyond Python's 4300-digit text limit, a str
    with a lone surrogate) passed check_json and failed in json.dumps with a raw ValueError or
    UnicodeEncodeError; they are a ProtectError at protect, and at the checkpoint when set later."""
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ProtectError, match="int of|UTF-8"):
        ctx.protect(1, ftidask.State({"v": value}))
    state = ftidask.State({"v": 1})
    ctx.protect(1, state)
    ctx.checkpoint(1, 1)
    state["v"] = value
    with pytest.raises(ftidask.FTIError, match="int of|UTF-8"):
        ctx.checkpoint(2, 1)
    state["v"] = 2
    ctx.checkpoint(3, 1)


def _zarr_l4(dirs, **config):
    """A level-4 Zarr checkpoint of two variables; (its store, its commit record)."""
    ctx = ftidask.init(**dirs, l4_format="zarr", **config)
    ctx.protect(1, np.arange(100.0))
    ctx.protect(2, np.arange(50, dtype=np.int32))
    info = ctx.checkpoint(1, 4)
    (store,) = Path(dirs["glbl_dir"]).glob(f"*/l4/ckpt1.s{info.seq}/Ckpt1-Rank0.zarr")
    (record,) = Path(dirs["meta_dir"]).glob(f"*/commits/s{info.seq:08d}.json")
    return store, record


def _forge_manifest(store: Path, record: Path, change) -> None:
    """Change the store's manifest and record its new digest in the commit record (every hash matches)."""
    manifest_path = store / "ftidask-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    manifest_path.write_text(json.dumps(manifest))
    raw = json.loads(record.read_text())
    raw["files"][0]["fb_hash"] = hashing.digest(2, manifest_path.read_bytes()).hex()
    record.write_text(json.dumps(seal_json(raw)))


@pytest.mark.parametrize("how", ["missing array", "other array", "other dtype"])
def test_zarr_manifest_that_does_not_match_its_arrays_touches_no_array(dirs, how):
    """A manifest whose variable names an array that is not there, or another array, was found only while
    the arrays were filled: the variables read before it were recovered and the others not."""
    store, record = _zarr_l4(dirs)

    def change(manifest):
        second = next(v for v in manifest["vars"] if v["id"] == 2)
        first = next(v for v in manifest["vars"] if v["id"] == 1)
        if how == "missing array":
            second["array"] = "nothere"
        elif how == "other array":  # var 2 (int32, 50) pointed at var 1's array (float64, 100)
            second["array"] = first["array"]
        else:
            second.update(dtype="<f4")
    _forge_manifest(store, record, change)
    _assert_recovery_touches_nothing(dirs, np.int32 if how != "other dtype" else np.float32)


def _assert_recovery_touches_nothing(dirs, second_dtype=np.int32):
    """A restart of ``_zarr_l4``'s run fails and leaves both protected arrays as they were."""
    ctx = ftidask.init(**dirs)
    a, b = np.full(100, -1.0), np.full(50, -1, second_dtype)
    ctx.protect(1, a)
    ctx.protect(2, b)
    with pytest.raises(ftidask.FTIError):
        ctx.recover()
    assert (a == -1).all() and (b == -1).all()


def test_zarr_manifest_entry_outside_the_store_is_never_read(dirs, tmp_path):
    """'../x' was refused but an absolute entry ('/etc/passwd', a FIFO that would block) was opened and
    hashed: a store's manifest names files inside the store only."""
    store, record = _zarr_l4(dirs)
    outside = tmp_path / "fifo"
    __import__("os").mkfifo(outside)  # opening it for reading would block forever
    _forge_manifest(store, record, lambda m: m["files"].update({str(outside): [0, "00" * 16]}))
    from ftidask.zarrfmt.store import verify_store

    with pytest.raises(ftidask.FormatError, match="bad manifest entry"):
        verify_store(store)


@pytest.mark.parametrize("attrs", [[1], {"ftidask": [1]}, {"ftidask": {"seq": "x"}}, {"ftidask": {"time": 1e308}}])
def test_zarr_manifest_attrs_of_the_wrong_type_are_damage(dirs, capsys, attrs):
    """``list`` and ``export`` read a store's description from attrs["ftidask"] with .get(), int() and
    time.localtime(): attrs of another type crashed them with a traceback."""
    store, record = _zarr_l4(dirs)
    _forge_manifest(store, record, lambda m: m.update(attrs=attrs))
    root = Path(dirs["glbl_dir"]).parent
    assert cli_main(["list", str(root)]) == 0
    assert "DAMAGED (1 of 1 files)" in capsys.readouterr().out
    assert cli_main(["export", str(store), "--to-zarr", str(root / "out.zarr")]) == 2
    assert "ftidask-manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("compressor", ["zstd", "none"])
def test_zarr_chunk_that_does_not_decode_touches_no_array(dirs, compressor):
    """A chunk whose digest the manifest matches but whose bytes do not decode (a compressed chunk of
    garbage, an uncompressed one of the wrong length) was found only while recovery filled the arrays."""
    store, record = _zarr_l4(dirs, compressor=compressor)
    manifest = json.loads((store / "ftidask-manifest.json").read_text())
    second = next(v["array"] for v in manifest["vars"] if v["id"] == 2)
    (chunk,) = [rel for rel in manifest["files"] if rel.startswith(f"{second}/c/")]
    garbage = b"not a chunk of anything"
    (store / chunk).write_bytes(garbage)

    def forge(m):
        m["files"][chunk] = [len(garbage), hashing.digest(2, garbage).hex()]
    _forge_manifest(store, record, forge)
    from ftidask.zarrfmt.store import verify_store

    with pytest.raises(ftidask.FormatError, match="does not decode|not a chunk"):
        verify_store(store)
    _assert_recovery_touches_nothing(dirs)


def test_table_listing_a_variable_twice_is_damage(dirs, capsys):
    """Two entries for one id (say, of other dtypes): which one the data is cannot be told, so neither."""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    twin = dict(table["vars"][0], dtype="<i8")
    table["vars"].append(twin)
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="twice"):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
    assert "twice" in capsys.readouterr().out
