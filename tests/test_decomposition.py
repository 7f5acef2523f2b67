"""The resharding planner (ftidask.model.decomposition) against a NumPy model, and the declarations of protect.

Property: for random global shapes, old and new block decompositions and storage orders, the pieces
the planner finds, read from each old block's byte stream (only the span it names), rebuild every
new block exactly, and cover it exactly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.model.decomposition import Block, bands, declaration, overlap, piece_view, placement
from ftidask.model.errors import FormatError, ProtectError
from ftidask.storage.files import find_paths


@st.composite
def grids(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A block decomposition of ``shape``: random cuts per dimension (empty blocks allowed)."""
    cuts = []
    for n in shape:
        inner = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        cuts.append([0, *inner, n])
    blocks = [((), ())]
    for edges in cuts:
        blocks = [(o + (a,), s + (b - a,)) for o, s in blocks for a, b in itertools.pairwise(edges)]
    return blocks


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
    old = draw(grids(shape))
    new = draw(grids(shape))
    orders = draw(st.lists(st.sampled_from("CF"), min_size=len(old), max_size=len(old)))
    dtype = draw(st.sampled_from([np.float64, np.int16, np.uint8, np.dtype("S3")]))
    return shape, old, new, orders, np.dtype(dtype)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_pieces_rebuild_every_new_block(case: tuple) -> None:
    shape, old, new, orders, dtype = case
    size = int(np.prod(shape, dtype=np.int64))
    glob = np.frombuffer(np.random.default_rng(size).bytes(size * dtype.itemsize), dtype).reshape(shape)
    streams = []
    for (offset, bshape), order in zip(old, orders):
        block = glob[tuple(slice(o, o + n) for o, n in zip(offset, bshape))]
        streams.append(block.tobytes(order=order))
    for offset, bshape in new:
        out = np.zeros(bshape, dtype)
        covered = np.zeros(bshape, np.int32)
        for (o_off, o_shape), order, stream in zip(old, orders, streams):
            piece = overlap(o_off, o_shape, order, dtype.itemsize, offset, bshape)
            if piece is None:
                continue
            start, stop = piece.span
            assert 0 <= start < stop <= len(stream)
            buf = bytearray(stream[start:stop])  # only the span the planner asks for
            out[piece.dst] = piece_view(piece, buf, start, dtype)
            covered[piece.dst] += 1
        expect = glob[tuple(slice(o, o + n) for o, n in zip(offset, bshape))]
        assert out.tobytes() == expect.tobytes()
        assert (covered == 1).all()  # the old blocks tile the array: each element comes from one of them


@given(cases(), st.integers(1, 4096))
def test_bands_rebuild_every_piece_from_their_spans_alone(case: tuple, limit: int) -> None:
    """Each piece cut in bands (a restart reading into arrays in use): every band read from its own span only
    rebuilds the piece, each element once, each band's span within the piece's and at most ``limit`` bytes unless
    one index of the band's axis is longer."""
    shape, old, new, orders, dtype = case
    size = int(np.prod(shape, dtype=np.int64))
    glob = np.frombuffer(np.random.default_rng(size).bytes(size * dtype.itemsize), dtype).reshape(shape)
    for (o_off, o_shape), order in zip(old, orders):
        stream = glob[tuple(slice(o, o + n) for o, n in zip(o_off, o_shape))].tobytes(order=order)
        for offset, bshape in new:
            piece = overlap(o_off, o_shape, order, dtype.itemsize, offset, bshape)
            if piece is None:
                continue
            out = np.zeros(bshape, dtype)
            covered = np.zeros(bshape, np.int32)
            one = max([dtype.itemsize] + [piece.strides[d] for d, n in enumerate(piece.shape) if n > 1])  # one index
            for band in bands(piece, limit):
                start, stop = band.span
                assert piece.span[0] <= start < stop <= piece.span[1]
                assert stop - start <= max(limit, one), (band, piece)
                out[band.dst] = piece_view(band, bytearray(stream[start:stop]), start, dtype)
                covered[band.dst] += 1
            assert out[piece.dst].tobytes() == piece_view(piece, stream, 0, dtype).tobytes()
            assert (covered[piece.dst] == 1).all() and covered.sum() == covered[piece.dst].size


def test_declarations() -> None:
    a = np.zeros((3, 4))
    assert declaration(a) is None
    assert declaration(a, (10, 4), (7, 0)) == {"global_shape": [10, 4], "offset": [7, 0]}
    assert declaration(a, Block((10, 4), (7, 0))) == {"global_shape": [10, 4], "offset": [7, 0]}
    assert declaration(a, replicated=True) == {"replicated": True}
    for bad in [((10, 4), (8, 0)), ((10,), (0,)), ((10, 4), None), (None, (0, 0)), ((10, 4), (-1, 0)),
                ((10, 4.5), (0, 0))]:
        with pytest.raises(ProtectError):
            declaration(a, *bad)
    with pytest.raises(ProtectError):
        declaration(a, (3, 4), (0, 0), replicated=True)
    assert placement({"global_shape": [10, 4], "offset": [7, 0]}, (3, 4)).offset == (7, 0)
    with pytest.raises(FormatError):
        placement({"global_shape": [10, 4], "offset": [8, 0]}, (3, 4))


def test_protect_records_the_declaration(tmp_path) -> None:
    """The declaration goes into the variable table; a variable without one has no new key (same bytes)."""
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"))
    ctx.protect(1, np.arange(6.0), global_shape=(20,), offset=(4,))
    ctx.protect(2, np.arange(3), replicated=True)
    ctx.protect(3, np.arange(5))
    with pytest.raises(ProtectError, match="does not lie inside"):
        ctx.protect(4, np.arange(5), global_shape=(4,), offset=(0,))
    ctx.protect(1, np.arange(6.0))  # protected again without a declaration: it stays
    ctx.checkpoint(1, 1)
    from ftidask.ftiff.reader import parse_ftiff

    path = next(iter(find_paths(tmp_path / "L", "Ckpt1-Rank0.fti")))
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    assert parsed.vars[1].extra == {"global_shape": [20], "offset": [4]}
    assert parsed.vars[2].extra == {"replicated": True}
    assert parsed.vars[3].extra == {}
    assert not any("extra" in raw for raw in parsed.trailer["vars"] if raw["id"] == 3)
    ctx.finalize()
