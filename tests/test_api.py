"""The FTI API's contract in one process: errors, status, retention, resizing, snapshot."""

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.model import constants
from ftidask.storage.files import find_paths


def _ckpt_dirs(dirs):
    return sorted(p.name for p in Path(dirs["ckpt_dir"]).glob("node0/*/l*/ckpt*")) + sorted(
        "g:" + p.name for p in Path(dirs["glbl_dir"]).glob("*/l4/ckpt*"))


def test_bad_input_is_refused_clearly(dirs):
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ProtectError, match="Python objects"):
        ctx.protect(1, np.array([object()]))
    with pytest.raises(ftidask.ProtectError, match="in place"):
        ctx.protect(1, [1, 2, 3])
    with pytest.raises(ftidask.ProtectError, match="must be an int"):
        ctx.protect("a", np.zeros(3))
    ctx.protect(1, np.zeros(3))
    with pytest.raises(ftidask.CheckpointError, match="id 0"):
        ctx.checkpoint(0, 1)
    with pytest.raises(ftidask.LevelError, match="unknown checkpoint level"):
        ctx.checkpoint(1, 9)
    with pytest.raises(ftidask.LevelError, match="MPI backend"):
        ctx.checkpoint(1, 2)
    with pytest.raises(ftidask.LevelError, match="enable_dcp"):
        ctx.checkpoint(1, 5)
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    with pytest.raises(ftidask.ConfigError, match="ckpt_io"):
        ftidask.init(ckpt_io=7, **dirs)
    with pytest.raises(ftidask.ConfigError, match="unknown config key"):
        ftidask.init(ckpt_l9=1, **dirs)
    with pytest.raises(ftidask.ConfigError, match="group_size"):
        ftidask.init(group_size="four", **dirs)


def test_config_file(tmp_path, dirs):
    cfg = tmp_path / "config.fti"
    body = "[basic]\n" + "".join(f"{k} = {v}\n" for k, v in dirs.items()) + "ckpt_l1 = 3\nckpt_io = 3\n"
    cfg.write_text(body + "[restart]\nfailure = 0\n[advanced]\nlocal_test = 1\nsnapshot_unit = iterations\n")
    ctx = ftidask.init(str(cfg))
    assert ctx.config.ckpt_l1 == 3 and ctx.config.local_test and ctx.config.snapshot_unit == "iterations"
    assert cfg.read_text().startswith(body)  # never rewritten
    bad = tmp_path / "bad.fti"
    bad.write_text("[basic]\nckpt_l1 = often\n")
    with pytest.raises(ftidask.ConfigError, match=r"\[basic\] ckpt_l1.*'often'"):
        ftidask.init(str(bad))
    bad.write_text("[basic]\nckpt_dri = x\n")
    with pytest.raises(ftidask.ConfigError, match="unknown key"):
        ftidask.init(str(bad))
    with pytest.raises(ftidask.ConfigError, match="does not exist"):
        ftidask.init(str(tmp_path / "missing.fti"))


def test_status_lifecycle(dirs):
    a = np.arange(10.0)
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 0
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    # died without finalize -> restart
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    ctx.protect(1, a)
    ctx.recover()
    ctx.finalize()
    # finalized without keep_last_ckpt -> fresh, checkpoints cleaned
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 0
    assert _ckpt_dirs(dirs) == []
    ctx.protect(1, a)
    ctx.checkpoint(3, 1)
    ctx = ftidask.init(keep_last_ckpt=1, **dirs)
    assert ctx.status() == 1
    ctx.protect(1, a)
    ctx.recover()
    ctx.finalize()
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 2
    b = np.zeros(10)
    ctx.protect(1, b)
    ctx.recover()
    assert ctx.recovered_from == (3, 4)
    np.testing.assert_array_equal(a, b)
    assert ctx.status() == 0  # FTI_Recover sets FTI_Status back to 0 (FTI_Exec.reco = 0)


def test_status_is_0_after_a_full_recovery_only(dirs):
    """FTI_Status returns FTI_Exec.reco, which every FTI_Recover (POSIX, FTI-FF, HDF5, dCP) sets to 0 once it
    succeeds, and FTI_RecoverVar leaves: a program asking FTI_Status after its recovery sees 0 (the wiki: "0: no
    checkpoints taken yet or recovered successfully"). A refused recovery or one of some variables leaves it as
    it was; a restart's snapshot(), which recovers, sets it to 0 too."""
    a, b = np.arange(10.0), np.arange(4)
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 1)
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    ctx.protect(1, np.zeros(3))
    with pytest.raises(ftidask.RecoveryError):
        ctx.recover()
    assert ctx.status() == 1
    x, y = np.zeros(10), np.zeros(4, b.dtype)
    ctx.protect(1, x)
    ctx.protect(2, y)
    ctx.recover(ids=[2])  # FTI_RecoverVar
    assert ctx.status() == 1 and (y == b).all() and (x == 0).all()
    ctx.recover()
    assert ctx.status() == 0 and (x == a).all()
    assert ctx.var_id("nothing", create=False) is None
    ctx = ftidask.init(**dirs)
    ctx.protect(1, x)
    ctx.protect(2, y)
    assert ctx.status() == 1 and ctx.snapshot() == ftidask.FTI_SCES and ctx.status() == 0
    ctx.finalize()


def test_exec_id_isolates_runs_sharing_directories(dirs):
    one = ftidask.init(exec_id="job-one", **dirs)
    a = np.full(5, 1.0)
    one.protect(1, a)
    one.checkpoint(1, 1)
    two = ftidask.init(exec_id="job-two", **dirs)
    assert two.status() == 0
    two.protect(1, np.zeros(5))
    with pytest.raises(ftidask.NoCheckpointError):
        two.recover()
    again = ftidask.init(exec_id="job-one", **dirs)
    assert again.status() == 1
    with pytest.raises(ftidask.ConfigError):
        ftidask.init(exec_id="../escape", **dirs)


def test_retention_and_id_reuse(dirs):
    ctx = ftidask.init(**dirs)
    a = np.zeros(4)
    ctx.protect(1, a)
    for ckpt_id, level in [(1, 1), (2, 4), (3, 1), (1, 1)]:
        a[:] = ckpt_id * 10 + level
        ctx.checkpoint(ckpt_id, level)
    # L1 #3 was replaced by the reused id 1; the L4 checkpoint stays.
    assert _ckpt_dirs(dirs) == ["ckpt1.s4", "g:ckpt2.s2"]
    ctx2 = ftidask.init(**dirs)
    b = np.zeros(4)
    ctx2.protect(1, b)
    ctx2.recover()
    assert ctx2.recovered_from == (1, 1) and b[0] == 11
    ctx2.recover(level=4)
    assert b[0] == 24
    ctx3 = ftidask.init(keep_l4_ckpt=1, **dirs)
    ctx3.protect(1, a)
    ctx3.checkpoint(5, 4)
    ctx3.checkpoint(6, 4)
    assert [n for n in _ckpt_dirs(dirs) if n.startswith("g:")] == ["g:ckpt2.s2", "g:ckpt5.s5", "g:ckpt6.s6"]


def test_size_mismatch_points_to_realloc_and_touches_nothing(dirs):
    ctx = ftidask.init(**dirs)
    a, b = np.arange(10.0), np.arange(7, dtype=np.int16).reshape(7, 1)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 1)
    ctx = ftidask.init(**dirs)
    x, y = np.full(10, -1.0), np.full(3, -1, np.int16)
    ctx.protect(1, x)
    ctx.protect(2, y)
    with pytest.raises(ftidask.RecoveryError, match="realloc"):
        ctx.recover()
    assert (x == -1).all() and (y == -1).all()
    assert ctx.stored_size(2) == b.nbytes
    y = ctx.realloc(2, y)
    assert y.shape == (7, 1) and y.dtype == np.int16
    ctx.recover()
    np.testing.assert_array_equal(x, a)
    np.testing.assert_array_equal(y, b)
    assert ctx.stored_size(99) == 0  # FTI_GetStoredSize: 0, no size stored for that id


def test_grow_shrink_stored_size(dirs):
    ctx = ftidask.init(**dirs)
    a = np.arange(100, dtype=np.int64)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    assert ctx.stored_size(1) == 800
    a = np.arange(250, dtype=np.int64)
    ctx.protect(1, a)
    ctx.checkpoint(2, 1)
    assert ctx.stored_size(1) == 2000
    a = np.arange(30, dtype=np.int64)
    ctx.protect(1, a)
    ctx.checkpoint(3, 1)
    ctx = ftidask.init(**dirs)
    assert ctx.stored_size(1) == 240
    out = ctx.realloc(1, np.zeros(1, np.int64))
    ctx.recover()
    np.testing.assert_array_equal(out, np.arange(30))


def test_snapshot_iterations(dirs):
    a = np.zeros(3)
    ctx = ftidask.init(ckpt_l1=2, ckpt_l4=3, snapshot_unit="iterations", **dirs)
    ctx.protect(1, a)
    results = []
    for i in range(1, 7):
        a[:] = i
        results.append(ctx.snapshot())
    assert results == [constants.FTI_SCES, constants.FTI_DONE, constants.FTI_DONE, constants.FTI_DONE,
                       constants.FTI_SCES, constants.FTI_DONE]
    ctx2 = ftidask.init(ckpt_l1=2, snapshot_unit="iterations", **dirs)
    b = np.zeros(3)
    ctx2.protect(1, b)
    assert ctx2.snapshot() == constants.FTI_SCES  # recovers on restart
    assert b[0] == 6


def test_context_manager_and_repr(dirs):
    with ftidask.init(**dirs) as ctx:
        ctx.protect(3, np.zeros(2), name="temperature")
        info = ctx.checkpoint(1, 1)
        assert info.id == 1 and info.level == 1 and info.bytes_written == 16 and info.seconds >= 0
        assert "temperature" in repr(ctx) and "temperature" in ctx._repr_html_()
    with pytest.raises(ftidask.FTIError, match="finalized"):
        ctx.checkpoint(2, 1)


def test_module_paths_documented_before_the_layers_still_import():
    """`ftidask.constants`, `ftidask.errors`, `ftidask.zarr_export` and `ftidask.staging.StageInfo` were the
    documented homes of these names before the package was split into layers; user code imports them."""
    import ftidask.constants as constants
    import ftidask.errors as errors
    from ftidask.staging import StageInfo
    from ftidask.staging.stager import StageInfo as moved
    from ftidask.tools import zarr_export as tools_export
    from ftidask.zarr_export import ExportResult, export_checkpoint, import_zarr, read_zarr

    assert constants.FTI_SCES == ftidask.FTI_SCES and constants.init_type is ftidask.init_type
    assert errors.CheckpointError is ftidask.CheckpointError and errors.FTIError is ftidask.FTIError
    assert StageInfo is moved
    assert (export_checkpoint, import_zarr, read_zarr, ExportResult) == (
        tools_export.export_checkpoint, tools_export.import_zarr, tools_export.read_zarr, tools_export.ExportResult)


def test_a_run_restarted_from_a_kept_checkpoint_that_dies_restarts_with_status_1(dirs):
    """Status 2 describes the restart from a checkpoint kept at finalize, once: the execution it starts is a
    running one, and if it dies the next start is a restart after a failure (status 1) of its newest checkpoint."""
    a = np.arange(10.0)
    ctx = ftidask.init(keep_last_ckpt=1, **dirs)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx.finalize()
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 2
    ctx.protect(1, a)
    ctx.recover()
    a += 1
    ctx.checkpoint(2, 1)
    ctx._close()  # dies: no finalize
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    b = np.zeros(10)
    ctx.protect(1, b)
    ctx.recover()
    assert ctx.recovered_from == (2, 1)
    np.testing.assert_array_equal(a, b)
    ctx.finalize()


def test_stored_size_is_0_where_nothing_is_stored(dirs):
    """FTI_GetStoredSize returns 0 when it has no stored size ("0: No success"; FTI's docs test it with
    ``if (FTI_GetStoredSize(1) == 0)``): a fresh run before its first checkpoint, an id the checkpoint does not hold
    (on a restart too). A size stored is the size at the last checkpoint, not the protected array's."""
    ctx = ftidask.init(**dirs)
    a = np.arange(10.0)
    ctx.protect(1, a)
    assert ctx.stored_size(1) == 0 and ctx.stored_size(99) == 0
    ctx.checkpoint(1, 1)
    ctx.protect(1, np.arange(20.0))
    assert ctx.stored_size(1) == 80 and ctx.stored_size(99) == 0
    ctx = ftidask.init(**dirs)  # a restart: the checkpoint's sizes
    assert ctx.status() == 1 and ctx.stored_size(1) == 80 and ctx.stored_size(2) == 0
    ctx.finalize()


@pytest.mark.parametrize("mode", [1, 2, 4, 5])
def test_fti_io_modes_load_and_files_are_fti_ff(tmp_path, caplog, mode):
    """FTI's config files name other I/O modes (its examples say ckpt_io = 1): the run starts, says it writes
    FTI-FF, and its checkpoints round-trip."""
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[basic]\nckpt_dir = {tmp_path}/L\nglbl_dir = {tmp_path}/G\nmeta_dir = {tmp_path}/M\n"
                   f"ckpt_io = {mode}\n")
    a = np.arange(1000.0)
    with caplog.at_level("WARNING", logger="ftidask"):
        ctx = ftidask.init(cfg)
    assert any("FTI-FF" in r.getMessage() and f"ckpt_io = {mode}" in r.getMessage() for r in caplog.records)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    b = np.zeros(1000)
    again = ftidask.init(cfg)  # died without finalize: a restart
    assert again.status() == 1
    again.protect(1, b)
    again.recover()
    assert np.array_equal(a, b)
    files = sorted(p.name for p in find_paths(tmp_path / "L", "*") if p.is_file())
    assert files and all(name.endswith(".fti") for name in files), files


def test_init_type_refuses_a_bad_size_with_an_ftidask_error():
    """FTI_InitType's size is a positive int: anything else is bad input, refused with an ftidask error (README:
    errors are ftidask.FTIError and subclasses), still a ValueError for code that caught the old one."""
    for bad in (0, -4, "8", 2.0, True, None, 2**31, np.int64(2**40)):
        with pytest.raises(ftidask.ProtectError, match="init_type"):
            ftidask.init_type(bad)
        with pytest.raises(ValueError):
            ftidask.init_type(bad)
    assert ftidask.init_type(np.int64(24)) == np.dtype((np.void, 24)) == ftidask.init_type(24)
