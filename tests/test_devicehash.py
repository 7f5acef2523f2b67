"""The device digests of a CuPy array's blocks (ftidask.engine.devicehash), run here with NumPy as the array module:
the same array operations CuPy runs on the device. They decide which blocks of a differential checkpoint cross the
bus, so a change they miss would be a stale block in a checkpoint: every kind of change is looked for."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftidask.engine import device, devicehash

BLOCK = devicehash.BLOCK


def _digests(a: np.ndarray) -> np.ndarray:
    return devicehash.digests(np, a.reshape(-1).view(np.uint8))


def test_one_digest_of_two_lanes_per_block_the_last_one_short():
    flat = np.random.default_rng(0).integers(0, 256, 5 * BLOCK + 100, dtype=np.uint8)
    d = devicehash.digests(np, flat)
    assert d.shape == (6, 2) and d.dtype == np.uint64
    assert np.array_equal(d, devicehash.digests(np, flat.copy()))  # the keys are fixed: the same bytes, same digests
    padded = np.zeros(6 * BLOCK, np.uint8)
    padded[:len(flat)] = flat
    assert np.array_equal(d, devicehash.digests(np, padded))  # the short block: hashed padded with zeros
    assert len(np.unique(d, axis=0)) == 6


def test_the_slices_do_not_change_the_digests(monkeypatch):
    flat = np.random.default_rng(1).integers(0, 256, 9 * BLOCK + 8, dtype=np.uint8)
    whole = devicehash.digests(np, flat)
    monkeypatch.setattr(devicehash, "SLICE", 2 * BLOCK)
    assert np.array_equal(devicehash.digests(np, flat), whole)


@settings(max_examples=200, deadline=None)
@given(at=st.integers(0, 4 * BLOCK - 1), bit=st.integers(0, 7))
def test_any_flipped_bit_changes_its_block_and_only_it(at, bit):
    flat = np.random.default_rng(2).integers(0, 256, 4 * BLOCK, dtype=np.uint8)
    before = devicehash.digests(np, flat)
    flat[at] ^= np.uint8(1 << bit)
    after = devicehash.digests(np, flat)
    assert devicehash.changed(np, after, before).tolist() == [at // BLOCK]
    assert (after[at // BLOCK] != before[at // BLOCK]).all()  # both lanes


@settings(max_examples=100, deadline=None)
@given(i=st.integers(0, BLOCK // 8 - 1), j=st.integers(0, BLOCK // 8 - 1),
       kind=st.sampled_from(["sign", "swap", "add"]))
def test_changes_to_two_words_that_a_linear_sum_would_miss_are_seen(i, j, kind):
    """Negating two values (their top bits flipped), swapping two words, or moving one up by as much as another goes
    down: a plain or position-weighted sum of the words would not change for some of them; these digests do."""
    words = np.random.default_rng(3).integers(1, 1 << 40, 2 * BLOCK // 8, dtype=np.uint64)
    before = _digests(words)
    if kind == "sign":
        words[[i, j]] ^= np.uint64(1 << 63)
    elif kind == "swap":
        words[[i, j]] = words[[j, i]]
    else:
        words[i] += np.uint64(12345)
        words[j] -= np.uint64(12345)
    after = _digests(words)
    expect = [] if (i == j and kind in ("swap", "add")) else [0]
    assert devicehash.changed(np, after, before).tolist() == expect


def test_a_negative_zero_is_a_change():
    a = np.zeros(2 * BLOCK // 8, np.float64)
    b = a.copy()
    b[7] = -0.0  # equal as a value, another bit pattern: a checkpoint stores the bits
    assert devicehash.changed(np, _digests(b), _digests(a)).tolist() == [0]


def test_only_aligned_arrays_of_two_blocks_or_more_are_hashed():
    buf = np.zeros(4 * BLOCK + 8, np.uint8)
    assert devicehash.usable(buf[:2 * BLOCK])
    assert not devicehash.usable(buf[3:3 + 2 * BLOCK])  # an 8-byte read there would be misaligned on a device
    assert not devicehash.usable(buf[:2 * BLOCK - 1])


def test_the_pages_of_gathered_blocks_that_differ_are_the_only_ones_written():
    page = 4096
    mirror = np.zeros(8 * BLOCK, np.uint8)
    pages = mirror.reshape(-1, page)
    rows = np.zeros((2, BLOCK), np.uint8)
    rows[1, page + 3] = 9  # block 5, its second page
    frozen = pages.copy()
    frozen.flags.writeable = False
    device._move_pages(np.zeros((2, BLOCK), np.uint8), frozen, np.array([1, 5]) * (BLOCK // page))  # nothing differs
    device._move_pages(rows, pages, np.array([1, 5]) * (BLOCK // page))
    assert np.flatnonzero(mirror).tolist() == [5 * BLOCK + page + 3]


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32", "complex128", "bool"])
def test_digests_of_any_dtype_are_those_of_its_bytes(dtype):
    a = (np.arange(3 * BLOCK) % 7).astype(dtype)
    assert np.array_equal(_digests(a), devicehash.digests(np, a.view(np.uint8).copy()))
