"""Memory a copy-on-write snapshot protects, unmapped or moved while it is read out (issue 60).

``a.resize(n, refcheck=False)`` reallocates a protected array: glibc moves a large block with mremap (or
frees it: munmap), and the background copy-out of an asynchronous ``cow`` checkpoint then read the old
addresses: SIGSEGV, the process gone. Now the kernel tells the snapshot of munmap and mremap
(UFFD_EVENT_UNMAP/REMAP), the live memory is read with process_vm_readv (an unmapped page fails
instead of faulting), and the copy-out of a page that went fails (EFAULT): the checkpoint fails with a
CheckpointError and the previous one is kept. Every scenario runs in a child process, so that a crash
is this test's failure rather than the end of pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftidask.memsnap import cow_available

ROOT = Path(__file__).resolve().parent.parent

_OK, _WHY = cow_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=f"copy-on-write snapshots unavailable: {_WHY}"),
              pytest.mark.timeout(60)]

# Private anonymous memory of its own (never handed back to an allocator), and what the snapshot knows.
PRELUDE = """
import ctypes, errno, mmap, sys, threading, time
import numpy as np
import ftidask._native as nat
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
PAGE, MiB = mmap.PAGESIZE, 1 << 20
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2

def anon(n):
    addr = libc.mmap(None, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return addr

def view(addr, n):
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), np.uint8)

def unmap(addr, n):
    assert libc.munmap(addr, n) == 0, ctypes.get_errno()

def guarded(snap):
    st = nat.cow_stats(snap)
    if not (st.get("unmaps_reported", True) or st.get("safe_read", True)):  # absent from older builds: the bug
        print("SKIP neither UFFD_FEATURE_EVENT_UNMAP/REMAP nor process_vm_readv here")
        sys.exit(0)
    return st

def copy(snap, index, start, n):
    out = np.empty(n, np.uint8)
    try:
        nat.cow_copy(snap, index, start, out)
    except OSError as exc:
        assert exc.errno != errno.EFAULT or "unmapped, moved or made inaccessible" in str(exc), exc
        return errno.errorcode[exc.errno]
    return out

def check(got, value):
    return got if isinstance(got, str) else "ok" if (got == value).all() else "WRONG"
"""


def _child(code: str, prelude: bool = True, timeout: float = 30) -> str:
    """``code`` in a fresh interpreter (after PRELUDE): its stdout; a crash (SIGSEGV: exit -11) or a hang
    fails the test."""
    source = (PRELUDE if prelude else "") + textwrap.dedent(code)
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", source], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung for {timeout} s")
    assert proc.returncode == 0, f"the child died: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIP ")]
    if skipped:
        pytest.skip(skipped[0][5:])
    return proc.stdout


@pytest.mark.parametrize("native_only", [False, True], ids=["python-check", "native-only"])
def test_resize_during_an_async_cow_checkpoint_fails_it_and_keeps_the_previous(native_only):
    """The finding: a 4 MiB protected array resized with refcheck=False while its cow checkpoint is in flight.
    The handle raises CheckpointError, the previous checkpoint recovers bit for bit, the process lives on.
    native-only: without the Python side's check of the array's address (what a raw munmap or mremap
    would be), the native copy-out must find it out itself."""
    out = _child(f"""
        NATIVE_ONLY = {native_only}
        import shutil, sys, tempfile
        import numpy as np
        import ftidask
        from ftidask.memsnap import cow
        if NATIVE_ONLY:
            cow.CowSnapshot._copy = lambda self, i, start, out: self._native.cow_copy(self._handle, i, start, out)
            probe = np.ones(1 << 18)
            snap = cow._native.cow_new([(probe.ctypes.data, probe.nbytes)])
            st = cow._native.cow_stats(snap)
            cow._native.cow_release(snap)
            if not (st.get("unmaps_reported", True) or st.get("safe_read", True)):  # absent from older builds
                print("SKIP neither UFFD_FEATURE_EVENT_UNMAP/REMAP nor process_vm_readv here")
                sys.exit(0)
        sys.setswitchinterval(30)  # the background thread starts when this one waits: after the resize
        tmp = tempfile.mkdtemp()
        d = dict(ckpt_dir=tmp + "/L", glbl_dir=tmp + "/G", meta_dir=tmp + "/M", verbosity=4, async_snapshot="cow")
        ctx = ftidask.init(**d)
        a = np.random.default_rng(60).random(1 << 19)  # 4 MiB
        saved = a.copy()
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        a += 1
        h = ctx.checkpoint(2, 1, wait=False)
        a.resize(1 << 20, refcheck=False)  # 8 MiB: realloc moves (mremap) or frees (munmap) the old block
        a[:] = 3
        print("mechanism", h.mechanism)
        try:
            h.result()
            print("committed")
        except ftidask.CheckpointError as exc:
            print("failed", "unmapped, moved or made inaccessible" in str(exc))
        ctx._close()
        ctx = ftidask.init(**d)
        b = np.zeros(1 << 19)
        ctx.protect(1, b)
        ctx.recover()
        print("recovered", ctx.recovered_from[0], b.tobytes() == saved.tobytes())
        ctx._close()
        shutil.rmtree(tmp)
        print("exit")
    """, prelude=False)
    lines = out.splitlines()
    if "mechanism cow" not in lines:
        pytest.skip(f"the checkpoint did not take a cow snapshot: {lines[:1]}")
    assert lines == ["mechanism cow", "failed True", "recovered 1 True", "exit"], out


def test_pages_unmapped_fail_their_copy_out_and_pages_copied_aside_keep_theirs():
    """munmap of protected pages: those copied aside before (a write) or read out keep their snapshot
    values; those still protected fail their copy-out (EFAULT), never a fault or the bytes mapped there now."""
    out = _child("""
        n = 4 * MiB
        addr = anon(n)
        v = view(addr, n)
        v[:] = 7
        snap = nat.cow_new([(addr, n)])
        guarded(snap)
        print("first", check(copy(snap, 0, 0, MiB), 7))  # read out (and unprotected)
        v[2 * MiB] = 1  # the run around it is copied aside
        del v
        unmap(addr + MiB, n - MiB)
        print("aside", check(copy(snap, 0, 2 * MiB, PAGE), 7))
        print("protected", copy(snap, 0, 3 * MiB, MiB))
        nat.cow_release(snap)
        unmap(addr, MiB)
        print("exit")
    """)
    assert out.split() == ["first", "ok", "aside", "ok", "protected", "EFAULT", "exit"], out


def test_memory_moved_by_mremap_is_let_go():
    """mremap moves protected memory (what realloc does): the old addresses fail their copy-out; the moved
    memory is the application's, written without waiting, and can be snapshot again at once."""
    out = _child("""
        n = 4 * MiB
        addr = anon(n)
        view(addr, n)[:] = 5
        snap = nat.cow_new([(addr, n)])
        st = guarded(snap)
        spot = anon(2 * n)  # somewhere free to move to (MREMAP_FIXED replaces it)
        moved = libc.mremap(addr, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, spot)
        assert moved == spot, ctypes.get_errno()
        w = view(moved, n)
        assert (w == 5).all()
        w[:] = 9  # a hang here: the moved pages kept the protection, and nobody lifts it
        print("old", copy(snap, 0, 0, n))
        if st.get("unmaps_reported", True):
            again = nat.cow_new([(moved, n)])  # EBUSY if still registered with the first snapshot
            nat.cow_release(again)
        nat.cow_release(snap)
        del w
        unmap(spot, 2 * n)
        print("exit")
    """)
    assert out.split() == ["old", "EFAULT", "exit"], out


def test_a_sweep_next_to_unmapped_memory_copies_ahead_only_what_is_there():
    """Two arrays side by side share one registration; the upper one is unmapped, then a sweep writes
    the lower one up to its end: the run copied ahead of the sweep (a whole 2 MiB) reached into the
    unmapped array, and the handler thread faulted there."""
    out = _child("""
        big = anon(8 * MiB)
        base = (big + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)  # a huge-page boundary: the runs align to it
        cut = 2 * MiB + 16 * PAGE
        v = view(base, 4 * MiB)
        v[:] = 7
        snap = nat.cow_new([(base, cut), (base + cut, 4 * MiB - cut)])
        assert nat.cow_stats(snap)["ranges"] == 1
        guarded(snap)
        unmap(base + cut, 4 * MiB - cut)
        lower = view(base, cut)
        del v
        lower[:] = 1  # a sweep: runs of 64 KiB doubling up to 2 MiB, the last over [2 MiB, 4 MiB)
        print("lower", check(copy(snap, 0, 0, cut), 7))
        print("upper", copy(snap, 1, 0, 4 * MiB - cut))
        nat.cow_release(snap)
        del lower
        unmap(big, 8 * MiB)
        print("exit")
    """)
    assert out.split() == ["lower", "ok", "upper", "EFAULT", "exit"], out


def test_munmap_racing_the_copy_out_never_faults():
    """munmap while a thread reads the snapshot out: its event comes after the unmap, so the reader may
    meet the pages gone before they are marked. Each copy-out reads the snapshot or fails (EFAULT)."""
    out = _child("""
        n = 16 * MiB
        seen = set()
        rng = np.random.default_rng(60)
        for it in range(12):
            addr = anon(n)
            view(addr, n)[:] = 7
            snap = nat.cow_new([(addr, n)])
            guarded(snap)
            result = []
            reader = threading.Thread(target=lambda: result.append(copy(snap, 0, 0, n)))
            reader.start()
            time.sleep(float(rng.uniform(0, 0.01)))
            unmap(addr + n // 2, n // 2)
            reader.join()
            seen.add(check(result[0], 7))
            nat.cow_release(snap)
            unmap(addr, n // 2)
        print(*sorted(seen))
        print("exit")
    """)
    lines = out.splitlines()
    assert lines[-1] == "exit" and set(lines[0].split()) <= {"ok", "EFAULT"}, out
