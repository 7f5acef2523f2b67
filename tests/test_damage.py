"""Damaged files: recovery falls back to an older checkpoint or fails clearly, never returns wrong data."""

import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.tools.cli import main as cli_main


def _two_checkpoints(dirs):
    """An L4 checkpoint (values 4) then a newer L1 one (values 1); the L1 file's path."""
    ctx = ftidask.init(**dirs)
    a = np.full(50_000, 4.0)
    b = np.full((30, 7), 4, np.int32)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 4)
    a[:] = 1.0
    b[:] = 1
    b2 = np.full(12_000, 1, np.int32)  # grows var 2 so the L1 file has two blocks
    ctx.protect(2, b2)
    info = ctx.checkpoint(2, 1)
    (l1,) = Path(dirs["ckpt_dir"]).glob(f"node0/*/l1/ckpt2.s{info.seq}/Ckpt2-Rank0.fti")
    (l4,) = Path(dirs["glbl_dir"]).glob("*/l4/ckpt1.s1/Ckpt1-Rank0.fti")
    return l1, l4


def _recover(dirs):
    ctx = ftidask.init(**dirs)
    a = np.full(50_000, -7.0)
    ctx.protect(1, a)
    # The protected size of var 2 differs between the checkpoints: ask for it, as FTI codes do.
    b = ctx.realloc(2, np.zeros(1, np.int32))
    b[...] = -7
    try:
        ctx.recover()
    except ftidask.NoCheckpointError:
        assert (a == -7).all() and (b == -7).all(), "arrays touched by a failed recovery"
        raise
    return ctx, a, b


def _offsets(size):
    # FB fields, the first block's metadata and containers, data, the variable table and the very end.
    return sorted({0, 10, 40, 50, 52, 56, 64, 72, 80, 90, 96, 100, 110, 130, 150, 160, 170, 300, 5000,
                   size // 2, size - 200, size - 40, size - 17, size - 9, size - 1})


def test_flip_bytes_anywhere_falls_back(dirs):
    l1, _l4 = _two_checkpoints(dirs)
    original = l1.read_bytes()
    hits = 0
    for offset in _offsets(len(original)):
        damaged = bytearray(original)
        damaged[offset] ^= 0x5A
        l1.write_bytes(bytes(damaged))
        ctx, a, b = _recover(dirs)
        if ctx.recovered_from == (1, 4):
            hits += 1
            assert (a == 4.0).all() and (b == 4).all()
        else:  # a flip in bytes nothing relies on (FB padding of unused space) must still give exact data
            assert ctx.recovered_from == (2, 1) and (a == 1.0).all() and (b == 1).all(), offset
    l1.write_bytes(original)
    assert hits >= len(_offsets(len(original))) - 1


@pytest.mark.parametrize("how", ["truncate", "extend", "zero-fb", "empty", "delete", "overwrite-head"])
def test_truncated_or_replaced_file_falls_back(dirs, how):
    l1, _l4 = _two_checkpoints(dirs)
    raw = l1.read_bytes()
    if how == "truncate":
        l1.write_bytes(raw[: len(raw) // 3])
    elif how == "extend":
        l1.write_bytes(raw + b"junk")
    elif how == "zero-fb":
        l1.write_bytes(bytes(96) + raw[96:])
    elif how == "empty":
        l1.write_bytes(b"")
    elif how == "delete":
        l1.unlink()
    else:
        l1.write_bytes(os.urandom(64) + raw[64:])
    ctx, a, b = _recover(dirs)
    assert ctx.recovered_from == (1, 4) and (a == 4.0).all() and (b == 4).all()


def test_everything_damaged_is_a_clear_error(dirs, capsys):
    l1, l4 = _two_checkpoints(dirs)
    for path in (l1, l4):
        raw = bytearray(path.read_bytes())
        raw[-3000] ^= 1  # inside data
        path.write_bytes(bytes(raw))
    with pytest.raises(ftidask.NoCheckpointError, match="data hash does not match"):
        _recover(dirs)
    assert cli_main(["verify", str(l1)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_torn_commit_record_is_ignored(dirs):
    l1, _l4 = _two_checkpoints(dirs)
    (record,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    record.write_text(record.read_text()[:20])
    ctx, a, _b = _recover(dirs)
    assert ctx.recovered_from == (1, 4) and (a == 4.0).all()


@pytest.mark.parametrize("field", ["nranks", "node", "rank", "level", "seq", "ckpt_id", "size", "extra"])
def test_commit_record_with_a_changed_value_falls_back(tmp_path, field):
    """A commit record whose bytes were damaged but still parse (a digit flipped) is not trusted: the
    recovery takes the older checkpoint, exactly, rather than failing on the wrong number of ranks or nodes."""
    dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
            "meta_dir": str(tmp_path / "Meta"), "verbosity": 4}
    _two_checkpoints(dirs)
    (path,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    text = path.read_text()
    key = {"node": '"node": 0', "rank": '"rank": 0', "nranks": '"nranks": 1', "level": '"level": 1',
           "seq": '"seq": 2', "ckpt_id": '"ckpt_id": 2', "size": '"size": ', "extra": '"extra": {}'}[field]
    at = text.index(key) + len(key) - 1  # the value's last character: one byte changed, still JSON
    damaged = text[:at] + {"}": "]", "2": "3", "1": "3", "0": "5", " ": " 9"}.get(text[at], "7") + text[at + 1:]
    if field == "extra":
        damaged = text.replace('"extra": {}', '"extra": {"dcp": 1}')
    assert damaged != text
    path.write_text(damaged)
    ctx, a, b = _recover(dirs)
    assert ctx.recovered_from == (1, 4) and (a == 4.0).all() and (b == 4).all()


def test_file_swapped_from_another_checkpoint_is_refused(dirs):
    """A sound file that is not the one the commit record names (e.g. restored by hand) is not used."""
    l1, l4 = _two_checkpoints(dirs)
    l1.write_bytes(l4.read_bytes())
    ctx, a, _b = _recover(dirs)
    assert ctx.recovered_from == (1, 4) and (a == 4.0).all()
