"""Symbolic links, races and permissions (issue 12, item 10): temporary files never follow a link,
the staging mover re-checks its paths when it copies, files and directories are private, and run
directories that another user could write to are refused."""

from __future__ import annotations

import os
import pwd
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask import SI_FAIL, SI_SCES, ConfigError
from ftidask.staging.stager import Stager, ThreadMover


def _dirs(root: Path, **kw):
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=3, **kw)


# --- temporary files -------------------------------------------------------------------------------------


def test_symlink_planted_at_a_temporary_name_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    meta = tmp_path / "m"
    meta.mkdir(mode=0o700)
    planted = meta / f".current_exec_id.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    ctx = ftidask.init(**_dirs(tmp_path))
    a = np.arange(100.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    assert victim.read_bytes() == b"precious"
    assert planted.is_symlink()  # left alone, not written through
    assert ftidask.init(**_dirs(tmp_path)).exec_id == ctx.exec_id  # current_exec_id written properly
    ctx.finalize()
    assert victim.read_bytes() == b"precious"


def test_symlink_planted_at_a_checkpoint_temporary_name_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(1000.0))
    ckpt_dir = ctx.paths.level_dir(1, 0) / "ckpt1.s1"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / f".Ckpt1-Rank0.fti.tmp-{os.getpid()}").symlink_to(victim)
    ctx.checkpoint(1, 1)
    assert victim.read_bytes() == b"precious"
    out = np.zeros(1000)
    ctx2 = ftidask.init(**_dirs(tmp_path))
    ctx2.protect(1, out)
    ctx2.recover()
    assert np.array_equal(out, np.arange(1000.0))


# --- the staging mover re-checks at copy time --------------------------------------------------------------


class HeldMover(ThreadMover):
    """A thread mover that starts copying only when told (so that the test can swap paths first)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def _run(self) -> None:
        self.go.wait(30)
        super()._run()


def _stager(tmp_path: Path) -> tuple[Stager, HeldMover, Path, Path]:
    stage = tmp_path / "l" / "stage"
    stage.mkdir(parents=True)
    glbl = tmp_path / "g"
    glbl.mkdir()
    mover = HeldMover()
    return Stager(stage, glbl, mover), mover, stage, glbl


def _finish(stager: Stager, mover: HeldMover, req_id: int) -> tuple[int, str]:
    mover.go.set()
    stager.wait(req_id, timeout=30)
    info = stager.table.info(req_id)
    stager.close(5)
    assert info is not None
    return info.state, info.reason


def test_destination_directory_swapped_for_a_symlink_is_not_followed(tmp_path):
    stager, mover, stage, glbl = _stager(tmp_path)
    (glbl / "out").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (stage / "f.dat").write_bytes(os.urandom(10_000))
    req = stager.send(stage / "f.dat", "out/f.dat")
    (glbl / "out").rename(glbl / "out.old")
    (glbl / "out").symlink_to(elsewhere)  # swapped after send_file checked it
    state, reason = _finish(stager, mover, req)
    assert state == SI_FAIL and "symbolic link" in reason
    assert list(elsewhere.iterdir()) == []  # nothing written outside glbl_dir
    assert (stage / "f.dat").exists()  # and the source is kept


def test_missing_destination_directory_planted_as_a_symlink_is_not_followed(tmp_path):
    stager, mover, stage, glbl = _stager(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (stage / "f.dat").write_bytes(os.urandom(1000))
    req = stager.send(stage / "f.dat", "new/deeper/f.dat")
    (glbl / "new").symlink_to(elsewhere)  # planted before the mover creates it
    state, reason = _finish(stager, mover, req)
    assert state == SI_FAIL and "symbolic link" in reason
    assert list(elsewhere.iterdir()) == []


def test_source_swapped_for_a_symlink_is_not_copied(tmp_path):
    stager, mover, stage, glbl = _stager(tmp_path)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"s" * 5000)  # same size, so that only the link gives it away
    (stage / "f.dat").write_bytes(b"x" * 5000)
    req = stager.send(stage / "f.dat", "f.dat")
    (stage / "f.dat").unlink()
    (stage / "f.dat").symlink_to(foreign)
    state, reason = _finish(stager, mover, req)
    assert state == SI_FAIL and "symbolic link" in reason
    assert not (glbl / "f.dat").exists()
    assert foreign.read_bytes() == b"s" * 5000


def test_staged_files_are_published_with_private_modes(tmp_path):
    stager, mover, stage, glbl = _stager(tmp_path)
    (stage / "f.dat").write_bytes(b"x" * 100)
    req = stager.send(stage / "f.dat", "sub/dir/f.dat")
    state, reason = _finish(stager, mover, req)
    assert state == SI_SCES, reason
    assert stat.S_IMODE(os.stat(glbl / "sub/dir/f.dat").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(glbl / "sub").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(glbl / "sub/dir").st_mode) == 0o700


# --- modes -------------------------------------------------------------------------------------------------


def _modes(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirs |= {stat.S_IMODE(os.lstat(os.path.join(dirpath, d)).st_mode) for d in dirnames}
        files |= {stat.S_IMODE(os.lstat(os.path.join(dirpath, f)).st_mode) for f in filenames}
    return files, dirs


@pytest.mark.parametrize("l4_format", ["ftiff", "zarr"])
@pytest.mark.parametrize("permissions, file_mode, dir_mode", [(None, 0o600, 0o700), ("group", 0o640, 0o750)])
def test_files_and_directories_are_created_without_group_or_world_access(tmp_path, permissions, file_mode,
                                                                           dir_mode, l4_format):
    """Zarr level 4 too: Zarr made the store and its missing parents with the umask's modes (the run's global
    directory group-writable, which the next init refused), and no fsync made the new directories' names durable."""
    if l4_format == "zarr":
        pytest.importorskip("zarr")
    extra = {} if permissions is None else {"permissions": permissions}
    old = os.umask(0o002)  # a permissive umask must not open them up
    try:
        ctx = ftidask.init(**_dirs(tmp_path, enable_dcp=1, dcp_block_size=512, keep_last_ckpt=1,
                                   enable_staging=1, l4_format=l4_format, **extra))
        a = np.arange(5000.0)
        ctx.protect(1, a)
        for i, level in enumerate((1, 5, 5, 4, 8, 1)):
            a[i] += 1
            ctx.checkpoint(i + 1, level)
        staged = ctx.stage_dir() / "out.dat"
        staged.write_bytes(b"x" * 100)
        ctx.wait_staged(ctx.send_file(staged, "results/out.dat"))
        files, dirs = _modes(tmp_path)
        ctx.finalize()
        after = _modes(tmp_path)
        again = ftidask.init(**_dirs(tmp_path, l4_format=l4_format, **extra))  # the run's directories taken
        again.protect(1, b := np.zeros_like(a))
        again.recover()
        assert np.array_equal(a, b)
        again.finalize()
    finally:
        os.umask(old)
    files.discard(0o664)  # the staged source, written by the test itself (it is moved, so gone)
    assert files == {file_mode} and dirs == {dir_mode}
    assert after[0] == {file_mode} and after[1] == {dir_mode}


# --- pre-existing run directories ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["meta_dir", "glbl_dir", "ckpt_dir"])
def test_group_writable_run_directory_is_refused(tmp_path, which):
    kw = _dirs(tmp_path)
    Path(kw[which]).mkdir(mode=0o700)
    os.chmod(kw[which], 0o770)
    with pytest.raises(ConfigError, match=r"writable by its group.*chmod go-w"):
        ftidask.init(**kw)
    assert not (tmp_path / "m" / "current_exec_id").exists()  # refused before anything was written
    os.chmod(kw[which], 0o700)
    ftidask.init(**kw).finalize()


def test_world_writable_run_subdirectory_is_refused_at_restart(tmp_path):
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    os.chmod(ctx.paths.run_meta, 0o777)
    with pytest.raises(ConfigError, match="writable by its group and others"):
        ftidask.init(**_dirs(tmp_path))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_run_directory_owned_by_another_user_is_refused(tmp_path):
    nobody = pwd.getpwnam("nobody").pw_uid
    meta = tmp_path / "m"
    meta.mkdir(mode=0o700)
    os.chown(meta, nobody, -1)
    with pytest.raises(ConfigError, match=f"owned by uid {nobody}"):
        ftidask.init(**_dirs(tmp_path))


def test_dask_workers_create_files_with_the_configured_modes(tmp_path, dask_client):
    da = pytest.importorskip("dask.array")
    client = dask_client  # the shared cluster of 2 worker processes (conftest.py)
    old = os.umask(0o002)
    try:
        ctx = ftidask.init(client=client, **_dirs(tmp_path, permissions="group", enable_dcp=1,
                                                  dcp_block_size=1024))
        ctx.protect(1, da.arange(20_000, chunks=5_000, dtype=np.float64))
        for i, level in enumerate((1, 2, 5, 5, 4)):
            ctx.checkpoint(i + 1, level)
        files, dirs = _modes(tmp_path)
        ctx.finalize()
    finally:
        os.umask(old)
    assert files == {0o640} and dirs == {0o750}


def test_a_zarr_store_and_an_archive_are_built_where_no_one_else_can_enter(tmp_path, monkeypatch):
    """``permissions = group`` lets the group into a checkpoint directory (0750). A Zarr store's directories were
    group-writable (the umask's 0775) while Zarr wrote them, and the mode fix that followed chmod-ed through links: a
    group member could plant a link to the user's key there and have it made readable. ``keep_l4_ckpt``'s archive
    was linked into directories copytree made 0775 too. Both are built inside a directory of mode 0700 now, and a
    link found in a store being written fails the checkpoint."""
    pytest.importorskip("zarr")
    import shutil

    from ftidask.storage import swap
    from ftidask.zarrfmt import store as zarr_store

    seen: dict[str, int] = {}
    restrict, copytree = zarr_store._restrict, shutil.copytree

    def at_restrict(root):
        seen["zarr"] = stat.S_IMODE(os.stat(os.path.dirname(root)).st_mode)
        return restrict(root)

    def at_copytree(src, dst, *a, **kw):
        seen.setdefault("archive", stat.S_IMODE(os.stat(os.path.dirname(dst)).st_mode))  # (called again inside)
        return copytree(src, dst, *a, **kw)

    monkeypatch.setattr(zarr_store, "_restrict", at_restrict)
    monkeypatch.setattr(swap.shutil, "copytree", at_copytree)
    old = os.umask(0o002)
    try:
        ctx = ftidask.init(**_dirs(tmp_path, permissions="group", l4_format="zarr", keep_l4_ckpt=1))
        ctx.protect(1, np.arange(1000.0))
        ctx.checkpoint(1, 4)
        assert seen == {"zarr": 0o700}

        def planted(root):
            os.symlink(tmp_path / "victim", os.path.join(root, "planted"))
            return restrict(root)

        (tmp_path / "victim").write_text("secret")
        os.chmod(tmp_path / "victim", 0o600)
        monkeypatch.setattr(zarr_store, "_restrict", planted)
        with pytest.raises(ftidask.CheckpointError, match="not a regular file or a directory"):
            ctx.checkpoint(2, 4)
        assert stat.S_IMODE(os.stat(tmp_path / "victim").st_mode) == 0o600
        ctx.finalize()  # checkpoint 1 archived (keep_l4_ckpt)
        assert seen == {"zarr": 0o700, "archive": 0o700}
        assert list((tmp_path / "g").glob("*/l4_archive/ckpt1.s1/Ckpt1-Rank0.zarr"))
    finally:
        os.umask(old)
