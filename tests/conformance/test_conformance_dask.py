"""A subset of the loss scenarios over the Dask backend: 4 workers of the shared LocalCluster.

Each worker is a rank on a node of its own and writes the files of the chunks it holds; the client
drives the checkpoints and the recovery. The arrays are the four ranks' arrays of the other backends,
one chunk per rank, so a recovered checkpoint is compared bit for bit with the same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scenarios as sc

da = pytest.importorskip("dask.array")
pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = sc.NRANKS

#: The levels whose bytes cross between workers (L2, L3, differential L3); about 5 s each, so few. And the
#: previous differential checkpoint read from the spares (L5; L6 without rebuilding it from partner copies).
CASES = ["L2-erase-rank0+erase-partner0-older", "L3-erase-node01-latest", "L7-erase-node01-latest",
         "L5-corrupt-rank0-previous", "L6-erase-rank0+corrupt-partner0-previous"]


def global_arrays(version: int) -> list[np.ndarray]:
    """Every rank's arrays of ``version``, end to end (variable 1, variable 2)."""
    parts = [sc.arrays(r, version) for r in range(sc.NRANKS)]
    return [np.concatenate([p[i] for p in parts]) for i in range(2)]


@pytest.mark.parametrize("name", CASES)
def test_scenario_over_dask(dask_client, tmp_path: Path, name: str) -> None:
    scenario = sc.BY_NAME[name]
    cfg = sc.config(tmp_path, scenario)
    ctx = ftidask.init(client=dask_client, **cfg)
    for ckpt_id, level in scenario.versions():
        for vid, values in enumerate(global_arrays(ckpt_id), start=1):
            chunks = tuple(sc.arrays(r, 0)[vid - 1].size for r in range(sc.NRANKS))
            ctx.protect(vid, dask_client.persist(da.from_array(values, chunks=(chunks,))))
        ctx.checkpoint(ckpt_id, level)
    sc.damage(tmp_path, scenario)
    ctx = ftidask.init(client=dask_client, **cfg)
    if scenario.expected is None:
        with pytest.raises(ftidask.NoCheckpointError):
            ctx.recover()
        return
    arrays = ctx.recover()
    assert ctx.recovered_from == scenario.expected
    for vid, want in enumerate(global_arrays(scenario.expected[0]), start=1):
        assert arrays[vid].compute().tobytes() == want.tobytes()
