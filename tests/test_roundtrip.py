"""Bit-for-bit round trips of every FTI datatype and of awkward array layouts."""

import numpy as np
import pytest

import ftidask
from ftidask.model.constants import FTI_DATATYPES

STRUCTS = [
    np.dtype([("a", "<i4"), ("b", "<f8", (3,)), ("c", [("x", "u1"), ("y", "<c16")])], align=True),
    np.dtype([("a", "<i4"), ("b", "<f8", (3,)), ("c", [("x", "u1"), ("y", "<c16")])], align=False),
    np.dtype({"names": ["p", "q"], "formats": ["<u2", ">f4"], "offsets": [0, 8], "itemsize": 16}),
    ftidask.init_type(24),
]
OTHER = [np.dtype(t) for t in ("?", "<c8", "<c16", ">i8", "<f2", "S7", "<U5", "<M8[ns]", "<m8[s]")]


def _random(shape, dtype, rng, order="C"):
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape).copy(order=order) if dtype.itemsize else np.zeros(shape, dtype)
    if dtype.kind == "b":
        arr = raw[: arr.size].astype(bool).reshape(shape)
    return arr


def _roundtrip(dirs, arrays, level=1):
    ctx = ftidask.init(**dirs)
    for vid, arr in arrays.items():
        ctx.protect(vid, arr)
    ctx.checkpoint(1, level)
    expected = {vid: a.tobytes(order="A") for vid, a in arrays.items()}
    for a in arrays.values():
        a[...] = np.zeros((), a.dtype) if a.dtype.kind != "V" or a.dtype.names else np.void(bytes(a.dtype.itemsize))
    ctx2 = ftidask.init(**dirs)
    assert ctx2.status() == 1
    for vid, arr in arrays.items():
        ctx2.protect(vid, arr)
    out = ctx2.recover()
    for vid, arr in arrays.items():
        assert out[vid] is arr
        assert arr.tobytes(order="A") == expected[vid], vid
    return ctx2


@pytest.mark.parametrize("name", sorted(FTI_DATATYPES))
@pytest.mark.parametrize("level", [1, 4])
def test_fti_datatypes(dirs, name, level):
    rng = np.random.default_rng(1)
    dtype = FTI_DATATYPES[name]
    _roundtrip(dirs, {1: _random((1000,), dtype, rng), 2: _random((3, 5, 7), dtype, rng)}, level)


@pytest.mark.parametrize("dtype", STRUCTS + OTHER, ids=str)
def test_structured_and_other_dtypes(dirs, dtype):
    rng = np.random.default_rng(2)
    _roundtrip(dirs, {7: _random((33,), dtype, rng), 8: _random((4, 4), dtype, rng)})


def test_zero_d_empty_fortran_noncontiguous(dirs):
    rng = np.random.default_rng(3)
    big = rng.random((40, 30))
    arrays = {
        1: np.array(3.5),
        2: np.zeros((0,), np.int32),
        3: np.zeros((5, 0, 2)),
        4: rng.random((17, 9)).copy(order="F"),
        5: big[::3, 1::2],  # a strided view: recovered in place into the parent
        6: rng.random((6, 5)).T,  # Fortran-contiguous view
    }
    assert not arrays[5].flags.c_contiguous and not arrays[5].flags.f_contiguous
    parent_before = big.copy()
    _roundtrip(dirs, arrays)
    np.testing.assert_array_equal(big[::3, 1::2], parent_before[::3, 1::2])


def test_recover_into_other_memory_order(dirs):
    """A C-ordered checkpoint fills an F-ordered array of the same shape element for element."""
    ctx = ftidask.init(**dirs)
    a = np.arange(12.0).reshape(3, 4)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx2 = ftidask.init(**dirs)
    b = np.zeros((3, 4), order="F")
    ctx2.protect(1, b)
    ctx2.recover()
    np.testing.assert_array_equal(a, b)


def test_large_noncontiguous_in_pieces(dirs, monkeypatch):
    """Pieces smaller than an array exercise the bounded-copy path, element boundaries included."""
    monkeypatch.setattr("ftidask.model.arrays.PIECE", 1000)
    rng = np.random.default_rng(4)
    base = rng.integers(0, 2**60, size=(300, 41), dtype=np.int64)
    _roundtrip(dirs, {1: base[:, ::2], 2: _random((999,), np.dtype("S3"), rng)})
