"""The Dask backend's pure parts: chunk placement in worker files (its groups: tests/test_topology.py)."""

import numpy as np
import pytest

from ftidask.backends.dask.plan import VarSpec, chunk_table, layout_from_json, layout_to_json, plan_ranks


def test_one_container_per_chunk_in_grid_order():
    spec = VarSpec(7, "x", np.dtype("f8"), (4, 6), ((2, 2), (3, 3)))
    owner = {(7, (0, 0)): 1, (7, (0, 1)): 0, (7, (1, 0)): 1, (7, (1, 1)): 1}
    plans = plan_ranks([spec], owner, 3)
    r1 = plans[1]
    assert [(c.index, c.containerid, c.dptr) for c in r1.chunks] == [((0, 0), 0, 0), ((1, 0), 1, 48), ((1, 1), 2, 96)]
    assert r1.layout.ckpt_size == 144 and plans[0].layout.ckpt_size == 48 and plans[2].layout.blocks == ()
    assert r1.infos[0].extra["dask"]["blocks"][1] == [[1, 0], [2, 3], 48]
    assert layout_from_json(layout_to_json(r1.layout)) == r1.layout
    assert chunk_table(plans)["7"][0] == [[0, 1], 0, 0, 48]


def test_stitch_grid_of_blocks_that_are_not_a_grid():
    """Old MPI blocks that do not form a grid: chunks are cut at every block edge, each chunk read from
    one old block (its bytes, in that block's order); a hole is refused before anything is read."""
    from ftidask.backends.dask.stitch import _grid, _Refused
    from ftidask.model.decomposition import Placement, piece_view

    g = np.arange(12, dtype=np.int16).reshape(3, 4)
    blocks = {0: ((0, 0), (2, 3), "C"), 1: ((0, 3), (2, 1), "F"), 2: ((2, 0), (1, 4), "C")}
    placed = {r: (Placement("block", g.shape, o), s, order) for r, (o, s, order) in blocks.items()}
    chunks, owner = _grid(placed, g.shape, g.itemsize, 7)
    assert chunks == ((2, 1), (3, 1))
    assert {i: r for i, (r, _p) in owner.items()} == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 2}
    out = np.empty_like(g)
    for (r, piece) in owner.values():
        (o, s, order) = blocks[r]
        block = g[o[0]:o[0] + s[0], o[1]:o[1] + s[1]]
        stream = block.tobytes(order=order)
        out[tuple(slice(a + d.start, a + d.stop) for a, d in zip(o, piece.src))] = piece_view(piece, stream, 0, g.dtype)
    assert out.tobytes() == g.tobytes()
    del placed[1]
    with pytest.raises(_Refused, match=r"element \(0, 3\)"):
        _grid(placed, g.shape, g.itemsize, 7)
    assert _grid({}, (0, 5), 8, 7) == (((0,), (5,)), {})
