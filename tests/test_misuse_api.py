"""Misuse of the API in one process: each bad argument is a clear ftidask error at the call, naming the argument,
and leaves the arrays and the previous checkpoint as they were."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask import CheckpointError, ConfigError, NoCheckpointError, ProtectError, RecoveryError, StagingError
from ftidask.storage.files import find_paths


@pytest.fixture
def ctx(dirs):
    with ftidask.init(**dirs) as context:
        yield context


def _written(ctx) -> np.ndarray:
    a = np.arange(6.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    a[:] = -1
    return a


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ckpt_id": "1"}, r"recover\(ckpt_id=\.\.\.\): a checkpoint id must be an int, got '1'"),
    ({"ckpt_id": 1.0}, r"recover\(ckpt_id=\.\.\.\): a checkpoint id must be an int, got 1.0"),
    ({"level": "1"}, r"recover\(level=\.\.\.\) takes a checkpoint level 1-8 \(or None for any\), got '1'"),
    ({"level": 9}, r"recover\(level=\.\.\.\) takes a checkpoint level 1-8"),
    ({"level": True}, r"recover\(level=\.\.\.\) takes a checkpoint level 1-8"),
])
def test_recover_arguments_are_checked(ctx, kwargs, match) -> None:
    # Before: a str "1" named no checkpoint: NoCheckpointError for a run whose checkpoint 1 is there.
    a = _written(ctx)
    with pytest.raises(RecoveryError, match=match) as info:
        ctx.recover(**kwargs)
    assert not isinstance(info.value, NoCheckpointError)
    assert (a == -1).all()
    ctx.recover(ckpt_id=np.int64(1), level=np.int32(1))
    assert (a == np.arange(6.0)).all()


def test_recover_while_an_incremental_checkpoint_is_open_is_refused(ctx) -> None:
    # Before: the recovery ran, and finalize_icp committed variable 1 from before it beside 2 from after it.
    a, b = np.arange(3.0), np.arange(3.0) + 10
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 1)
    a[:], b[:] = 5, 6
    ctx.init_icp(2, 1)
    ctx.add_var_icp(1)
    with pytest.raises(RecoveryError, match="incremental checkpoint 2 is open; finalize_icp"):
        ctx.recover()
    file = next(iter(find_paths(Path(ctx.paths.ckpt_dir), "Ckpt1-Rank0.fti")))
    with pytest.raises(RecoveryError, match="incremental checkpoint 2 is open; finalize_icp"):
        ctx.recover_file(file)  # the same mix (it ran)
    assert (a == 5).all() and (b == 6).all()
    ctx.add_var_icp(2)
    ctx.finalize_icp()
    a[:], b[:] = 0, 0
    ctx.recover()
    assert ctx.recovered_from == (2, 1) and (a == 5).all() and (b == 6).all()


def _open_files_under(root: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    out = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_finalize_with_an_incremental_checkpoint_open_closes_its_file(dirs, tmp_path) -> None:
    ctx = ftidask.init(**dirs, keep_last_ckpt=1)
    a = np.arange(4.0)
    ctx.protect(1, a)
    ctx.protect(2, np.zeros(3))
    ctx.checkpoint(1, 1)
    ctx.init_icp(2, 1)
    ctx.add_var_icp(1)
    ctx.finalize()  # before: the open checkpoint's file stayed open (and its directory stayed)
    assert _open_files_under(tmp_path) == []
    assert not list(tmp_path.glob("Local/**/ckpt2.*")), list(tmp_path.glob("Local/**/ckpt2.*"))
    with ftidask.init(**dirs) as again:  # the kept checkpoint is the one recovered
        b = np.zeros(4)
        again.protect(1, b)
        again.protect(2, np.zeros(3))
        again.recover()
        assert (b == a).all() and again.recovered_from[0] == 1


def test_checkpoint_wait_must_be_a_bool(ctx) -> None:
    a = _written(ctx)
    with pytest.raises(CheckpointError, match=r"checkpoint\(wait=\.\.\.\) takes True, False or None, got 'no'"):
        ctx.checkpoint(2, 1, wait="no")  # before: taken as true (a blocking checkpoint)
    ctx.recover()
    assert ctx.recovered_from == (1, 1) and (a == np.arange(6.0)).all()


@pytest.mark.parametrize("array", [[1, 2, 3], "x", 3.0])
def test_realloc_takes_an_array_or_none(ctx, array) -> None:
    _written(ctx)
    with pytest.raises(ProtectError,
                       match=r"realloc\(id, array\): array must be a numpy.ndarray, a CuPy array or None"):
        ctx.realloc(1, array)  # before: silently ignored


@pytest.mark.parametrize("name", [123, b"x", ["x"]])
def test_protect_name_must_be_a_str(ctx, name) -> None:
    with pytest.raises(ProtectError, match=r"name=\.\.\.\) takes a str"):
        ctx.protect(1, np.zeros(3), name=name)  # before: stored as 123, b'x', ['x']
    assert 1 not in ctx.protected


def test_protect_replicated_must_be_a_bool(ctx) -> None:
    with pytest.raises(ProtectError, match="replicated must be True or False, got 'no'"):
        ctx.protect(1, np.zeros(3), replicated="no")  # before: "no" declared it replicated
    ctx.protect(1, np.zeros(3), replicated=np.bool_(False))


@pytest.mark.parametrize("value", [None, 3])
def test_directory_keys_must_be_paths(tmp_path, monkeypatch, value) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'\[basic\] ckpt_dir': expected a directory path"):
        ftidask.init(ckpt_dir=value, glbl_dir=str(tmp_path / "g"), meta_dir=str(tmp_path / "m"))
    assert not (tmp_path / str(value)).exists()  # before: a directory ./None (or ./3) was the run's


@pytest.mark.parametrize("key", ["ckpt_dir", "glbl_dir"])
def test_a_run_directory_that_is_a_file_is_refused_at_init(dirs, tmp_path, key) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="a run directory is a file: .*a-file exists and is not a directory"):
        ftidask.init(**{**dirs, key: str(path)})  # before: init went on, the first checkpoint failed
    assert path.read_text() == "x"


def test_staging_arguments_are_checked(dirs) -> None:
    with ftidask.init(**dirs, enable_staging=1) as ctx:
        for call in (lambda: ctx.stage_status("abc"), lambda: ctx.stage_status(1.5), lambda: ctx.stage_info(None),
                     lambda: ctx.wait_staged("x")):
            with pytest.raises(StagingError, match="a staging request id is the int send_file returned"):
                call()  # before: int("abc") raised ValueError; 1.5 was taken as request 1
        with pytest.raises(StagingError, match=r"wait_staged\(timeout=\.\.\.\) takes seconds"):
            ctx.wait_staged(None, "x")
        with pytest.raises(StagingError, match="send_file: local_path must be a path"):
            ctx.send_file(None, "x")
        path = ctx.stage_dir() / "f"
        path.write_bytes(b"1")
        with pytest.raises(StagingError, match="send_file: remote_path must be a path"):
            ctx.send_file(path, None)
        assert ctx.stage_status(np.int64(999)) == ftidask.SI_NINI


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"every": "10"}, "every must be an int, got '10'"),  # before: TypeError '<' not supported between str and int
    ({"iterations": 3.5}, "iterations must be an int, got 3.5"),
    ({"rng": 5}, "rng must be a numpy.random.Generator or BitGenerator, got 5"),  # before: protect's message
    ({"state": [1]}, "state must be a dict of JSON values, got list"),
])
def test_resilient_loop_arguments_are_checked(ctx, kwargs, match) -> None:
    with pytest.raises(ftidask.FTIError, match=match):
        ftidask.ResilientLoop(ctx, arrays={1: np.zeros(3)}, **{"every": 1, "iterations": 3, **kwargs})
