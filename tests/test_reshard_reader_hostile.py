"""The restart reader on another layout (ftidask.engine.reshard_files.read_pieces) against old files damaged after
they were parsed: cut, replaced by another checkpoint's file of the same name, a byte flipped in a container that a
piece reads straight into its buffer, in one it cuts (read through the scratch buffer), in a compressed one. Each
time a FormatError naming the file (never another exception from deep inside), and only the private buffer
written; a sound file read bit for bit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine.reshard_files import read_pieces
from ftidask.ftiff import hashing
from ftidask.ftiff.reader import parse_ftiff
from ftidask.ftiff.structs import BMD_SIZE, FB_SIZE, VMD_SIZE, VMD_STRUCT, BlockMeta, FileBlock
from ftidask.model.config import load_config
from ftidask.model.decomposition import overlap
from ftidask.model.errors import FormatError
from ftidask.storage.files import find_paths

A = (64, 48)  # float64, C: pieces of whole rows are runs of the stream, the others strided
B = 5000      # int64, zstd: every piece cuts its container


def _want(vid: int, ckpt: int) -> np.ndarray:
    if vid == 1:
        return (np.arange(A[0] * A[1], dtype=np.float64) / 7 + ckpt).reshape(A)
    return np.arange(B, dtype=np.int64) * 5 - ckpt


def _checkpoints(base: Path) -> None:
    """Checkpoints 1 and 2 at L1; checkpoint 1's file kept as ``base/ckpt1.fti``."""
    cfg = load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                      local_test=1, node_size=1, verbosity=4)
    ctx = ftidask.init(cfg)
    a, b = _want(1, 1), _want(2, 1)
    ctx.protect(1, a)
    ctx.protect(2, b, compressor="zstd")
    for ckpt in (1, 2):
        a[...], b[...] = _want(1, ckpt), _want(2, ckpt)
        ctx.checkpoint(ckpt, 1)
        if ckpt == 1:
            shutil.copyfile(_file(base, 1), base / "ckpt1.fti")
    ctx._close()


PIECES = {  # (var id, new block offset, new block shape)
    "whole rows (read in place)": (1, (10, 0), (20, 48)),
    "a corner (strided)": (1, (5, 7), (30, 20)),
    "compressed": (2, (1200,), (900,)),
}


def _read(path: Path, name: str, damage=None) -> np.ndarray:
    vid, off, shape = PIECES[name]
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    info = parsed.vars[vid]
    piece = overlap((0,) * len(info.shape), info.shape, info.order, info.dtype.itemsize, off, shape)
    if damage is not None:
        damage(path)
    out = {vid: np.full(shape, 3, info.dtype)}
    read_pieces(parsed, [(vid, piece)], out)
    return out[vid]


@pytest.fixture
def old(tmp_path: Path) -> Path:
    _checkpoints(tmp_path)
    return tmp_path


def _file(base: Path, ckpt: int) -> Path:
    (path,) = find_paths(base / "Local", f"Ckpt{ckpt}-Rank0.fti")
    return path


@pytest.mark.parametrize("name", list(PIECES))
def test_a_sound_file_is_read_bit_for_bit(old: Path, name: str) -> None:
    vid, off, shape = PIECES[name]
    got = _read(_file(old, 2), name)
    assert got.tobytes() == _want(vid, 2)[tuple(slice(o, o + n) for o, n in zip(off, shape))].tobytes()


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _replaced(path: Path) -> None:
    tmp = path.with_suffix(".new")
    shutil.copyfile(_base_of(path) / "ckpt1.fti", tmp)
    os.replace(tmp, path)  # another checkpoint's sound file, under the same name


def _base_of(path: Path) -> Path:
    return next(p for p in path.parents if (p / "Local").is_dir())


@pytest.mark.parametrize("damage", [_cut, _replaced], ids=["cut", "replaced"])
@pytest.mark.parametrize("name", list(PIECES))
def test_a_file_changed_after_it_was_parsed_is_refused_by_name(old: Path, name: str, damage) -> None:
    path = _file(old, 2)
    with pytest.raises(FormatError) as err:
        _read(path, name, damage)
    assert str(path) in str(err.value) and "replaced or modified" in str(err.value)


@pytest.mark.parametrize("name", list(PIECES))
def test_a_flipped_byte_in_the_containers_a_piece_reads_is_refused_by_name(old: Path, name: str) -> None:
    vid = PIECES[name][0]
    path = _file(old, 2)
    with open(path, "rb") as fh:
        (meta,) = [m for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == vid and m.chunksize]
    with open(path, "r+b") as fh:  # the container's last byte: read after every other one
        fh.seek(meta.fptr + meta.chunksize - 1)
        last = fh.read(1)[0]
        fh.seek(meta.fptr + meta.chunksize - 1)
        fh.write(bytes([last ^ 1]))
    with pytest.raises(FormatError) as err:
        _read(path, name)
    assert str(path) in str(err.value), err.value


def _forge_container(path: Path, vid: int, **fields) -> None:
    """The first container of variable ``vid`` in ``path`` given other ``fields`` (dptr, chunksize,
    containersize), the metadata checksum and the file block's hash recomputed to match (a forged file)."""
    raw = bytearray(path.read_bytes())
    fb = FileBlock.unpack(bytes(raw[:FB_SIZE]))
    checksum, offset, done = hashing.new_hasher(fb.hash_id), FB_SIZE, False
    while offset < fb.fs:
        bmd = BlockMeta.unpack(bytes(raw[offset:offset + BMD_SIZE]))
        for i in range(bmd.numvars):
            at = offset + BMD_SIZE + i * VMD_SIZE
            got = list(VMD_STRUCT.unpack_from(raw, at))
            if got[0] == vid and not done:
                for name, value in fields.items():
                    got[{"dptr": 4, "chunksize": 6, "containersize": 7}[name]] = value
                VMD_STRUCT.pack_into(raw, at, *got)
                done = True
        checksum.update(raw[offset:offset + BMD_SIZE + VMD_SIZE * bmd.numvars])
        offset += bmd.dbsize
    checksum.update(raw[fb.fs:])
    forged = FileBlock(**(fb.__dict__ | {"checksum": checksum.hexdigest()[:32]})).sealed()
    path.write_bytes(forged.pack() + bytes(raw[FB_SIZE:]))


@pytest.mark.parametrize("fields", [{"chunksize": 1 << 62}, {"containersize": 1 << 62}, {"containersize": -8},
                                    {"dptr": 1 << 62}, {"dptr": -8}, {"chunksize": 8}, {"dptr": 8}],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("vid", [1, 2])
def test_container_records_forged_to_size_the_buffers_are_refused_by_name(old: Path, vid: int, fields) -> None:
    """A container's dptr, chunksize or containersize forged (huge, negative, or leaving a gap or an overlap), the
    file's hashes recomputed: refused by name when the file is parsed, before any buffer is sized by them."""
    path = _file(old, 2)
    _forge_container(path, vid, **fields)
    with pytest.raises(FormatError) as err, open(path, "rb") as fh:
        parse_ftiff(fh, str(path))
    assert str(path) in str(err.value), err.value
