"""Asynchronous checkpoints at their edges: a fork while one is in flight, a structured dtype's padding bytes in a
copy snapshot, staging buffers the machine cannot give. Each case was found by a review."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ROOT

import ftidask


def _dirs(base, **kw):
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"), **kw}


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("snapshot", ["cow", "copy"])
def test_a_child_forked_with_a_checkpoint_in_flight_exits(tmp_path, snapshot):
    """The child had the queue of checkpoints in flight but not the thread that finishes them: it waited for them at
    its exit for ever (and any call of its context hung on the condition the parent's thread held)."""
    proc = _run("""
        import faulthandler, os, sys
        import numpy as np
        import ftidask
        base, snapshot = sys.argv[1], sys.argv[2]
        ctx = ftidask.init(ckpt_dir=base + "/L", glbl_dir=base + "/G", meta_dir=base + "/M", async_snapshot=snapshot)
        a = np.ones(8 << 20)
        ctx.protect(1, a)
        handle = ctx.checkpoint(1, 1, wait=False)
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(30, exit=True)  # a hang ends the child with status 1
            for call in (lambda: ctx.checkpoint(2, 1, wait=False), ctx.wait):
                try:
                    call()
                except ftidask.FTIError as exc:
                    print("child refused:", exc, flush=True)
            ctx.finalize()  # its parent's run: closed in the child only
            sys.exit(0)  # a normal exit: the interpreter's exit hooks run
        _, status = os.waitpid(pid, 0)
        print("child status", os.waitstatus_to_exitcode(status), "parent", handle.result().id, flush=True)
        ctx.finalize()
        """, str(tmp_path), snapshot)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("child refused: this process") == 2 and "child status 0 parent 1" in proc.stdout


@pytest.mark.parametrize("snapshot", ["copy", "auto"])
def test_a_structured_dtypes_padding_is_checkpointed_as_it_is(tmp_path, snapshot):
    """A copy snapshot copied a structured array field by field into a reused staging buffer: its padding bytes
    were the bytes another variable left there at the checkpoint before."""
    ctx = ftidask.init(**_dirs(tmp_path, async_snapshot=snapshot))
    n = 100_000 if snapshot == "copy" else 12_000
    dtype = np.dtype([("a", "u1"), ("b", ">i4")], align=True)
    ctx.protect(1, np.full(n * dtype.itemsize, 0xEE, np.uint8))
    ctx.checkpoint(1, 1, wait=False).result()
    ctx.protect(1, np.zeros(n, dtype))  # the same size: the staging buffer of checkpoint 1 is reused
    ctx.checkpoint(2, 1, wait=False).result()
    ctx._close()
    again = ftidask.init(**_dirs(tmp_path))
    got = np.empty(n, dtype)
    got.view(np.uint8)[:] = 0xFF
    again.protect(1, got)
    again.recover()
    assert again.recovered_from[0] == 2 and not got.view(np.uint8).any()  # every byte as it was: zeros
    again.finalize()


def test_staging_buffers_the_machine_cannot_give_write_the_checkpoint_blocking(tmp_path):
    """np.empty of the staging buffers raised numpy's raw MemoryError from checkpoint(wait=False), and the pool
    went on counting the bytes it never got (a later checkpoint that fit was written blocking)."""
    proc = _run("""
        import resource, sys
        import numpy as np
        import ftidask
        base = sys.argv[1]
        ctx = ftidask.init(ckpt_dir=base + "/L", glbl_dir=base + "/G", meta_dir=base + "/M", async_snapshot="copy",
                           async_buffer_mb=4096)
        a = np.ones(384 << 17)  # 384 MiB
        ctx.protect(1, a)
        with open("/proc/self/statm") as fh:
            now = int(fh.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (now + (192 << 20), resource.RLIM_INFINITY))  # no room for a copy
        first = ctx.checkpoint(1, 1, wait=False)
        print("first", first.mechanism, ctx._async.pool._held, first.result().id, flush=True)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        second = ctx.checkpoint(2, 1, wait=False)
        print("second", second.mechanism, second.result().id, flush=True)
        ctx.finalize()
        """, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first blocking 0 1" in proc.stdout and "second copy 2" in proc.stdout, proc.stdout


@pytest.mark.parametrize("child", ["checkpoint", "finalize", "with-block"])
@pytest.mark.parametrize("asynchronous", [0, 1])
def test_a_forked_child_never_writes_nor_finalizes_its_parents_run(tmp_path, child, asynchronous):
    """A child forked from the process whose context this is (found by a review): its ``checkpoint(wait=True)``
    during the parent's checkpoint in flight left no checkpoint at all (the committed one retired, the parent's
    commit raced), and its ``finalize()`` (or a with block ending) removed the parent's checkpoints while the parent
    went on. Now the child's checkpoint is refused, its finalize closes the context in the child only; the parent's
    run, crashed later, restarts from its newest checkpoint."""
    proc = _run("""
        import os, sys
        import numpy as np
        import ftidask
        base, child, asynchronous = sys.argv[1], sys.argv[2], int(sys.argv[3])
        ctx = ftidask.init(ckpt_dir=base + "/Local", glbl_dir=base + "/Global", meta_dir=base + "/Meta",
                           exec_id="run", async_ckpt=asynchronous)
        a = np.full(4 << 20, 1.0)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1, wait=True)
        a[:] = 2.0
        handle = ctx.checkpoint(2, 1)
        pid = os.fork()
        if pid == 0:
            a[:] = -7.0
            try:
                if child == "checkpoint":
                    ctx.checkpoint(3, 1, wait=True)
                elif child == "finalize":
                    ctx.finalize()
                else:
                    with ctx:
                        pass
                print("child done", flush=True)
            except ftidask.FTIError as exc:
                print("child refused:", exc, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        info = handle.result() if asynchronous else handle
        print("parent committed", info.id, flush=True)
        os._exit(9)  # crashed: no finalize
        """, str(tmp_path), child, str(asynchronous))
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert "parent committed 2" in proc.stdout
    assert ("child refused: this process" in proc.stdout) == (child == "checkpoint"), proc.stdout
    ctx = ftidask.init(**_dirs(tmp_path, exec_id="run"))
    assert ctx.status() == 1
    a = np.zeros(4 << 20)
    ctx.protect(1, a)
    ctx.recover()
    assert (a == 2.0).all() and ctx.recovered_from == (2, 1)
    ctx.finalize()
