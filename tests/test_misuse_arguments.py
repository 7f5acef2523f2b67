"""Arguments of the public API that were taken silently or raised a traceback from deep inside: each is now a
clear ftidask error at the call, naming the argument and what it takes, with nothing half done."""

from __future__ import annotations

import numpy as np
import pytest

import ftidask
from ftidask import CheckpointError, ConfigError, FormatError, LevelError, ProtectError, RecoveryError, StagingError


def _restarted(dirs) -> tuple[ftidask.Context, np.ndarray]:
    """A run whose checkpoint 1 (level 1) holds variable 1 = 0..5, and a second init of it: a restart (status 1)
    with nothing protected yet (the first context stays open: it holds the run, as a dead process would not)."""
    first = ftidask.init(**dirs)
    first.protect(1, np.arange(6.0))
    first.checkpoint(1, 1)
    again = ftidask.init(**dirs)
    assert again.status() == 1
    return again, first


@pytest.mark.parametrize("call", ["recover", "snapshot"])
def test_recover_with_nothing_protected_is_refused(dirs, call) -> None:
    # Before: recover() returned {} and set status() to 0 (a full recovery, as FTI_Recover's success sets it);
    # the program went on from its initial values and its next checkpoint replaced the one it meant to recover.
    # FTI_Recover refuses a checkpoint with more variables than are protected (FTI_NREC).
    ctx, _first = _restarted(dirs)
    with pytest.raises(RecoveryError, match=r"holds variables \[1\], and no variable is protected: protect the "
                                            r"arrays \(and Python states\) to fill before recover\(\)"):
        getattr(ctx, call)()
    assert ctx.status() == 1 and ctx.recovered_from is None
    a = np.zeros(6)
    ctx.protect(1, a)
    getattr(ctx, call)()
    assert ctx.status() == 0 and ctx.recovered_from == (1, 1) and (a == np.arange(6.0)).all()


def test_recover_file_takes_paths(dirs) -> None:
    ctx, _first = _restarted(dirs)
    a = np.zeros(6)
    ctx.protect(1, a)
    for kwargs, match in (({"path": None}, r"recover_file\(path=\.\.\.\) takes a path \(str or os.PathLike\), "
                                           r"got NoneType None"),
                          ({"path": 5}, r"recover_file\(path=\.\.\.\) takes a path .*got int 5"),
                          ({"path": "x.fti", "meta": 5}, r"recover_file\(meta=\.\.\.\) takes a path \(str or "
                                                         r"os.PathLike\) or None, got int 5")):
        with pytest.raises(RecoveryError, match=match):  # before: TypeError from pathlib
            ctx.recover_file(**kwargs)
    assert (a == 0).all()
    ctx.recover()
    assert (a == np.arange(6.0)).all()


def test_bool_arguments_take_bools(dirs) -> None:
    with ftidask.init(**dirs, enable_dcp=1) as ctx:
        a = np.arange(4.0)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        # Before: "no" was true: a differential checkpoint 2 was written.
        with pytest.raises(LevelError, match=r"checkpoint\(dcp=\.\.\.\) takes True or False, got 'no'"):
            ctx.checkpoint(2, 1, dcp="no")
        assert ctx.last_checkpoint.id == 1
        # Before: "no" was true: checkpoint 3 was opened, and the program's add_var_icp wrote it.
        with pytest.raises(CheckpointError, match=r"init_icp\(activate=\.\.\.\) takes True or False, got 'no'"):
            ctx.init_icp(3, 1, activate="no")
        with pytest.raises(CheckpointError, match="no incremental checkpoint is open"):
            ctx.add_var_icp(1)
        # Before: "no" was true: the name got a new id.
        with pytest.raises(ProtectError, match=r"var_id\(create=\.\.\.\) takes True or False, got 'no'"):
            ctx.var_id("x", create="no")
        assert ctx.var_id("x", create=False) is None
        ctx.init_icp(4, 1, activate=np.bool_(True))
        ctx.add_var_icp(np.int64(1))  # before: "variable 1 is not protected" (a NumPy int was no id here)
        assert ctx.finalize_icp().id == 4
        assert ctx.checkpoint(5, 1, dcp=np.bool_(True)).level == 5  # L1_DCP


def test_add_var_icp_says_what_an_id_is(dirs) -> None:
    with ftidask.init(**dirs) as ctx:
        ctx.protect(1, np.zeros(3))
        ctx.init_icp(1, 1)
        for bad in (None, "1", 1.0):  # before: "variable None is not protected"
            with pytest.raises(ProtectError, match=r"add_var_icp: variable id must be an int, got"):
                ctx.add_var_icp(bad)
        ctx.add_var_icp(1)
        assert ctx.finalize_icp().id == 1


def test_a_name_names_one_variable(dirs) -> None:
    with ftidask.init(**dirs) as ctx:
        # Before: taken; var_id("") is refused, so the variable could not be found by its name.
        with pytest.raises(ProtectError, match=r"name=\.\.\.\) takes a non-empty str"):
            ctx.protect(1, np.zeros(3), name="")
        ctx.protect(1, np.zeros(3), name="u")
        ctx.protect(1, np.ones(3), name="u")  # the same variable again: its name stays its own
        # Before: taken; var_id("u") then gave 1, and the Zarr export and a restart's var_id one of the two.
        with pytest.raises(ProtectError, match=r"protect\(2, \.\.\., name='u'\): the name is variable 1's"):
            ctx.protect(2, np.zeros(3), name="u")
        given = ctx.var_id("v")
        with pytest.raises(ProtectError, match=rf"protect\({given + 1}, \.\.\., name='v'\): the name is variable "
                                               rf"{given}'s"):
            ctx.protect(given + 1, np.zeros(3), name="v")  # before: taken, and var_id("v") gave the other id
        ctx.protect(given, np.zeros(3), name="v")
        assert sorted(ctx.protected) == [1, given] and ctx.var_id("u") == 1 and ctx.var_id("v") == given


def test_load_config_base_must_be_a_config() -> None:
    for base in (5, "config.fti", {"verbosity": 2}):  # before: TypeError from dataclasses.asdict
        with pytest.raises(ConfigError, match=r"load_config\(base=\.\.\.\) takes an ftidask.Config, got"):
            ftidask.load_config(base=base)
    assert ftidask.load_config(base=ftidask.load_config(verbosity=2), head=1).verbosity == 2


def test_a_global_shape_beyond_numpy_sizes_is_refused(dirs) -> None:
    with ftidask.init(**dirs) as ctx:
        # Before: recorded; a restart on another number of ranks then failed deep inside.
        with pytest.raises(ProtectError, match=r"global_shape \(1180591620717411303424,\) does not fit NumPy's "
                                               "64-bit sizes"):
            ctx.protect(1, np.zeros(3), global_shape=(2**70,), offset=(0,))
        assert 1 not in ctx.protected


def test_staging_calls_without_staging_are_staging_errors(dirs) -> None:
    with ftidask.init(**dirs) as ctx:  # enable_staging = 0, the default
        for call in (ctx.stage_dir, lambda: ctx.send_file("a", "b"), lambda: ctx.stage_status(1),
                     lambda: ctx.stage_info(1), ctx.wait_staged):
            with pytest.raises(StagingError, match="staging is disabled: set enable_staging = 1"):
                call()  # before: the base FTIError, which `except StagingError` missed


def test_zarr_functions_take_store_paths(dirs, tmp_path) -> None:
    pytest.importorskip("zarr")
    from ftidask.tools.zarr_export import export_checkpoint, import_zarr, read_zarr

    with ftidask.init(**dirs) as ctx:
        ctx.protect(1, np.arange(3.0))
        ctx.checkpoint(1, 1)
        for bad in (None, 5):  # before: TypeError from pathlib
            with pytest.raises(FormatError, match=r"export_checkpoint\(dest=\.\.\.\) takes the path of a Zarr store"):
                export_checkpoint(None, bad, **dirs)
            with pytest.raises(FormatError, match=r"read_zarr\(path=\.\.\.\) takes the path of a Zarr store"):
                read_zarr(bad)
            with pytest.raises(FormatError, match=r"import_zarr\(path=\.\.\.\) takes the path of a Zarr store"):
                import_zarr(bad, None, **dirs)
        assert not (tmp_path / "None").exists() and not (tmp_path / "5").exists()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"ctx": None}, ftidask.FTIError, "ctx must be the context ftidask.init.. returns, got NoneType"),  # AttributeError
    ({"arrays": 5}, ftidask.FTIError, "arrays must be a dict of variable id -> array, got int"),  # TypeError
    ({"level": 9}, LevelError, "unknown checkpoint level 9"),  # before: taken, refused at the first checkpoint
    ({"stop_level": "4"}, LevelError, "unknown checkpoint level '4'"),  # before: refused only at a signal
])
def test_resilient_loop_refuses_its_arguments_at_once(dirs, kwargs, error, match) -> None:
    with ftidask.init(**dirs) as ctx:
        args = {"ctx": ctx, "arrays": {1: np.zeros(3)}, "every": 1, "iterations": 3, **kwargs}
        with pytest.raises(error, match=match):
            ftidask.ResilientLoop(args.pop("ctx"), **args)
        assert 1 not in ctx.protected


def test_a_dict_as_the_config_says_to_give_keywords() -> None:
    # A Python user's first guess: init({"ckpt_dir": ...}); the error says how settings are given.
    with pytest.raises(ConfigError, match=r"got dict \{'ckpt_dir': 'x'\}; give settings as keywords instead, "
                                          r"e.g. init\(\*\*settings\)"):
        ftidask.init({"ckpt_dir": "x"})
    with pytest.raises(ConfigError, match=r"got int 5$"):
        ftidask.load_config(5)


def test_a_labelled_array_is_refused_naming_what_to_protect(tmp_path):
    """A NumPy-backed xarray DataArray was refused as 'a dask array' (every xarray object has __dask_graph__)."""
    xr = pytest.importorskip("xarray")
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4)
    with pytest.raises(ftidask.ProtectError, match=r"DataArray; protect the array it holds, its \.data"):
        ctx.protect(1, xr.DataArray(np.zeros(3)))
    ctx.finalize()


def test_a_resilient_loop_refused_at_an_array_leaves_the_protections_as_they_were(dirs) -> None:
    """An array the loop cannot protect (here the second) refuses the loop; the first array's protect was left in
    place (a loop that never ran had registered it, and the next checkpoint wrote it), and an id protected before
    the loop lost its array for the loop's."""
    with ftidask.init(**dirs) as ctx:
        kept = np.arange(4.0)
        ctx.protect(3, kept)
        with pytest.raises(ftidask.ProtectError):
            ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3), 3: np.ones(2), 2: object()}, every=1, iterations=3)
        assert list(ctx.protected) == [3] and ctx.protected[3] is kept
        loop = ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, every=1, iterations=2)  # a loop can still be made
        assert [i for i in loop] == [0, 1]
