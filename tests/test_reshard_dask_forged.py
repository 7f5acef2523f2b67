"""A Dask checkpoint whose chunk records were forged (every hash and the commit record's seal recomputed), restarted
by one process: the newest checkpoint is damage, the previous one is recovered exactly, as the Dask backend itself
does (tests/test_dask_hostile_records.py). Never a mix, never the chunks placed where a forged record says when
they overlap, never a raw error from deep inside.
"""

import json
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from forgetable import reseal_record, rewrite_table  # noqa: E402

import ftidask  # noqa: E402
from ftidask.engine.runstate import seal_json  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
A = np.arange(60.0).reshape(6, 10)


def _two_checkpoints(dirs, level: int = 1) -> None:
    """Checkpoint 1 at L4 (A + 1), checkpoint 2 at ``level`` (A + 2), by 2 workers, chunks (3, 5)."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        for ckpt in (1, 2):
            ctx.protect(1, da.from_array(A + ckpt, chunks=(3, 5)))
            ctx.checkpoint(ckpt, 4 if ckpt == 1 else level)
        ctx._close()


def _reforge(path: Path, meta_dir: str, change) -> None:
    """``change(record)`` applied to the ``extra["dask"]`` of variable 1 in the table of ``path``; the file's
    checksum and file-block hash recomputed, and its commit record's ``fb_hash`` (re-sealed) to match."""
    old, new = rewrite_table(path, lambda t: change(next(v for v in t["vars"] if v["id"] == 1)["extra"]["dask"]))
    (record,) = Path(meta_dir).glob("*/commits/s00000002.json")
    reseal_record(record, old, new)


def _overlap(rec):  # the worker's second chunk said to lie where its first one does
    rec["blocks"][1][2] = rec["blocks"][0][2]


def _dptr_past(rec):
    rec["blocks"][0][2] = 10**6


def _not_a_list(rec):
    rec["blocks"] = "x"


def _index_twice(rec):
    rec["blocks"][1][0] = rec["blocks"][0][0]


FORGED = {"overlapping chunks": _overlap, "dptr past the file": _dptr_past, "blocks not a list": _not_a_list,
          "a grid index twice": _index_twice}


@pytest.mark.parametrize("forgery", list(FORGED))
def test_forged_dask_chunk_records_fall_back_to_the_previous_checkpoint(dirs, forgery):
    """Worker 0's table of checkpoint 2 forged: one process recovers checkpoint 1 exactly. Before, the malformed
    records were taken for a declaration that does not fit (RecoveryError, the sound checkpoint 1 never tried), and
    overlapping chunks were accepted: checkpoint 2 'recovered' with one chunk's bytes in two places."""
    _two_checkpoints(dirs)
    (path,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")
    _reforge(path, dirs["meta_dir"], FORGED[forgery])
    _recovers_checkpoint_1(dirs)


def test_forged_groups_of_an_l3_dask_record_fall_back_to_the_previous_checkpoint(dirs):
    """Checkpoint 2 (L3) whose sealed commit record lists groups that name a worker twice: one process recovers
    checkpoint 1 exactly. Before, the LevelError of the groups escaped recover(), checkpoint 1 never tried."""
    _two_checkpoints(dirs, level=3)
    (record,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    raw = json.loads(record.read_text())
    raw["extra"]["groups"] = [[0, 0]]
    record.write_text(json.dumps(seal_json(raw)))
    _recovers_checkpoint_1(dirs)


@pytest.mark.parametrize("groups", [[[0, 0]], [[0, 1, 2]]])
def test_export_of_an_l3_dask_checkpoint_with_forged_groups_and_a_lost_file_exports_the_previous_one(dirs, tmp_path,
                                                                                                    groups):
    """`ftidask export --to-zarr` of a run whose newest checkpoint (L3) lost worker 0's file and whose sealed record
    lists malformed groups (a worker twice, a worker the checkpoint does not have): nothing can be rebuilt, so
    checkpoint 1 is exported, exactly. Before, the LevelError of the groups (or a raw KeyError: 2) escaped the
    export, the sound checkpoint 1 never tried."""
    zarr = pytest.importorskip("zarr")
    from ftidask.tools.zarr_export import export_checkpoint

    _two_checkpoints(dirs, level=3)
    (lost,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")
    lost.unlink()
    (record,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    raw = json.loads(record.read_text())
    raw["extra"]["groups"] = groups
    record.write_text(json.dumps(seal_json(raw)))
    result = export_checkpoint(None, tmp_path / "out.zarr", **dirs)
    assert (result.ckpt_id, result.level) == (1, 4)
    got = np.asarray(zarr.open_group(str(tmp_path / "out.zarr"), mode="r")[result.arrays[0]])
    assert got.tobytes() == (A + 1).tobytes()


def _recovers_checkpoint_1(dirs: dict) -> None:
    """One process recovers checkpoint 1 (L4) exactly: the forged checkpoint 2 passed over."""
    ctx = ftidask.init(**dirs)
    out = np.full_like(A, -7.0)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from == (1, 4) and out.tobytes() == (A + 1).tobytes()
    ctx._close()
