"""Which fresh arrays get verified pages moved under them: the process's mappings read cheaply from
``/proc/self/maps``, and from ``/proc/self/smaps`` (every resident page walked) only when a lock or a
userfaultfd could make a mapping special."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import os

import leaks
import numpy as np
import pytest

from ftidask.engine import pagemove

pytestmark = pytest.mark.skipif(not pagemove.enabled, reason="no native page_move in this build")

MLOCK_ONFAULT = 1
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def fresh_array() -> np.ndarray:
    """A 40 MiB array of pages never touched. Above malloc's largest mmap threshold malloc maps fresh pages, unless
    its heap's free top (memory an earlier test of this process freed) is larger: such an allocation is kept while
    the next is tried, so that malloc must map pages (as tests/test_recover_reads_once.py's ``fresh``)."""
    tried = []
    for _ in range(8):
        out = np.empty(40 << 20, np.uint8)
        if pagemove._fresh(out):
            return out
        tried.append(out)
    raise AssertionError("malloc gave no untouched pages for 40 MiB")


@pytest.fixture
def plain():
    """This process made plain again: no userfaultfd open, no memory locked (the cheap path's condition). What an
    earlier test of the session dropped without closing (a context with differential checkpoints in a reference
    cycle, a copy-on-write snapshot) holds its userfaultfd until a garbage collection runs its ``__del__``: until then
    every check of this process reads smaps, and these tests failed or passed by the collector's timing."""
    gc.collect()
    left = leaks.settled(pagemove._locked_or_faulted, lambda v: not v, timeout=10)  # (a background thread closing one)
    assert not left, f"something alive still holds a userfaultfd or locked memory: {sorted(leaks.descriptors())}"


def sources(monkeypatch) -> list[str]:
    """Record which /proc file each reading of the mappings uses."""
    read, real = [], pagemove._mappings
    monkeypatch.setattr(pagemove, "_mappings", lambda source: read.append(source) or real(source))
    return read


def test_a_plain_process_reads_maps_only_and_sees_what_smaps_sees(monkeypatch, plain):
    array = fresh_array()
    read = sources(monkeypatch)
    assert pagemove.movable(array) and read == ["/proc/self/maps"]
    cheap, full = pagemove._mappings("/proc/self/maps"), pagemove._mappings("/proc/self/smaps")
    assert [m[:2] for m in cheap] == [m[:2] for m in full]  # the same mappings, the same order
    lo, hi = pagemove._whole_pages(array)
    assert pagemove._plain_anonymous(lo, hi, cheap) and pagemove._plain_anonymous(lo, hi, full)


def test_a_locked_fresh_array_is_not_moved(monkeypatch, plain):
    """A lock on fault leaves the pages untouched but marks the mapping: the moved pages would lose the lock, so
    the array is filled by a copy. ``VmLck`` sends the check to smaps, which sees the lock."""
    array = fresh_array()
    lo, hi = pagemove._whole_pages(array)
    size = 1 << 20  # within the default RLIMIT_MEMLOCK
    if libc.mlock2(ctypes.c_void_p(lo + (4 << 20)), ctypes.c_size_t(size), MLOCK_ONFAULT) != 0:
        pytest.skip(f"mlock2(MLOCK_ONFAULT): {os.strerror(ctypes.get_errno())}")
    try:
        read = sources(monkeypatch)
        assert pagemove._never_touched(lo, hi)  # the lock touched nothing
        assert not pagemove.movable(array) and read == ["/proc/self/smaps"]
        assert pagemove.movable_arrays({1: array}) == {}
    finally:
        libc.munlock(ctypes.c_void_p(lo + (4 << 20)), ctypes.c_size_t(size))
    read.clear()
    assert pagemove.movable(array) and read == ["/proc/self/maps"]


def test_an_open_userfaultfd_sends_the_check_to_smaps(monkeypatch):
    if SYS_USERFAULTFD is None:
        pytest.skip("no userfaultfd syscall number for this machine")
    fd = libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        pytest.skip(f"userfaultfd: {errno.errorcode.get(err, err)}")
    try:
        array = fresh_array()
        read = sources(monkeypatch)
        assert pagemove.movable(array) and read == ["/proc/self/smaps"]  # not registered: still plain
    finally:
        os.close(fd)
