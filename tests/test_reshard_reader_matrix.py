"""The restart reader on another number of ranks (ftidask.engine.reshard_files.read_pieces: pieces that are runs of
an old stream read straight into the private buffer, the others through a scratch span) against the reference, bit
for bit: 2-D blocks cut in both dimensions, Fortran-ordered old blocks into C-ordered new ones and back, a size-1
dimension, big-endian, structured, bool and complex dtypes, zstd-compressed variables whose containers a piece cuts,
grown variables (several containers per old file), replicated arrays, 0-d arrays (a piece of shape (): refused with
a TypeError from deep inside before the fix, ``a[()]`` being a scalar copy), blocks of no element. 4 old ranks, 1,
3 or 5 new ones; the ranks are threads over the real engine (``run_ranks``), as in
tests/test_reshard_forged_blocks.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.engine.reshard_files import read_pieces
from ftidask.ftiff.reader import parse_ftiff
from ftidask.model.config import load_config
from ftidask.model.decomposition import overlap
from ftidask.storage.files import find_paths

OLD = 4
STRUCT = np.dtype([("a", "<i2"), ("b", ">f8"), ("c", "?")])
# var id -> (global shape, dtype, old order, new order, how the old ranks cut it, compressor)
VARS = {
    1: ((12, 10), np.dtype("<f8"), "C", "C", "grid", None),        # cut in both dimensions
    2: ((12, 10), np.dtype(">i4"), "F", "F", "rows", None),        # Fortran blocks, big-endian
    3: ((1000,), STRUCT, "C", "C", "rows", "zstd"),                # compressed: every piece cuts a container
    4: ((9, 1, 7), np.dtype("complex128"), "C", "F", "rows", None),  # a size-1 dimension, C old, F new
    5: ((1000,), np.dtype(bool), "C", "C", "replicated", None),
    6: ((1200,), np.dtype("<f4"), "C", "C", "rows", None),         # grown after checkpoint 1: 2 containers
    7: ((1200,), np.dtype("<i8"), "C", "C", "rows", "zstd"),       # grown and compressed
    8: ((10, 12), np.dtype("<u2"), "F", "C", "grid", None),        # Fortran old, C new, cut in both dims
    9: ((3, 4), np.dtype("<f4"), "C", "C", "rows", None),          # blocks of 0 rows (old rank 0, new ones)
    10: ((), np.dtype("<f8"), "C", "C", "replicated", None),       # 0-d: a piece of shape ()
    11: ((), STRUCT, "C", "C", "replicated", "zstd"),
}
GROWN = {6: (600,), 7: (600,)}  # their shapes at checkpoint 1


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, verbosity=4)


def glob(vid: int, ckpt: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Variable ``vid``'s global array at checkpoint ``ckpt``: random bytes (every bit pattern, NaNs too)."""
    gshape, dtype = shape or VARS[vid][0], VARS[vid][1]
    raw = np.random.default_rng(vid * 100 + ckpt).integers(0, 256, int(np.prod(gshape)) * dtype.itemsize, np.uint8)
    if dtype == bool or dtype == STRUCT:  # valid values for the fields a comparison reads
        raw = raw % 2 if dtype == bool else raw
    return raw.view(dtype).reshape(gshape)


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts


def block(vid: int, rank: int, size: int, shape: tuple[int, ...] | None = None, cut: str | None = None):
    """(offset, shape) of ``rank``'s block of ``size``: 'rows' cuts dimension 0, 'grid' a 2x2 grid (old, 4
    ranks), 'cols' the last dimension."""
    gshape = shape or VARS[vid][0]
    cut = cut or VARS[vid][4]
    if cut == "grid" and size == OLD:
        (r0, r1), (c0, c1) = _split(gshape[0], 2, rank // 2), _split(gshape[1], 2, rank % 2)
        return (r0, c0), (r1 - r0, c1 - c0)
    d = len(gshape) - 1 if cut == "cols" else 0
    lo, hi = _split(gshape[d], size, rank)
    off = tuple(lo if k == d else 0 for k in range(len(gshape)))
    return off, tuple(hi - lo if k == d else n for k, n in enumerate(gshape))


def _part(g: np.ndarray, off, shape, order: str) -> np.ndarray:
    part = g[tuple(slice(o, o + n) for o, n in zip(off, shape))]
    return np.asfortranarray(part) if order == "F" else np.ascontiguousarray(part)


def _want(vid: int, rank: int, size: int, ckpt: int, old: bool) -> tuple[np.ndarray, dict]:
    """The array ``rank`` of ``size`` holds of variable ``vid`` at checkpoint ``ckpt``, and its protect() keywords."""
    gshape, _dtype, old_order, new_order, cut, codec = VARS[vid]
    if old and ckpt == 1 and vid in GROWN:
        gshape = GROWN[vid]
    g = glob(vid, ckpt, gshape)
    kw = {"compressor": codec} if codec else {}
    if cut == "replicated":
        return np.array(g), {"replicated": True, **kw}
    # new ranks cut 'grid' variables by rows, 'rows' ones by their last dimension (2-D and more) or by rows
    off, shape = block(vid, rank, size, gshape, cut if old else ("cols" if len(gshape) > 1 and cut == "rows"
                                                                else "rows"))
    return _part(g, off, shape, old_order if old else new_order), {"global_shape": gshape, "offset": off, **kw}


def _write(base: Path) -> None:
    """Checkpoint 1 (L4) and, the grown variables grown, checkpoint 2 (L1), by 4 ranks."""
    def program(t) -> None:
        ctx = Context(_config(base), t)
        for ckpt, level in ((1, 4), (2, 1)):
            for vid in VARS:
                arr, kw = _want(vid, t.rank, OLD, ckpt, old=True)
                ctx.protect(vid, arr, **kw)
            ctx.checkpoint(ckpt, level)
        ctx._close()

    assert run_ranks(_config(base), OLD, program, wait=120)[1] == []


def _recover(base: Path, size: int) -> list:
    def program(t):
        ctx = Context(_config(base), t)
        arrays = {}
        for vid in VARS:
            want, kw = _want(vid, t.rank, size, 2, old=False)
            arrays[vid] = (np.empty_like(want, order="K"), want)
            ctx.protect(vid, arrays[vid][0], **kw)
        ctx.recover()
        ctx._close()
        return ctx.recovered_from, {vid: (a.dtype == w.dtype and a.flags.f_contiguous == w.flags.f_contiguous
                                          and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(w).tobytes())
                                    for vid, (a, w) in arrays.items()}

    results, errors = run_ranks(_config(base), size, program, wait=120)
    assert errors == [], errors
    return results


@pytest.mark.parametrize("size", [1, 3, 5])
def test_every_piece_kind_is_recovered_bit_for_bit(tmp_path: Path, size: int) -> None:
    _write(tmp_path)
    got = _recover(tmp_path, size)
    assert got == [((2, 1), {vid: True for vid in VARS})] * size, got


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("codec", [None, "zstd"])
def test_random_boxes_of_a_grown_variable_into_buffers_of_either_order(tmp_path: Path, order: str, codec) -> None:
    """read_pieces straight: 300 random boxes of one old block (a 3-D array grown after a first checkpoint, so that
    its stream spans two containers; C or Fortran order) into C- or F-ordered buffers, or into a box of a larger
    one, each bit for bit as NumPy slices it."""
    shape, rng = (6, 1, 9), np.random.default_rng(7)
    cfg = load_config(None, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                      meta_dir=str(tmp_path / "Meta"), local_test=1, node_size=1, verbosity=4)
    ctx = ftidask.init(cfg)
    kw = {"compressor": codec} if codec else {}
    ctx.protect(1, np.ones((2, 1, 9), order=order), **kw)
    ctx.checkpoint(1, 1)
    g = np.asarray(rng.integers(0, 256, int(np.prod(shape)) * 16, np.uint8).view(np.complex128).reshape(shape),
                   order=order)
    ctx.protect(1, g, **kw)
    ctx.checkpoint(2, 1)
    ctx._close()
    (path,) = find_paths(tmp_path / "Local", "Ckpt2-Rank0.fti")
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    assert sum(1 for _b, _c, m in parsed.containers() if m.id == 1 and m.chunksize) >= 2
    for _ in range(300):
        lo = [int(rng.integers(0, n)) for n in shape]
        box = tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(lo, shape))
        piece = overlap((0, 0, 0), shape, order, 16, lo, box)
        kind = rng.integers(3)
        if kind < 2:
            buf = np.empty(box, np.complex128, order="CF"[kind])
            out, where = {1: buf}, buf
        else:  # the box inside a larger buffer: the piece's destination is not the whole buffer
            big = np.empty(tuple(n + 2 for n in box), np.complex128)
            piece = dataclasses.replace(piece, dst=tuple(slice(1, 1 + n) for n in box))
            out, where = {1: big}, big[1:-1, 1:-1, 1:-1]
        read_pieces(parsed, [(1, piece)], out)
        want = g[tuple(slice(o, o + n) for o, n in zip(lo, box))]
        assert np.ascontiguousarray(where).tobytes() == np.ascontiguousarray(want).tobytes(), (lo, box, kind)
