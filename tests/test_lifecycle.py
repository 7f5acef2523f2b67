"""A context's life in one process: a finalize that fails or is interrupted, a restart's snapshot after a recovery of
some variables, the calls of a fresh run that have nothing to recover, ``[restart] exec_id`` beside ``failure``, and
what a finalize with keep_last_ckpt reads.

A finalize always ends with the context closed (FTI_Finalize tears down whatever happened): its run lock released,
its threads stopped. When the clean-up itself failed, the run keeps its checkpoints (a restart recovers the last one)
and a second finalize() says that it cannot retry from the closed context and how to (init the run again).
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import numpy as np
import pytest
from diskfull import fill, tmpfs

import ftidask
from ftidask.engine.asyncckpt import AsyncCheckpoints
from ftidask.engine.writing import Writer
from ftidask.staging.stager import Staging
from ftidask.storage.files import find_paths


def _lock_is_free(meta_dir: str, exec_id: str) -> bool:
    """Whether another open file description can take the run's lock (the context released its flock)."""
    with open(Path(meta_dir, exec_id, "run.lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


def _recovered(dirs: dict, like: np.ndarray, **kw) -> tuple[int, np.ndarray, tuple[int, int] | None]:
    """``(status, array, recovered_from)`` of a restart that recovers variable 1; the context finalized."""
    ctx = ftidask.init(**dirs, **kw)
    out = np.zeros_like(like)
    ctx.protect(1, out)
    status = ctx.status()
    ctx.recover()
    found = ctx.recovered_from
    ctx.finalize()
    return status, out, found


# --- finalize: the clean-up failed --------------------------------------------------------------------------


def test_a_finalize_whose_l4_flush_failed_says_so_again_and_the_run_is_finalized_by_its_next_init(tmp_path):
    """keep_last_ckpt with the global disk full: the flush failed (a CheckpointError), and a second finalize()
    returned None as if it had finalized, while nothing was retried and the run was left unfinalized. Now the
    second call raises, saying that the clean-up failed, that this context is closed and how to finish it."""
    with tmpfs(tmp_path / "fs", "1m") as fs:
        fs.chmod(0o700)
        dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(fs / "Global"), "meta_dir": str(tmp_path / "Meta"),
                "verbosity": 4, "keep_last_ckpt": 1}
        ctx = ftidask.init(**dirs)
        data = np.arange(20_000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, 1)
        ctx.checkpoint(2, 1)
        filler = fill(fs)
        with pytest.raises(ftidask.CheckpointError, match="No space left on device"):
            ctx.finalize()
        assert ctx.finalized and _lock_is_free(dirs["meta_dir"], ctx.exec_id)  # torn down, as FTI_Finalize
        with pytest.raises(ftidask.FTIError, match="finalize.. failed.*No space left on device") as again:
            ctx.finalize()
        assert f"exec_id={ctx.exec_id!r}) restarts it" in str(again.value), again.value
        with pytest.raises(ftidask.FTIError, match=r"finalize.. failed"):
            ctx.protect(2, data)
        filler.unlink()
        status, out, found = _recovered(dirs, data, exec_id=ctx.exec_id)  # its finalize flushes it at last
        assert status == 1 and found == (2, 1) and out.tobytes() == data.tobytes()
        status, out, found = _recovered(dirs, data)
        assert status == 2 and found == (2, 4) and out.tobytes() == data.tobytes()


@pytest.mark.parametrize("step", ["drain", "writer_close"])
def test_a_finalize_interrupted_anywhere_still_closes_the_context(dirs, monkeypatch, step):
    """An error (or a Ctrl-C) while finalize waited for the asynchronous checkpoints left the context open, its
    staging finished, its lock held; one while a part of it was closed left the other parts open (the run's lock
    held for good: another process could not restart the run). Now every part is closed whatever raises."""
    ctx = ftidask.init(**dirs)
    data = np.arange(1000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncCheckpoints if step == "drain" else Writer, "drain" if step == "drain" else "close",
                        interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctx.finalize()
    monkeypatch.undo()
    assert ctx.finalized and _lock_is_free(dirs["meta_dir"], ctx.exec_id)
    with pytest.raises(ftidask.FTIError, match="finalize.. failed" if step == "drain" else "is finalized"):
        ctx.checkpoint(2, 1)
    if step == "drain":  # interrupted before the clean-up: the run keeps its checkpoint
        with pytest.raises(ftidask.FTIError, match=r"finalize.. failed.*KeyboardInterrupt"):
            ctx.finalize()
        status, out, found = _recovered(dirs, data, exec_id=ctx.exec_id)
        assert status == 1 and found == (1, 1) and out.tobytes() == data.tobytes()
    else:  # the clean-up was done: nothing to retry
        ctx.finalize()
        again = ftidask.init(**dirs, exec_id=ctx.exec_id)
        assert again.status() == 0  # the run was finalized
        again.finalize()


def test_a_with_block_left_by_an_error_closes_everything_and_its_error_is_the_one_raised(dirs, monkeypatch):
    """Leaving the block by an exception closes the context without finalizing (the run restarts). A failure
    while closing (here the stager's) replaced the application's error and left the context open, its lock held;
    a finalize() afterwards returned None as if it had cleaned up. Now the application's error propagates, the
    context is closed, and finalize() says that the run was not finalized."""
    def broken(self):
        raise OSError(5, "Input/output error")

    data = np.arange(100.0)
    monkeypatch.setattr(Staging, "finish", broken)
    with pytest.raises(ValueError, match="the application's"), ftidask.init(**dirs) as ctx:
        ctx.protect(1, data)
        ctx.checkpoint(1, 1)
        raise ValueError("the application's")
    monkeypatch.undo()
    assert ctx.finalized and _lock_is_free(dirs["meta_dir"], ctx.exec_id)
    with pytest.raises(ftidask.FTIError, match=r"did not run \(ValueError: the application's\)"):
        ctx.finalize()
    status, out, found = _recovered(dirs, data)
    assert status == 1 and found == (1, 1) and out.tobytes() == data.tobytes()


# --- snapshot() after a recovery of some variables -------------------------------------------------------------


def _restart_with_two(dirs: dict) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint 1 of variables 1 and 2, then the crash (the context dropped unfinalized); their values."""
    a, b = np.arange(10.0), np.arange(5) + 100
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 1)
    ctx._close()
    return a, b


def test_snapshot_after_recover_var_recovers_the_others_and_not_again_those_recovered(dirs):
    """FTI_Snapshot recovers on a restart. After a recovery of variable 1 only, snapshot() skipped the recovery (a
    recovery had run): variable 2 kept its fresh-start value, which the next checkpoint saved as the run's state.
    Now it recovers variable 2 (from the same checkpoint), and leaves variable 1, changed since, alone."""
    a, b = _restart_with_two(dirs)
    ctx = ftidask.init(**dirs)
    x, y = np.zeros_like(a), np.zeros_like(b)
    ctx.protect(1, x)
    ctx.protect(2, y)
    assert ctx.status() == 1
    ctx.recover_var(1)
    assert x.tobytes() == a.tobytes() and not y.any()
    x += 1  # the application goes on with variable 1
    assert ctx.snapshot() == ftidask.FTI_SCES
    assert y.tobytes() == b.tobytes() and x.tobytes() == (a + 1).tobytes()
    assert ctx.status() == 0 and ctx.recovered_from == (1, 1)
    x += 1
    ctx.snapshot()  # the restart is over: never a recovery again
    assert x.tobytes() == (a + 2).tobytes()
    ctx.finalize()


@pytest.mark.parametrize("then", ["each_recovered", "checkpoint_since"])
def test_snapshot_after_recovering_each_variable_or_a_checkpoint_recovers_nothing(dirs, then):
    a, b = _restart_with_two(dirs)
    ctx = ftidask.init(**dirs)
    x, y = np.zeros_like(a), np.zeros_like(b)
    ctx.protect(1, x)
    ctx.protect(2, y)
    ctx.recover(ids=[1])
    if then == "each_recovered":
        ctx.recover_var(2)
    else:
        ctx.checkpoint(2, 1)  # holds y's fresh value: the application chose to go on without it
    x += 1
    y += 1
    assert ctx.snapshot() == ftidask.FTI_SCES
    assert x.tobytes() == (a + 1).tobytes()
    assert y.tobytes() == ((b + 1) if then == "each_recovered" else np.ones_like(b)).tobytes()
    assert ctx.status() == 0
    ctx.finalize()


# --- a fresh run has nothing to recover -------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["recover", "recover_var", "realloc"])
def test_recovering_on_a_fresh_start_is_a_clear_error_with_advice(dirs, call):
    """FTI returns FTI_NSCS; ftidask raised NoCheckpointError("no committed checkpoint for run ...") without saying
    why a run that never crashed has none, nor what to do. Now it says: a fresh start, recover on a restart only."""
    ctx = ftidask.init(**dirs)
    a = np.arange(4.0)
    ctx.protect(1, a)
    assert ctx.status() == 0 and ctx.stored_size(1) == 0  # FTI_GetStoredSize's 0: nothing stored
    step = {"recover": ctx.recover, "recover_var": lambda: ctx.recover_var(1), "realloc": lambda: ctx.realloc(1)}
    with pytest.raises(ftidask.NoCheckpointError, match=r"fresh start \(status\(\) == 0\).*status\(\) != 0"):
        step[call]()
    assert a.tobytes() == np.arange(4.0).tobytes() and ctx.protected[1] is a
    ctx.checkpoint(1, 1)  # the context works on
    ctx.finalize()


# --- [restart] exec_id and failure ------------------------------------------------------------------------------


def test_exec_id_names_the_run_whatever_failure_says(dirs):
    """FTI reads ``exec_id`` only when ``failure`` is not 0, as FTI itself rewrites both in its config file (at init
    and at finalize). ftidask never writes the config file: ``failure`` is accepted and ignored, ``exec_id`` names
    the run, and the run's commit records decide whether it is a restart (docs/config.md)."""
    data = np.arange(8.0)
    ctx = ftidask.init(exec_id="job", failure=0, **dirs)
    assert (ctx.exec_id, ctx.status(), ctx.config.failure) == ("job", 0, 0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    ctx._close()  # the crash
    status, out, found = _recovered(dirs, data, exec_id="job", failure=0)  # a restart, failure = 0 or not
    assert status == 1 and found == (1, 1) and out.tobytes() == data.tobytes()
    for exec_id in ("job", "never-run"):  # finalized, or never run: a fresh start under that name
        ctx = ftidask.init(exec_id=exec_id, failure=1, **dirs)
        assert (ctx.exec_id, ctx.status()) == (exec_id, 0)
        ctx.protect(1, np.zeros(8))
        with pytest.raises(ftidask.NoCheckpointError, match="fresh start"):
            ctx.recover()
        ctx.finalize()


# --- stored_size(total=...) in one process; bad arguments in odd orders -------------------------------------------


def test_stored_size_total_in_one_process_is_its_own(dirs):
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.zeros(10))
    ctx.checkpoint(1, 1)
    assert ctx.stored_size(1) == ctx.stored_size(1, total=True) == 80
    for bad in (1, "yes", None):
        with pytest.raises(ftidask.RecoveryError, match=r"stored_size\(total=\.\.\.\) takes a bool"):
            ctx.stored_size(1, total=bad)
    ctx.finalize()


@pytest.mark.parametrize("ckpt_id", ["1", 1.5, True, 2**31, -2**31 - 1])
def test_a_bad_checkpoint_id_is_a_checkpoint_error(dirs, ckpt_id):
    """A checkpoint id that is no 32-bit int was refused as a ProtectError (protect()'s error), id 0 as a
    CheckpointError: now every checkpoint id refused by checkpoint() or init_icp() is a CheckpointError."""
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.zeros(3))
    with pytest.raises(ftidask.CheckpointError, match="checkpoint id"):
        ctx.checkpoint(ckpt_id, 1)
    with pytest.raises(ftidask.CheckpointError, match="checkpoint id"):
        ctx.init_icp(ckpt_id, 1)
    assert ctx.checkpoint(1, 1).id == 1  # nothing half done
    ctx.finalize()


# --- two inits of one run in one process -------------------------------------------------------------------------


def test_finalizing_one_of_two_contexts_of_a_run_leaves_the_run_to_the_other(dirs):
    """A second init of a run in the same process (a notebook's init cell run again) restarts it, sharing its lock.
    Finalizing the first context removed the checkpoints and marked the run finalized under the second, which went
    on committing checkpoints into it: killed then, its next start was a fresh run, and checkpoint 3, committed, was
    lost for good. Now a finalize closes its own context only while another context of this process holds the run;
    the last one's finalize cleans up."""
    first = ftidask.init(**dirs)
    a = np.arange(5.0)
    first.protect(1, a)
    first.checkpoint(1, 1)
    second = ftidask.init(**dirs)
    b = np.zeros(5)
    second.protect(1, b)
    assert second.status() == 1 and second.exec_id == first.exec_id
    second.recover()
    first.finalize()
    assert first.finalized and not second.finalized
    b += 10
    second.checkpoint(3, 1)
    second._close()  # the crash
    status, out, found = _recovered(dirs, b)
    assert status == 1 and found == (3, 1) and out.tobytes() == b.tobytes()
    assert not list(Path(dirs["meta_dir"]).glob(f"{first.exec_id}/commits/*.json"))  # the last finalize cleaned up


# --- keep_last_ckpt: what finalize reads (docs/guide.md, finalize) -------------------------------------------


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_keep_last_keeps_a_committed_l4_checkpoint_unread(tmp_path):
    """The newest checkpoint committed at L4, no fallback: finalize keeps it where it is without reading it (no read
    of every L4 byte), so a file damaged since its commit stays as it is, and the next run's recovery, which verifies
    everything, finds it (nothing older: NoCheckpointError). A level-1 newest is checked in full while it is
    flushed: damaged, that finalize fails."""
    for level, name in ((4, "l4"), (1, "l1")):
        dirs = {"ckpt_dir": str(tmp_path / name / "Local"), "glbl_dir": str(tmp_path / name / "Global"),
                "meta_dir": str(tmp_path / name / "Meta"), "verbosity": 4, "keep_last_ckpt": 1}
        ctx = ftidask.init(**dirs)
        data = np.arange(20_000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, level)
        (path,) = find_paths(Path(dirs["glbl_dir" if level == 4 else "ckpt_dir"]), "Ckpt1-Rank0.fti")
        _flip_a_byte(path)
        if level == 1:
            with pytest.raises(ftidask.CheckpointError, match="keep_last_ckpt"):
                ctx.finalize()
            continue
        ctx.finalize()
        assert path.exists()
        restarted = ftidask.init(**dirs)
        assert restarted.status() == 2
        restarted.protect(1, np.zeros_like(data))
        with pytest.raises(ftidask.NoCheckpointError):
            restarted.recover()
        restarted.finalize()
