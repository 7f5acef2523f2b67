"""Hostile inputs found in review: damaged tables, commit records and API misuse give ftidask errors."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import ftidask
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
    """Replace a one-block file's variable table by ``payload`` and reseal the metadata checksum and FB
    hash, so that only the table itself is hostile (as a forged file would be)."""
    raw = path.read_bytes()
    fb = FileBlock.unpack(raw[:96])
    numvars = struct.unpack("<i", raw[96:100])[0]
    tail = pack_trailer(payload)
    hasher = hashing.new_hasher(fb.hash_id)
    hasher.update(raw[96:96 + 12 + 64 * numvars] + tail)
    sealed = FileBlock(hasher.hexdigest()[:32], bytes(16), fb.ckpt_size, fb.fs, fb.max_fs, fb.pt_fs,
                       fb.timestamp).sealed()
    path.write_bytes(sealed.pack() + raw[96:fb.fs] + tail)


def _table(path: Path) -> dict:
    raw = path.read_bytes()
    fb = FileBlock.unpack(raw[:96])
    length = struct.unpack("<Q", raw[-16:-8])[0]
    return json.loads(raw[fb.fs:fb.fs + length])


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
                                          ([100] + [1] * 40, {"base": "<f8", "shape": [1] * 40})])
def test_table_with_more_dimensions_than_numpy_has_is_damage(dirs, capsys, shape, dtype):
    """A shape NumPy cannot make (more than 64 dimensions, sub-array ones included) passed the table's
    checks and failed later in np.empty with a ValueError (``export`` showed a traceback)."""
    path, _values = _checkpoint(dirs)
    table = _table(path)
    table["vars"][0].update(shape=shape, dtype=dtype)
    _rewrite_table(path, json.dumps(table).encode())
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="dimensions"):
        parse_ftiff(fh, str(path))
    assert cli_main(["export", str(path), "--to-zarr", str(Path(dirs["ckpt_dir"]) / "out.zarr")]) == 2
    assert "dimensions" in capsys.readouterr().err


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
    record.write_text(json.dumps(raw))
    ctx = ftidask.init(**dirs)
    b = np.full(100, -1.0)
    ctx.protect(1, b)
    assert ctx.status() == 1
    ctx.recover()
    assert ctx.recovered_from == (1, 4) and (b == np.arange(100.0)).all()
    assert cli_main(["list", str(Path(dirs["meta_dir"]).parent)]) == 0
    capsys.readouterr()
