"""The Dask backend's pure parts: chunk placement in worker files, groups and partners."""

import numpy as np
import pytest

from ftidask.daskio.plan import VarSpec, chunk_table, layout_from_json, layout_to_json, plan_ranks
from ftidask.errors import LevelError
from ftidask.levels.ring_groups import copy_holder, copy_source, make_groups


def test_groups_absorb_a_lone_leftover_worker():
    assert make_groups(4, 4) == [[0, 1, 2, 3]]
    assert make_groups(3, 4) == [[0, 1, 2]]
    assert make_groups(5, 2) == [[0, 1], [2, 3, 4]]
    assert make_groups(6, 4) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(LevelError):
        copy_holder(make_groups(1, 4), 0)


def test_partner_ring():
    groups = make_groups(4, 4)
    assert [copy_holder(groups, r) for r in range(4)] == [1, 2, 3, 0]
    assert [copy_source(groups, r) for r in range(4)] == [3, 0, 1, 2]


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
