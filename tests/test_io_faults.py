"""I/O faults at the write and read sites that the other tests leave out (disk full, a read-only disk, a file
replaced by a directory), injected for real: a small tmpfs (root only, see ``diskfull``), full or remounted
read-only, or a directory planted at a file's name. One process, and ranks as threads (``run_ranks``); the
MPI and Dask backends: test_io_faults_backends.py.

Each fault must end in a clear ftidask error that says what and where, or be repaired by the level's
redundancy; the previous checkpoint stays recoverable and the context works once the fault is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import leaks
import numpy as np
import pytest
from diskfull import fill, tmpfs
from test_levels_inprocess import CFG, CKPT, make_group, own

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.levels import multilevel
from ftidask.model.config import load_config
from ftidask.storage.files import find_paths
from ftidask.transport.threads import run_group

# --- the error says where: a rank file on a full disk -------------------------------------------------------


@pytest.mark.parametrize(("level", "dcp", "icp"), [(1, 0, False), (4, 0, False), (5, 1, False), (1, 0, True)],
                         ids=["L1", "L4", "dCP", "iCP"])
def test_a_rank_file_on_a_full_disk_is_named_in_the_error(tmp_path, level, dcp, icp):
    """ENOSPC from a write() carries no file name: the error named no file ("rank 0: [Errno 28] No space
    left on device"). Now it names the file being written; the previous checkpoint stays, the next works."""
    with tmpfs(tmp_path / "fs", "1m") as fs:
        fs.chmod(0o700)
        where = "glbl_dir" if level == 4 else "ckpt_dir"
        dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
                "meta_dir": str(tmp_path / "Meta"), where: str(fs / "run"), "verbosity": 4, "enable_dcp": dcp}
        ctx = ftidask.init(**dirs)
        data = np.arange(20_000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, level)
        filler = fill(fs)
        data += 1
        fds = _descriptors(tmp_path)
        with pytest.raises(ftidask.CheckpointError, match="No space left on device") as failed:
            if icp:
                ctx.init_icp(2, level)
                ctx.add_var_icp(1)
                ctx.finalize_icp()
            else:
                ctx.checkpoint(2, level)
        named = "Spare-Rank0.fti" if dcp else "Ckpt2-Rank0.fti"  # dCP patches its spare in place
        assert named in str(failed.value) and str(fs) in str(failed.value), failed.value
        assert not [p for p in find_paths(fs, "*") if ".tmp-" in p.name]
        # no descriptor left open by the failed write (a remover thread deleting what it left is given time)
        assert leaks.settled(lambda: _descriptors(tmp_path), lambda now: now == fds) == fds
        filler.unlink()
        data += 1
        ctx.checkpoint(3, level)  # the fault gone, the same context checkpoints again
        ctx._close()
        _recovers_checkpoint_3(dirs, level)


def _descriptors(root: Path) -> list[str]:
    """What this process has open under ``root`` or as a userfaultfd (a dCP write tracker), by target: not a count,
    which the threads other tests leave (a Dask client closing) change for a moment (CI saw 55 for 54)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor of the listing itself
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root)) or target == "anon_inode:[userfaultfd]":
                out.append(target)
    return sorted(out)


def test_the_keep_last_flush_to_a_full_global_disk_names_both_files(tmp_path):
    """finalize's flush of the last checkpoint (keep_last_ckpt) copies the node-local file to the global file
    system: a failed copy names the file copied and where to (it named neither); the run stays restartable."""
    with tmpfs(tmp_path / "global", "1m") as glbl:
        glbl.chmod(0o700)
        dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(glbl / "G"), "meta_dir": str(tmp_path / "Meta"),
                "verbosity": 4, "keep_last_ckpt": 1}
        ctx = ftidask.init(**dirs)
        ctx.protect(1, np.arange(20_000.0))
        ctx.checkpoint(1, 1)
        filler = fill(glbl)
        with pytest.raises(ftidask.CheckpointError, match="No space left on device") as failed:
            ctx.finalize()
        (local,) = find_paths(tmp_path / "Local", "Ckpt1-Rank0.fti")
        assert f"'{local}' -> '{glbl / 'G'}" in str(failed.value), failed.value
        assert not [p for p in find_paths(glbl, "*") if ".tmp-" in p.name]
        filler.unlink()
        ctx = ftidask.init(**dirs)  # not finalized: it restarts from checkpoint 1
        out = np.zeros(20_000)
        ctx.protect(1, out)
        ctx.recover()
        assert ctx.recovered_from == (1, 1) and np.array_equal(out, np.arange(20_000.0))
        ctx.finalize()


# --- L2/L3 rebuild, in one process (the level code over a group of threads) -------------------------------


def _group(base: Path, level: int, sizes: list[int]) -> dict[int, bytes]:
    """Every member's file and the level's redundancy; the files' bytes (test_levels_inprocess's group)."""
    return make_group(base, level, sizes, 7)


def _rebuild(base: Path, level: int, sizes: list[int], data: dict[int, bytes], errors: list[list[str]] | None = None):
    def sound(i: int):
        digest = hashlib.sha256(data[i]).digest()
        return lambda p: p.is_file() and hashlib.sha256(p.read_bytes()).digest() == digest

    def step(ch):
        i, g = ch.index, ch.size
        return multilevel.rebuild(ch, CFG, level, CKPT, i, own(base, i), own(base, i).parent, sizes,
                                  sound(i)(own(base, i)), verify_own=sound(i), verify_partner=sound((i - 1) % g),
                                  errors=None if errors is None else errors[i])

    results, failures = run_group(len(sizes), step)
    assert failures == []
    return results


@pytest.mark.parametrize("level", [2, 3])
def test_a_directory_in_place_of_a_rank_file_is_rebuilt_over(tmp_path, level):
    """A rank file replaced by a directory (a node's file system damaged, or a wrong copy) is a lost file:
    the level brings it back, the directory moved out of its way."""
    sizes = [3000, 5000, 4000]
    data = _group(tmp_path, level, sizes)
    victim = own(tmp_path, 1)
    victim.unlink()
    victim.mkdir()
    (victim / "inside").write_bytes(b"x")
    assert _rebuild(tmp_path, level, sizes, data) == [True, True, True]
    assert victim.read_bytes() == data[1]


@pytest.mark.parametrize("level", [2, 3])
def test_a_rebuild_that_cannot_write_says_why(tmp_path, level):
    """The node of the lost file is full: the rebuild fails, and the level says why (it said nothing)."""
    sizes = [30_000, 50_000, 40_000]
    with tmpfs(tmp_path / "node1", "1m"):
        data = _group(tmp_path, level, sizes)
        own(tmp_path, 1).unlink()
        filler = fill(tmp_path / "node1")
        errors: list[list[str]] = [[], [], []]
        assert _rebuild(tmp_path, level, sizes, data, errors) == [True, False, True]
        assert any(str(own(tmp_path, 1)) in e and "No space left on device" in e for e in errors[1]), errors
        assert not [p for p in (tmp_path / "node1").iterdir() if ".tmp-" in p.name]
        filler.unlink()
        assert _rebuild(tmp_path, level, sizes, data) == [True, True, True]  # room again: rebuilt
        assert own(tmp_path, 1).read_bytes() == data[1]


# --- the engine over ranks as threads (run_ranks): L2/L3 on a node whose disk is full -------------------

NRANKS = 3


def _config(base: Path, **kw):
    return load_config(None, ckpt_dir=str(base / "Local"), glbl_dir=str(base / "Global"), meta_dir=str(base / "Meta"),
                       local_test=1, node_size=1, group_size=NRANKS, block_size=1, transfer_size=1, verbosity=4, **kw)


def _values(rank: int, version: int) -> np.ndarray:
    return np.arange(20_000, dtype=np.float64) * (rank + 1) + version


def _ranks(base: Path, program, **kw):
    results, errors = run_ranks(_config(base, **kw), NRANKS, lambda t: program(Context(_config(base, **kw), t), t.rank),
                                wait=60)
    assert errors == [], errors
    return results


def _recover(ctx: Context, rank: int):
    out = np.full(20_000, -7.0)
    ctx.protect(1, out)
    try:
        ctx.recover()
        return ctx.recovered_from, bool(np.array_equal(out, _values(rank, 1)))
    except ftidask.FTIError as exc:
        return type(exc).__name__, str(exc), bool((out == -7.0).all())
    finally:
        ctx._close()


@pytest.mark.parametrize("level", [2, 3])
def test_recovery_whose_rebuild_finds_the_disk_full_says_so(tmp_path, level):
    node1 = tmp_path / "Local" / "node1"
    with tmpfs(node1, "2m"):
        node1.chmod(0o700)  # a tmpfs root is world-writable: ftidask refuses it as a run directory

        def write(ctx: Context, rank: int) -> None:
            ctx.protect(1, _values(rank, 1))
            ctx.checkpoint(1, level)
            ctx._close()

        _ranks(tmp_path, write)
        lost = next(iter(find_paths(node1, "Ckpt1-Rank1.fti")))
        lost.unlink()
        filler = fill(node1)
        refused = _ranks(tmp_path, _recover)
        assert {r[0] for r in refused} == {"NoCheckpointError"} and len({r[1] for r in refused}) == 1, refused
        assert str(lost) in refused[0][1] and "No space left on device" in refused[0][1], refused[0][1]
        assert all(r[2] for r in refused)  # the arrays untouched
        filler.unlink()
        assert _ranks(tmp_path, _recover) == [((1, level), True)] * NRANKS  # room again: rebuilt, recovered


# --- Zarr export to a full disk ------------------------------------------------------------------------


def test_zarr_export_to_a_full_disk_is_an_ftidask_error_naming_the_store(tmp_path, dirs):
    """It was a raw OSError naming nothing ("[Errno 28] No space left on device"); the store it was to
    replace stays as it was, and nothing half-written is left beside it."""
    from ftidask.zarr_export import export_checkpoint, read_zarr

    where = {k: v for k, v in dirs.items() if k != "verbosity"}
    ctx = ftidask.init(**dirs)
    data = np.arange(20_000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    with tmpfs(tmp_path / "fs", "1m") as fs:
        export_checkpoint(None, fs / "state.zarr", exec_id=ctx.exec_id, **where)
        data += 1
        ctx.checkpoint(2, 1)
        filler = fill(fs)
        for dest, overwrite in ((fs / "new.zarr", False), (fs / "state.zarr", True)):
            with pytest.raises(ftidask.FTIError, match="No space left on device") as failed:
                export_checkpoint(None, dest, exec_id=ctx.exec_id, overwrite=overwrite, **where)
            assert str(dest) in str(failed.value) and "checkpoint 2" in str(failed.value), failed.value
        assert sorted(p.name for p in fs.iterdir()) == ["filler", "state.zarr"]
        filler.unlink()
        np.testing.assert_array_equal(read_zarr(fs / "state.zarr")[1][1], np.arange(20_000.0))
    ctx.finalize()


# --- finalize on a node-local disk turned read-only ---------------------------------------------------------


@contextlib.contextmanager
def _read_only(mount: Path):
    """``mount`` (a tmpfs) remounted read-only inside the block: EROFS at every write, rename and unlink."""
    import subprocess

    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)


def _node_dirs(tmp_path: Path, node: Path) -> dict:
    return {"ckpt_dir": str(node / "Local"), "glbl_dir": str(tmp_path / "Global"), "meta_dir": str(tmp_path / "Meta"),
            "verbosity": 4}


def test_an_l4_checkpoint_on_a_read_only_node_disk_retires_the_previous_one(tmp_path):
    """The node-local disk turned read-only (a failing SSD that the kernel remounts read-only) holds nothing of
    the L4 checkpoint to retire; its removal renamed the absent local directory, which a read-only file system
    refuses (EROFS) before it looks the name up: the new checkpoint, committed, was reported as failed, and the
    old one's global copy was left."""
    with tmpfs(tmp_path / "node", "8m") as node:
        node.chmod(0o700)
        dirs = _node_dirs(tmp_path, node)
        ctx = ftidask.init(**dirs)
        data = np.arange(20_000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, 1)  # makes the node-local l1 directory
        ctx.checkpoint(2, 4)
        data += 1
        with _read_only(node):
            ctx.checkpoint(3, 4)
        assert sorted(p.name for p in find_paths(tmp_path / "Global", "*.fti")) == ["Ckpt3-Rank0.fti"]
        ctx.finalize()


def test_finalize_on_a_read_only_node_disk_removes_what_it_can_and_says_what_it_could_not(tmp_path):
    with tmpfs(tmp_path / "node", "8m") as node:
        node.chmod(0o700)
        dirs = _node_dirs(tmp_path, node)
        ctx = ftidask.init(**dirs)
        ctx.protect(1, np.arange(20_000.0))
        ctx.checkpoint(1, 4)
        ctx.checkpoint(2, 1)  # an L1 one does not retire the L4 one: two to remove, oldest first
        with _read_only(node), pytest.raises(ftidask.FTIError, match="Read-only file system") as failed:
            ctx.finalize()
        assert "checkpoint 2 (level 1)" in str(failed.value) and str(node) in str(failed.value), failed.value
        assert not [p for p in find_paths(tmp_path / "Global", "*") if p.is_file()]  # checkpoint 1's global copy gone
        ctx = ftidask.init(**dirs)  # the run is over: a fresh start
        assert ctx.status() == 0
        ctx.finalize()


def test_a_restart_on_a_read_only_node_disk_with_leftover_temporaries_recovers(tmp_path, caplog):
    """A crash left temporary files, then the node-local disk went read-only: the restart's garbage collection
    cannot remove them, which it said by failing init ("garbage collection failed"), so the checkpoint that
    the disk still holds, whole, could not be recovered. Now it warns, as for the other leftovers."""
    with tmpfs(tmp_path / "node", "8m") as node:
        node.chmod(0o700)
        dirs = _node_dirs(tmp_path, node)
        ctx = ftidask.init(**dirs)
        ctx.protect(1, np.arange(20_000.0))
        ctx.checkpoint(1, 1)
        ctx._close()  # the crash
        ckpt = next(iter(find_paths(node, "ckpt1.s1")))
        leftovers = [ckpt.parent / ".Ckpt2-Rank0.fti.tmp-999", ckpt / ".Ckpt1-Rank0.fti.tmp-998"]
        for path in leftovers:
            path.write_bytes(b"torn")
        with _read_only(node):
            ctx = ftidask.init(**dirs | {"verbosity": 3})  # warnings shown
            out = np.zeros(20_000)
            ctx.protect(1, out)
            ctx.recover()
            assert ctx.recovered_from == (1, 1) and np.array_equal(out, np.arange(20_000.0))
            ctx._close()
        assert all(str(path) in caplog.text for path in leftovers), caplog.text  # said, not hidden
        ctx = ftidask.init(**dirs)  # writable again: collected
        assert not [p for p in find_paths(node, "*") if ".tmp-" in p.name]
        ctx.finalize()


# --- the run's metadata removed under it -----------------------------------------------------------------


@pytest.mark.parametrize("removed", ["current_exec_id", "meta_dir"])
def test_checkpoints_after_the_run_pointer_was_removed_are_restarted_from(dirs, removed):
    """``{meta_dir}/current_exec_id`` (or the whole ``meta_dir``) removed during the run: the next checkpoints
    were committed, but a restart no longer found the run and started afresh, their progress silently lost.
    A commit now names its run again when the pointer is missing."""
    import shutil

    ctx = ftidask.init(**dirs)
    data = np.arange(20_000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    meta = Path(dirs["meta_dir"])
    if removed == "meta_dir":
        shutil.rmtree(meta)
    else:
        (meta / "current_exec_id").unlink()
    data += 1
    ctx.checkpoint(2, 1)
    ctx._close()  # the crash
    ctx = ftidask.init(**dirs)
    assert ctx.status() == 1
    out = np.zeros(20_000)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from == (2, 1) and np.array_equal(out, np.arange(20_000.0) + 1)
    ctx.finalize()


@pytest.mark.parametrize("level", [5, 8])
def test_a_directory_in_place_of_the_dcp_spare_is_replaced(dirs, level):
    """The spare a differential checkpoint patches is ftidask's own scratch file: a directory found at its name
    failed every later dCP checkpoint of the run ("Is a directory"), now it is moved away and the checkpoint
    written in full."""
    dirs = dict(dirs, enable_dcp=1)
    ctx = ftidask.init(**dirs)
    data = np.arange(20_000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, level)
    data += 1
    ctx.checkpoint(2, level)  # checkpoint 1's file is now the spare
    (spare,) = [p for root in (dirs["ckpt_dir"], dirs["glbl_dir"]) for p in find_paths(Path(root), "Spare-Rank0.fti")]
    spare.unlink()
    spare.mkdir()
    (spare / "inside").write_bytes(b"x")
    data += 1
    info = ctx.checkpoint(3, level)
    assert info.blocks_changed == info.blocks_total  # no base to patch: written in full
    ctx._close()
    _recovers_checkpoint_3(dirs, level)


def _recovers_checkpoint_3(dirs: dict, level: int) -> None:
    """A restart recovers checkpoint 3 (``level``'s base level), written after the fault was gone, exactly."""
    ctx = ftidask.init(**dirs)
    out = np.zeros(20_000)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from == (3, (level - 1) % 4 + 1) and np.array_equal(out, np.arange(20_000.0) + 2)
    ctx.finalize()
