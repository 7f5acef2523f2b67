"""Random sequences of Dask API calls and real faults (tests/dask_sequences.py), checked against a model.

One LocalCluster of worker processes per test, many steps on it: checkpoints at every level (waited for, asynchronous,
incremental, differential), recoveries of every kind, restarts on the same cluster and on a new one of another size,
finalize and a new run, files erased or flipped, workers SIGKILLed. The slow run keeps a seed of each configuration;
the whole matrix is a campaign (``-m campaign``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("distributed")

import dask_sequences  # noqa: E402

from ftidask.storage.files import find_paths  # noqa: E402

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
@pytest.mark.parametrize(("name", "seed", "steps"), [("keep", 546, 50), ("g3", 903, 50), ("zstd", 714, 50),
                                                     ("keep", 3029, 40)])
def test_dask_random_sequence_found(tmp_path, name, seed, steps):
    """Seeds that found something: keep 546 (finalize kept a checkpoint retired by FTI's rule but kept for live
    arrays: the model's rule), g3 903 (an L2 lineage read of a damaged own file: the partner copy; an asynchronous
    checkpoint's failure raised at the wait: the model's rule), zstd 714 (a fallback of other shapes, fb29f61),
    keep 3029 (the last recovery found nothing, and the finalize that ends the sequence found nothing to flush with
    keep_last_ckpt: the newest's error, allowed as at a finalize step: the model's rule)."""
    run(tmp_path, name, steps, [seed])


@pytest.mark.slow
@pytest.mark.campaign
@pytest.mark.parametrize("name", sorted(dask_sequences.CONFIGS))
def test_dask_random_sequences_many_seeds(tmp_path, name):
    run(tmp_path, name, 40, range(1000, 1020))


def test_fallback_of_other_shapes_is_recovered_into_its_shapes(dask_client, dirs):
    """Found by the sequences (keep seed 520): the newest checkpoint's data damaged (its metadata sound), the older
    one of other shapes. Protected with the newest's shapes, the recovery falls back and refuses (the older one's
    shapes differ); protected with the older one's shapes, it refused too, naming the newest (its shapes checked
    before its data was read): no array protected could ever be recovered. Now the newest is checked in full first."""
    import dask.array as da
    import numpy as np

    import ftidask

    old = np.arange(90, dtype=np.float64).reshape(10, 9)
    new = np.arange(200 * 160, dtype=np.int32).reshape(200, 160)
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, da.from_array(old, chunks=(5, 9)))
    ctx.checkpoint(1, 4)
    ctx.protect(1, da.from_array(new, chunks=(50, 160)))
    ctx.checkpoint(2, 1)
    for path in sorted(find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank*.fti")):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 4] ^= 0xFF  # in a chunk's data: the metadata verifies, the read does not
        path.write_bytes(bytes(raw))
    ctx.protect(1, da.zeros((10, 9), dtype=np.float64, chunks=(10, 9)))
    out = ctx.recover()
    assert ctx.recovered_from == (1, 4)
    assert out[1].compute().tobytes() == old.tobytes()
    ctx.finalize()
