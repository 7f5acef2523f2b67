"""recover_fti_run: every file FTI would try is tried, and ranks that agree on a checkpoint never hang or write arrays
before every rank's file is known to fit.

- One process alone: a damaged level-2 rank file sends the search to the partner copy of the same checkpoint (as
  FTI_RecoverFiles), not to the next checkpoint.
- ``nranks``: the MPI-IO level-4 file is every rank's (each one's part verified), and with heads the ranks are counted
  in the communicator ``comm`` names.
- On several ranks: a rank whose arguments or directories are refused, or whose recovery fails unexpectedly, makes
  every rank raise the same error (before, the others waited in the next collective); a checkpoint one rank's
  arrays do not fit leaves every rank's arrays untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fti_heads import NODE_SIZE, _l1, _l1_bytes, _local
from test_fti_heads import _config as _heads_config
from test_fti_heads import _recover as _heads_recover
from test_fti_mpiio import _config as _mpiio_config
from test_fti_mpiio import _protect, _same, _write_fti_mpiio
from test_fti_run import DTYPES, EXEC, _config, _expected, _place, _recover

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.errors import NoCheckpointError
from ftidask.model.config import load_config
from ftidask.tools.fti_run import recover_fti_run


def test_a_damaged_level_2_file_alone_is_read_from_its_partner_copy(tmp_path, dirs):
    """Rank 0's own level-2 file of checkpoint 2 is damaged, its copy on node 1 is sound: FTI reads the copy. Before,
    one process alone passed from the damaged file to level 4's older checkpoint 1, never trying the copy."""
    fti = tmp_path / "fti"
    _place(fti, 2, 2, partner=True)
    _place(fti, 4, 1)
    own = fti / f"Local/node0/{EXEC}/l2/Ckpt2-Rank0.fti"
    raw = bytearray(own.read_bytes())
    raw[40] ^= 0x10  # a data byte of its first variable
    own.write_bytes(bytes(raw))
    found = _recover(dirs, _config(fti), 2, 0)
    assert (found.level, found.ckpt_id, found.path.name) == (2, 2, "Ckpt2-Pcof1.fti")


def test_nranks_verifies_each_ranks_part_of_an_mpiio_file(tmp_path, dirs):
    """Level 4 of an MPI-IO run is one file: with ``nranks``, every rank's part is verified with its meta section
    (before, the shared file was checked as a POSIX file, refused, and no rank could recover anything)."""
    path, _meta = _write_fti_mpiio(tmp_path / "fti", 8, [0, 1, 2, 3])
    config = _mpiio_config(tmp_path / "fti")
    for rank in range(4):
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, rank, 0x77)
        assert recover_fti_run(ctx, config, rank, nranks=4).path == path and _same(arrays, rank)
        ctx.finalize()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # rank 3's last byte: no rank recovers level 4 now
    path.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, 0x77)
    with pytest.raises(NoCheckpointError, match="not every one of the 4 ranks"):
        recover_fti_run(ctx, config, 0, nranks=4)
    assert all(a.tobytes() == bytes([0x77]) * a.nbytes for a in arrays.values())
    ctx.finalize()


def test_nranks_with_heads_counts_the_ranks_of_the_communicator_named(tmp_path, dirs):
    """node_size 3 with heads: the 4 application ranks are global 1, 2, 4, 5. ``nranks`` counts ranks as ``comm``
    does (before, every number below nranks was taken as a global rank, a head's among them: a ConfigError)."""
    root = tmp_path / "fti"
    config = _heads_config(root, 2)
    _l1(root, 5, 2)
    for app, glob in enumerate((1, 2, 4, 5)):
        assert _heads_recover(dirs, config, app, _l1_bytes(glob), comm="app", nranks=4).ckpt_id == 5
        assert _heads_recover(dirs, config, glob, _l1_bytes(glob), comm="global", nranks=2 * NODE_SIZE).ckpt_id == 5
    (_local(root, 1, 1) / "Ckpt5-Rank5.fti").unlink()  # the last application rank's file
    with pytest.raises(NoCheckpointError, match="not every one of the 4 ranks"):
        _heads_recover(dirs, config, 0, _l1_bytes(1), comm="app", nranks=4)
    with pytest.raises(ftidask.ConfigError, match="nranks = 2.*above rank 2.*app communicator"):
        _heads_recover(dirs, config, 2, _l1_bytes(4), comm="app", nranks=2)


def _ranks_config(tmp_path):
    return load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                       meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, verbosity=4)


def _arrays(ctx, rank: int, ckpt: int, grow: int = 0) -> dict[int, np.ndarray]:
    """Rank ``rank``'s variables of checkpoint ``ckpt`` of tests/data/fti_written/r2 protected, filled with 7s;
    ``grow``: variable 0 that many items longer (a size its file does not hold)."""
    arrays = {}
    for vid, raw in _expected(ckpt, rank).items():
        nbytes = len(raw) + (grow * DTYPES[vid].itemsize if vid == 0 else 0)
        arrays[vid] = np.frombuffer(bytearray([7]) * nbytes, DTYPES[vid])
        ctx.protect(vid, arrays[vid])
    return arrays


def _on_two_ranks(tmp_path, call):
    """``call(ctx, t)`` on each of 2 ranks of one context: ``(results by rank, errors)``."""
    cfg = _ranks_config(tmp_path)

    def program(t):
        ctx = Context(cfg, t)
        try:
            return call(ctx, t)
        except ftidask.FTIError as exc:
            return type(exc).__name__, str(exc)
        finally:
            ctx._close()

    return run_ranks(cfg, 2, program, wait=60)


def test_one_ranks_refused_argument_is_every_ranks_error(tmp_path):
    """Rank 1 names no rank: before, it raised alone and rank 0 waited for it in the next collective."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    config = _config(fti)
    results, errors = _on_two_ranks(tmp_path, lambda ctx, t: recover_fti_run(
        ctx, config, t.rank if t.rank == 0 else "one"))
    assert errors == [], errors
    assert [r[0] for r in results] == ["RecoveryError"] * 2, results
    assert all("rank 1" in r[1] and "non-negative int" in r[1] for r in results), results


def test_one_ranks_unexpected_failure_is_every_ranks_error(tmp_path):
    """Rank 1's reading of its file fails with an error no one expects (out of memory, injected through the
    context's seam): every rank raises, none waits."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    config = _config(fti)

    def call(ctx, t):
        _arrays(ctx, t.rank, 2)
        if t.rank == 1:
            def refused(*args, **kwargs):
                raise MemoryError("injected")
            ctx._prepare_file = refused
        return recover_fti_run(ctx, config, t.rank)

    results, errors = _on_two_ranks(tmp_path, call)
    assert errors == [], errors
    assert [r[0] for r in results] == ["RecoveryError"] * 2, results
    assert all("rank 1: MemoryError: injected" in r[1] for r in results), results


def test_a_checkpoint_one_ranks_arrays_do_not_fit_leaves_every_rank_untouched(tmp_path):
    """Rank 1's variable 0 is an item longer than its file holds; rank 0's fit. Before, rank 0 wrote its arrays and
    then learned that rank 1 refused the checkpoint: NoCheckpointError with rank 0's arrays holding it."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    config = _config(fti)

    def call(ctx, t):
        arrays = _arrays(ctx, t.rank, 2, grow=t.rank)
        try:
            recover_fti_run(ctx, config, t.rank)
        except NoCheckpointError as exc:
            untouched = all(a.tobytes() == bytes([7]) * a.nbytes for a in arrays.values())
            return "NoCheckpointError", str(exc), untouched
        return "recovered"

    results, errors = _on_two_ranks(tmp_path, call)
    assert errors == [], errors
    assert [(r[0], r[2]) for r in results] == [("NoCheckpointError", True)] * 2, results
    assert "another rank cannot recover it" in results[0][1] and "variable 0" in results[1][1], results


def test_ranks_given_other_runs_or_the_same_rank_are_refused_everywhere(tmp_path):
    """Rank 1's config says ``failure = 2`` (level 4 only): it raised a raw KeyError over rank 0's level-1 keys and
    rank 0 waited in the next collective. Two ranks naming one rank of the run would each read the same file."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    configs = [_config(fti / "a"), _config(fti / "b", failure=2)]
    for c in configs:  # the same directories: fti/a and fti/b name the run at fti/
        c.write_text(c.read_text().replace(str(c.parent), str(fti)))
    results, errors = _on_two_ranks(tmp_path / "one", lambda ctx, t: recover_fti_run(ctx, configs[t.rank], t.rank))
    assert errors == [], errors
    assert [r[0] for r in results] == ["RecoveryError"] * 2 and all("failure=2" in r[1] for r in results), results
    results, errors = _on_two_ranks(tmp_path / "two", lambda ctx, t: recover_fti_run(ctx, configs[0], 0))
    assert errors == [], errors
    assert [r[0] for r in results] == ["RecoveryError"] * 2, results
    assert all("ranks [0, 0]" in r[1] and "each must name a different one" in r[1] for r in results), results


def test_recover_fti_run_inside_another_call_of_the_context_is_refused(tmp_path, dirs):
    """Called from a signal handler while checkpoint() runs on the same thread (simulated by a hook inside it), the
    arrays were overwritten in the middle of the checkpoint: the context's one-call-at-a-time guard now refuses it, as
    it refuses recover_file there."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    config = _config(fti)
    ctx = ftidask.init(**dirs)
    a = np.full(16, 5, "<i4")
    ctx.protect(0, a)
    refused = []
    real = ctx._check_level

    def inside(*args, **kwargs):
        try:
            recover_fti_run(ctx, config, 0)
        except ftidask.FTIError as exc:
            refused.append(str(exc))
        return real(*args, **kwargs)

    ctx._check_level = inside
    ctx.checkpoint(1, 1)
    assert len(refused) == 1 and "recover_fti_run() was called while checkpoint()" in refused[0], refused
    assert (a == 5).all()
    ctx.finalize()


def test_an_open_incremental_checkpoint_is_the_calls_own_refusal(tmp_path, dirs):
    """With an iCP open, each file's read was refused and taken for a file that cannot be recovered: every file was
    verified (a level-3 one rebuilt in FTI's run), then NoCheckpointError, which a program takes for a fresh start.
    The context's refusal comes first, as recover_file's, no file looked at."""
    fti = tmp_path / "fti"
    _place(fti, 1, 2)
    ctx = ftidask.init(**dirs)
    arrays = _arrays(ctx, 0, 2)
    ctx.init_icp(5, 1)
    with pytest.raises(ftidask.RecoveryError, match="incremental checkpoint 5 is open") as raised:
        recover_fti_run(ctx, _config(fti), 0)
    assert not isinstance(raised.value, NoCheckpointError)
    assert all(a.tobytes() == bytes([7]) * a.nbytes for a in arrays.values())
    ctx._close()
