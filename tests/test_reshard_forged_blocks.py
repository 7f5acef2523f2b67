"""A checkpoint of 4 ranks whose block records (``global_shape``/``offset`` in a rank file's variable table) were
forged or damaged, every hash and the commit record's seal recomputed to match: a restart that redistributes it (on
2 ranks, on one process, on 4 ranks that declare other blocks) takes it for damage and recovers the previous
checkpoint exactly, as for any other damage. Before, a malformed record was reported as the user's declarations
not fitting (a RecoveryError; the sound previous checkpoint never tried), and records that overlap or lie outside
the global array were used as they were.

The ranks are threads over the real engine (``run_ranks``), as in tests/test_commit_durability.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from forgetable import reseal_record, rewrite_table

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.storage.files import find_paths

G, OLD = 1000, 4


def _config(base: Path):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=2, verbosity=4)


def _want(ckpt: int) -> np.ndarray:
    return np.arange(G, dtype=np.float64) + 1000 * ckpt


def _block(rank: int, size: int) -> slice:
    return slice(G * rank // size, G * (rank + 1) // size)


def _write(base: Path) -> None:
    """Checkpoint 1 at L4 and checkpoint 2 at L1, by 4 ranks, each its block of a global array of G float64."""
    def program(t) -> None:
        ctx = Context(_config(base), t)
        mine = _block(t.rank, OLD)
        a = np.zeros(mine.stop - mine.start)
        ctx.protect(1, a, global_shape=(G,), offset=(mine.start,))
        for ckpt, level in ((1, 4), (2, 1)):
            a[:] = _want(ckpt)[mine]
            ctx.checkpoint(ckpt, level)
        ctx._close()  # the job ends without finalize: its checkpoints stay

    assert run_ranks(_config(base), OLD, program, wait=60)[1] == []


def _reforge(base: Path, rank: int, change) -> None:
    """``change(extra)`` applied to variable 1's table entry in old rank ``rank``'s file of checkpoint 2; the file's
    checksum and file-block hash recomputed, and its commit record's ``fb_hash`` and ``size`` (re-sealed) to match."""
    (path,) = find_paths(base / "Local", f"Ckpt2-Rank{rank}.fti")
    old, new = rewrite_table(path, lambda table: change(next(v for v in table["vars"] if v["id"] == 1)["extra"]))
    (record,) = (base / "Meta").glob("*/commits/s00000002.json")
    reseal_record(record, old, new, path.stat().st_size)


def _set(key, value):
    return lambda extra: extra.__setitem__(key, value)


def _onto_rank_0(extra):  # rank 1's block said to lie where rank 0's does: an overlap (and a hole)
    extra["offset"] = [0]


def _shifted(extra):  # one element into rank 0's block
    extra["offset"] = [extra["offset"][0] - 1]


FORGED = {
    "offset of two entries": _set("offset", [250, 0]),
    "negative offset": _set("offset", [-1]),
    "offset not an int": _set("offset", ["250"]),
    "offset a float": _set("offset", [250.5]),
    "offset a bool": _set("offset", [True]),
    "global_shape not a list": _set("global_shape", "1000"),
    "global_shape of another length": _set("global_shape", [1000, 1]),
    "block past the global shape": _set("offset", [G - 10]),
    "another global shape than the other ranks": _set("global_shape", [G + 4]),
    "overlapping blocks": _onto_rank_0,
    "blocks overlapping by one element": _shifted,
    "replicated on one rank only": lambda extra: extra.update({"replicated": True}) or extra.pop("offset"),
    "global_shape without offset": lambda extra: extra.pop("offset"),
}


def _recover_threads(base: Path, size: int, shift: int = 0) -> list:
    """``size`` ranks declare their blocks (``shift``: cut elsewhere than the old ranks'), recover; per rank the
    checkpoint recovered and whether the block is exactly its values (or the error)."""
    def program(t):
        ctx = Context(_config(base), t)
        lo, hi = _block(t.rank, size).start, _block(t.rank, size).stop
        if shift and size > 1:  # the same number of ranks, blocks cut at other places: redistributed
            lo, hi = max(0, lo - shift * (t.rank > 0)), hi - shift * (t.rank < size - 1)
        a = np.full(hi - lo, -1.0)
        ctx.protect(1, a, global_shape=(G,), offset=(lo,))
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            return f"{type(exc).__name__}: {exc}", bool((a == -1).all())
        finally:
            ctx._close()
        return ctx.recovered_from, a.tobytes() == _want(ctx.recovered_from[0])[lo:hi].tobytes()

    results, errors = run_ranks(_config(base), size, program, wait=60)
    assert errors == [], errors
    return results


@pytest.mark.parametrize("forgery", list(FORGED))
@pytest.mark.parametrize("size", [2, 4])
def test_a_forged_block_record_is_damage_and_the_previous_checkpoint_is_recovered(tmp_path, forgery, size):
    """Old rank 1's block record of checkpoint 2 forged; 2 ranks (or 4 that cut their blocks elsewhere) recover
    checkpoint 1 exactly."""
    _write(tmp_path)
    _reforge(tmp_path, 1, FORGED[forgery])
    got = _recover_threads(tmp_path, size, shift=3 if size == OLD else 0)
    assert got == [((1, 4), True)] * size, got


@pytest.mark.parametrize("forgery", ["negative offset", "overlapping blocks", "offset a float"])
def test_one_process_passes_over_a_forged_block_record(tmp_path, forgery):
    """One process protecting the whole global array (undeclared) recovers checkpoint 1 exactly."""
    _write(tmp_path)
    _reforge(tmp_path, 1, FORGED[forgery])
    ctx = ftidask.init(_config(tmp_path))
    a = np.full(G, -1.0)
    ctx.protect(1, a)
    ctx.recover()
    assert ctx.recovered_from == (1, 4) and a.tobytes() == _want(1).tobytes()
    ctx._close()


def test_without_an_older_checkpoint_the_damage_is_named_and_nothing_is_touched(tmp_path):
    """Checkpoint 1 removed (its record): the forged checkpoint 2 leaves nothing to recover, a NoCheckpointError
    naming the block records, every rank's array untouched."""
    _write(tmp_path)
    _reforge(tmp_path, 1, _onto_rank_0)
    (first,) = (tmp_path / "Meta").glob("*/commits/s00000001.json")
    first.unlink()
    got = _recover_threads(tmp_path, 2)
    assert len(got) == 2 and all(untouched for _m, untouched in got), got
    assert all(m.startswith("NoCheckpointError") and "overlap" in m for m, _u in got), got


@pytest.mark.dask
@pytest.mark.parametrize("forgery", ["offset a float", "overlapping blocks",
                                     "another global shape than the other ranks"])
def test_the_dask_backend_passes_over_a_forged_block_record(tmp_path, forgery):
    """The Dask backend stitching the 4 ranks' checkpoint into global arrays takes the forged record for damage too,
    and recovers checkpoint 1 exactly. Before, it refused the recovery (the records taken for declarations that do
    not make one global array), or stitched overlapping blocks from whichever file held a chunk first."""
    distributed = pytest.importorskip("distributed")
    _write(tmp_path)
    _reforge(tmp_path, 1, FORGED[forgery])
    cfg = _config(tmp_path)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) \
            as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(cfg, client=client)
        a = np.full(G, -1.0)
        ctx.protect(1, a)
        ctx.recover()
        assert ctx.recovered_from == (1, 4) and a.tobytes() == _want(1).tobytes()
        ctx._close()
