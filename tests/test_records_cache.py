"""The commit records' cache (:class:`ftidask.engine.records.RecordReader`) under real faults: a record that could
not be read for a moment, a listing of the records that fails, a record read through a symbolic link. A record
that a listing misses is a checkpoint that the garbage collection that follows removes, record or not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import mpi_util
import numpy as np
import pytest

import ftidask

_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break is told by SIGIO: the lease is held until told
fd = os.open(sys.argv[1], os.O_WRONLY)  # opening for writing changes none of its times
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("held", flush=True)
sys.stdin.readline()
os.close(fd)
"""


@contextlib.contextmanager
def _write_lease(path: Path):
    """Another process holds a write lease on ``path`` (as a file server's delegation does): while it is held, an
    open for reading with O_NONBLOCK fails at once with EAGAIN. The file is neither written nor touched."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            pytest.skip("file leases are not available here")
        yield
    finally:
        with contextlib.suppress(OSError):
            holder.stdin.write("\n")
            holder.stdin.flush()
        holder.wait(timeout=30)


def _dirs(tmp_path: Path, **kw) -> dict:
    return {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4, "exec_id": "cache", **kw}


def _l4_then_l1(tmp_path: Path) -> tuple[ftidask.Context, np.ndarray]:
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, a)
    a[:] = 1
    ctx.checkpoint(1, 4)
    a[:] = 2
    ctx.checkpoint(2, 1)  # L1 after L4: both kept (an L4 checkpoint outlives newer L1 ones)
    return ctx, a


def test_a_record_that_could_not_be_read_for_a_moment_is_read_again_and_its_checkpoint_kept(tmp_path):
    ctx, a = _l4_then_l1(tmp_path)
    commits = tmp_path / "M" / "cache" / "commits"
    l4_record = sorted(commits.glob("s*.json"))[0]
    assert [r.level for r in ctx.state.records()] == [4, 1]
    os.utime(l4_record)  # touched (a backup, a sync): its times changed, its content did not; it is read again
    with _write_lease(l4_record):
        # held while it is read: the read fails (EAGAIN), and this listing misses it, as before the cache
        assert [r.ckpt_id for r in ctx.state.records()] == [2]
    # The lease is gone and nothing changed on disk: the record is read again, not remembered as unreadable.
    a[:] = 3
    ctx.checkpoint(3, 1)  # retires checkpoint 2; the garbage collection must know checkpoint 1 is committed
    assert [(r.ckpt_id, r.level) for r in ctx.state.records()] == [(1, 4), (3, 1)]
    assert list((tmp_path / "G" / "cache" / "l4").glob("ckpt1.s*")), "the committed L4 checkpoint was removed"
    ctx._close()
    _lose_the_node_then_recover_the_l4_checkpoint(tmp_path, a)


def _lose_the_node_then_recover_the_l4_checkpoint(tmp_path: Path, a: np.ndarray) -> None:
    """The node lost (its L1 checkpoint with it), a restart recovers checkpoint 1 from L4 (_l4_then_l1's)."""
    shutil.rmtree(tmp_path / "L")
    ctx = ftidask.init(**_dirs(tmp_path))
    a[:] = 0
    ctx.protect(1, a)
    ctx.recover()
    assert (a == 1).all() and ctx.recovered_from[0] == 1
    ctx._close()


def _lowest_free_descriptor() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


def test_a_listing_of_the_records_that_fails_is_an_error_not_a_run_without_checkpoints(tmp_path):
    ctx, _a = _l4_then_l1(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_descriptor(), hard))  # no descriptor left: EMFILE
    try:
        with pytest.raises(OSError) as failed:
            listed = ctx.state.records()  # read as [], the garbage collection removes every committed checkpoint
            pytest.fail(f"the failed listing read as {listed}")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert failed.value.errno == errno.EMFILE
    assert [r.ckpt_id for r in ctx.state.records()] == [1, 2]
    ctx._close()


def test_a_checkpoint_that_cannot_list_the_records_fails_and_deletes_no_committed_record(tmp_path):
    """Read as "no records", the listing numbered the new checkpoint 1 again, and its failure (no descriptor left to
    write it either) removed its record: checkpoint 1's, the L4 checkpoint that outlives the L1 ones."""
    ctx, a = _l4_then_l1(tmp_path)
    a[:] = 3
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_descriptor(), hard))
    try:
        with pytest.raises(ftidask.CheckpointError, match="previous checkpoint is kept"):
            ctx.checkpoint(3, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert [(r.ckpt_id, r.level) for r in ctx.state.records()] == [(1, 4), (2, 1)]
    ctx._close()
    _lose_the_node_then_recover_the_l4_checkpoint(tmp_path, a)


def test_a_record_read_through_a_link_is_read_again_when_its_target_is_damaged(tmp_path):
    ctx, a = _l4_then_l1(tmp_path)
    commits = tmp_path / "M" / "cache" / "commits"
    newest = sorted(commits.glob("s*.json"))[-1]
    target = tmp_path / "elsewhere" / newest.name
    target.parent.mkdir()
    shutil.move(newest, target)
    newest.symlink_to(target)  # the record read through a link, as the listing always did
    assert [r.level for r in ctx.state.records()] == [4, 1]
    raw = target.read_bytes()
    with open(target, "r+b") as fh:  # a digit flipped in place: the link itself is unchanged
        fh.seek(raw.index(b'"level": 1') + len(b'"level": '))
        fh.write(b"2")
    a[:] = 0
    ctx.recover()  # the damaged newest record is passed over: checkpoint 1 from L4
    assert (a == 1).all() and ctx.recovered_from[0] == 1
    ctx._close()


@pytest.mark.parametrize("nranks", [pytest.param(2, marks=mpi_util.need_mpi(), id="2-ranks")])
def test_on_mpi_a_failed_listing_on_rank_0_fails_the_checkpoint_alike_on_every_rank(tmp_path, nranks):
    mpi_util.run(nranks, "records_listing_job.py", str(tmp_path), timeout=180)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(nranks)]
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"], results
    assert results[0]["error"][0] == "CheckpointError" and "previous checkpoint is kept" in results[0]["error"][1]
    assert results[0]["listed"] == [[1, 4], [2, 1]], results
    assert all(r["recovered"] == [1, 4] and r["same"] for r in results), results


def test_two_contexts_of_one_run_in_one_process_see_each_others_records(tmp_path):
    """A notebook's init cell run again: each context reads the records through its own cache and collects with
    its own memory of the directories it found clean; neither serves a record the other removed, nor removes a
    checkpoint the other committed."""
    a, b = np.zeros(64), np.zeros(64)
    first = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    first.protect(1, a)
    for i in (1, 2):
        a[:] = i
        first.checkpoint(i, 4)
    second = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    second.protect(1, b)
    second.recover()
    assert (b == 2).all()
    b[:] = 3
    second.checkpoint(3, 1)
    a[:] = 4
    first.checkpoint(4, 1)  # retires checkpoint 3 (L1), which only the other context wrote
    assert [(r.ckpt_id, r.level) for r in second.state.records()] == [(1, 4), (2, 4), (4, 1)]
    b[:] = 5
    second.checkpoint(5, 4)  # retires checkpoint 4 (L1), which only the other context wrote
    listed = [(r.ckpt_id, r.level) for r in first.state.records()]
    assert listed == [(1, 4), (2, 4), (5, 4)], listed
    l4 = tmp_path / "G" / "cache" / "l4"
    newest = next(l4.glob("ckpt5.s*"))
    (newest / ".Ckpt5-Rank0.fti.tmp-1").write_bytes(b"torn")  # left in the other context's newest directory
    a[:] = 6
    first.checkpoint(6, 4)
    assert not (newest / ".Ckpt5-Rank0.fti.tmp-1").exists()
    assert sorted(p.name.split(".")[0] for p in l4.glob("ckpt*")) == ["ckpt1", "ckpt2", "ckpt5", "ckpt6"]
    first._close()
    second._close()
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    a[:] = 0
    ctx.protect(1, a)
    ctx.recover()
    assert (a == 6).all() and ctx.recovered_from[0] == 6
    ctx._close()


_UNREADABLE = """
import json, os, sys
import numpy as np
import ftidask
from ftidask.model.errors import FTIError
cfg = json.loads(sys.argv[1])
commits = os.path.join(cfg["meta_dir"], cfg["exec_id"], "commits")
a = np.arange(1000.0)
ctx = ftidask.init(**cfg)
ctx.protect(1, a)
ctx.checkpoint(1, 4)
ctx.checkpoint(2, 1)
os.chmod(commits, 0o300)  # listed no more (EACCES); still writable
a[:] = -1
try:
    ctx.checkpoint(3, 4)
except ftidask.CheckpointError as exc:
    print("checkpoint refused:", exc)
ctx._close()
try:
    ftidask.init(**cfg)
except FTIError as exc:
    print("init refused:", exc)
os.chmod(commits, 0o700)
ctx = ftidask.init(**cfg)
ctx.protect(1, a)
ctx.recover()
print("recovered", ctx.recovered_from, bool((a == np.arange(1000.0)).all()))
"""


def _without_dac_override() -> None:
    """In the child, before it runs Python: root without the capabilities that let it read any directory (dropped
    from the bounding set, they are not given back at exec), so that permission bits apply to it too."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_records_that_cannot_be_listed_for_want_of_permission_stop_the_run_and_delete_nothing(tmp_path):
    """A commits directory that cannot be listed (EACCES) read as no records, as the glob before the cache read it:
    the next checkpoint took the first committed one's sequence number and its garbage collection removed every
    committed checkpoint's directory. Now the checkpoint and the next init are refused, and once the directory can
    be listed again the newest checkpoint is recovered. As root, without the capabilities that let root list any
    directory."""
    cfg = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
           "exec_id": "perm", "verbosity": 2}
    proc = subprocess.run([sys.executable, "-c", _UNREADABLE, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=120, preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "checkpoint refused:" in out and "Permission denied" in out, out
    assert "init refused:" in out, out
    assert "recovered (2, 1) True" in out, out
    assert len(list((tmp_path / "G" / "perm" / "l4").glob("ckpt1.s*"))) == 1  # the L4 checkpoint stayed


def test_a_record_changed_on_disk_is_read_again(tmp_path):
    """A record damaged in place, its modification time put back: its change time tells the cache to read it again."""
    ctx, a = _l4_then_l1(tmp_path)
    newest = sorted((tmp_path / "M" / "cache" / "commits").glob("s*.json"))[-1]
    assert len(ctx.state.records()) == 2
    raw = newest.read_bytes()
    stat = newest.stat()
    with open(newest, "r+b") as fh:  # a digit flipped in place
        at = raw.index(b'"level": 1') + len(b'"level": ')
        fh.seek(at)
        fh.write(b"2")
    os.utime(newest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    a[:] = 0
    ctx.recover()  # the damaged newest record is passed over: checkpoint 1 from L4
    assert (a == 1).all() and ctx.recovered_from[0] == 1
    ctx._close()
