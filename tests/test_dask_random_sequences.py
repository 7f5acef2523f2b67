"""Random sequences of Dask API calls and real faults (tests/dask_sequences.py), checked against a model.

One LocalCluster of worker processes per test, many steps on it: checkpoints at every level (waited for, asynchronous,
incremental, differential), recoveries of every kind, restarts on the same cluster and on a new one of another size,
finalize and a new run, files erased or flipped, workers SIGKILLed. The slow run keeps a seed of each configuration;
the whole matrix is a campaign (``-m campaign``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("distributed")

import dask_sequences  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(1800)]


def run(tmp_path, name: str, steps: int, seeds) -> None:
    clusters = dask_sequences.Clusters(dask_sequences.CONFIGS[name]["nworkers"])
    try:
        for seed in seeds:
            res = dask_sequences.run_seed(clusters, name, tmp_path / f"s{seed}", steps, seed)
            assert res["ok"], f"{name} seed {seed}: {res['error']}\n" + "\n".join(res["log"][-40:])
    finally:
        clusters.close()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seed"), [("g3", 3), ("dcp", 5)])
def test_dask_random_sequence(tmp_path, name, seed):
    run(tmp_path, name, 14, [seed])


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.parametrize("name", sorted(dask_sequences.CONFIGS))
def test_dask_random_sequences_many_seeds(tmp_path, name):
    run(tmp_path, name, 40, range(1000, 1020))
