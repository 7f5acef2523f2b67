"""The host side of ftidask.engine.device, which runs without a GPU: the move of a piece from a pinned buffer into
a device array's host mirror (all of it, or only the pages that differ, on a few threads), and a forked child's
fresh start (no thread pool or pinned buffer of the parent's). The GPU side is tests/test_gpu.py."""

import os

import numpy as np
import pytest

from ftidask.engine import device

PAGE = 4096


@pytest.mark.parametrize("compare", [False, True])
@pytest.mark.parametrize("n", [0, 5, PAGE, 3 * PAGE + 17, 1 << 20, (1 << 20) + 12345, 9 << 20])
@pytest.mark.parametrize("shift", [0, 1, 8])  # the mirror's slice need not be aligned
def test_a_piece_moved_into_the_mirror_is_its_bytes(n, compare, shift):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + shift, np.uint8)[shift:]
    if compare and n > 2 * PAGE:
        dst[PAGE:2 * PAGE] = src[PAGE:2 * PAGE]  # one page already equal
    device._move_parallel(src, dst, compare)
    assert dst.tobytes() == src.tobytes()


def test_only_the_pages_that_differ_are_written():
    """A page of the mirror whose bytes are unchanged is never written (a dCP checkpoint then writes only the
    blocks that changed): a read-only view shows it, since numpy refuses to write through it."""
    src = np.zeros(8 * PAGE, np.uint8)
    dst = np.zeros(8 * PAGE, np.uint8)
    src[3 * PAGE + 5] = 1
    device._move(src, dst, compare=True)
    assert np.flatnonzero(dst).tolist() == [3 * PAGE + 5]
    frozen = dst.copy()
    frozen.flags.writeable = False  # nothing differs: no write is attempted
    device._move(src, frozen, compare=True)


def test_a_forked_child_starts_without_the_parents_threads():
    device._move_parallel(np.ones(1 << 22, np.uint8), np.zeros(1 << 22, np.uint8), False)
    pid = os.fork()
    if pid == 0:  # the child: a pool of the parent's would have no threads, and its map would wait for ever
        ok = device._movers is None and not device._bounce
        out = np.zeros(1 << 22, np.uint8)
        device._move_parallel(np.ones(1 << 22, np.uint8), out, False)
        os._exit(0 if ok and out.all() else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_only_cupy_arrays_are_device_arrays():
    assert not device.is_device_array(np.zeros(3))
    assert not device.is_device_array([1, 2])
    assert device.holder_of(np.zeros(3)) is None
