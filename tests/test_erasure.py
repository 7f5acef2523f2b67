"""Tests of the Reed-Solomon codec of level 3 (ftidask.levels.erasure)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftidask.levels import erasure, gf_numpy
from ftidask.levels.erasure import ReedSolomon, decode_files, encode_files

# --- an independent, slow reference of the documented format --------------------------

def gf_mul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return r


def gf_inv(a: int) -> int:
    return next(x for x in range(1, 256) if gf_mul(a, x) == 1)


def ref_matrix(k: int, m: int) -> list[list[int]]:
    c = [[gf_inv((k + i) ^ j) for j in range(k)] for i in range(m)]
    c = [[gf_mul(c[i][j], gf_inv(c[0][j])) for j in range(k)] for i in range(m)]
    return [[gf_mul(c[i][j], gf_inv(c[i][0])) for j in range(k)] for i in range(m)]


def ref_encode(data: list[bytes], m: int) -> list[bytes]:
    k, c = len(data), ref_matrix(len(data), m)
    out = []
    for i in range(m):
        row = bytearray(len(data[0]))
        for j in range(k):
            for t, x in enumerate(data[j]):
                row[t] ^= gf_mul(c[i][j], x)
        out.append(bytes(row))
    return out


def blocks(rng: np.random.Generator, k: int, n: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]


def assert_blocks_equal(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.uint8
        np.testing.assert_array_equal(g, w)


@contextlib.contextmanager
def patched(**values):
    """Temporarily set module tunables (forces the pair-table path, small chunks...): ``use_native`` is the
    codec's (erasure), the others the NumPy code's (gf_numpy)."""
    where = {name: erasure if name == "use_native" else gf_numpy for name in values}
    old = {name: getattr(where[name], name) for name in values}
    for name, v in values.items():
        setattr(where[name], name, v)
    try:
        yield
    finally:
        for name, v in old.items():
            setattr(where[name], name, v)


# --- format -----------------------------------------------------------------------------

def test_matrix_follows_documented_construction() -> None:
    for k, m in [(1, 1), (1, 5), (4, 4), (5, 3), (8, 8), (13, 7), (128, 128), (255, 1)]:
        c = ReedSolomon(k, m).matrix
        assert c.shape == (m, k)
        if k * m <= 64:
            assert c.tolist() == ref_matrix(k, m)
        assert (c[0] == 1).all() and (c[:, 0] == 1).all()


def test_parity_rows_do_not_depend_on_m() -> None:
    full = ReedSolomon(6, 10).matrix
    for m in range(1, 10):
        np.testing.assert_array_equal(ReedSolomon(6, m).matrix, full[:m])


def test_encode_matches_reference() -> None:
    rng = np.random.default_rng(1)
    for k, m in [(1, 2), (3, 2), (4, 4), (7, 5)]:
        data = blocks(rng, k, 37)
        want = ref_encode([d.tobytes() for d in data], m)
        assert [p.tobytes() for p in ReedSolomon(k, m).encode(data)] == want


def golden_data(k: int, n: int) -> list[bytes]:
    return [bytes((37 * t + 101 * j + 7 + (t >> 3)) & 0xFF for t in range(n)) for j in range(k)]


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "default"])
def test_golden_parity_bytes(native: bool) -> None:
    """Pins the on-disk format: if this fails, old parity files no longer decode (NumPy code, then the default path)."""
    with patched(use_native=native and erasure.use_native):
        _check_golden()


def _check_golden() -> None:
    rs = ReedSolomon(4, 4)
    assert rs.matrix.tolist() == [[1, 1, 1, 1], [1, 217, 92, 172], [1, 92, 70, 123], [1, 172, 123, 158]]
    parity = [p.tobytes().hex() for p in rs.encode(golden_data(4, 16))]
    assert parity == GOLDEN_4_4
    big = ReedSolomon(8, 8).encode(golden_data(8, 4099))
    assert hashlib.sha256(b"".join(p.tobytes() for p in big)).hexdigest() == GOLDEN_8_8_SHA256


GOLDEN_4_4 = [
    "8c107c48348014880074483c900c9834",
    "175a0157efad2d373827f69590ffdab7",
    "fc87dc14492046d5089b7ede7b323162",
    "cca701a9382fa5db7d3518fa8a08024a",
]
GOLDEN_8_8_SHA256 = "48b9f33f70603f6604d8239df3447fa70da46976cd54abae5b2e9d3da308e8ff"


# --- round trips --------------------------------------------------------------------------

@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("m", range(1, 9))
def test_round_trip_any_erasures(k: int, m: int) -> None:
    rng = np.random.default_rng(100 * k + m)
    n = int(rng.integers(0, 50))
    rs = ReedSolomon(k, m)
    data = blocks(rng, k, n)
    all_blocks = data + rs.encode(data)
    # every erasure set of up to m blocks when there are few, else a random sample
    erasures = [e for r in range(m + 1) for e in itertools.combinations(range(k + m), r)]
    if len(erasures) > 64:
        erasures = random.Random(k * m).sample(erasures, 64)
    for lost in erasures:
        avail = {i: b for i, b in enumerate(all_blocks) if i not in lost}
        assert_blocks_equal(rs.decode(avail), data)


@settings(max_examples=50, deadline=None)
@given(
    k=st.integers(1, 12),
    m=st.integers(1, 12),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
    wide=st.booleans(),
)
def test_round_trip_property(k: int, m: int, n: int, seed: int, wide: bool) -> None:
    rng = np.random.default_rng(seed)
    data = blocks(rng, k, n)
    with patched(_WIDE_MIN_BYTES=0 if wide else 1 << 62, _CHUNK_BYTES=256, use_native=False):
        rs = ReedSolomon(k, m)
        parity = rs.encode(data)
        lost = rng.choice(k + m, size=int(rng.integers(0, m + 1)), replace=False)
        avail = {i: b for i, b in enumerate(data + parity) if i not in lost}
        assert_blocks_equal(rs.decode(avail), data)
    assert_blocks_equal(parity, ReedSolomon(k, m).encode(data))  # same bytes on either path


@pytest.mark.parametrize("k,m", [(4, 4), (3, 5), (8, 8), (16, 3), (2, 1)])
def test_pair_table_path_equals_byte_path(k: int, m: int) -> None:
    rng = np.random.default_rng(k + m)
    data = blocks(rng, k, 3001)  # odd: the last byte takes the byte path
    with patched(_WIDE_MIN_BYTES=1 << 62, use_native=False):
        want = ReedSolomon(k, m).encode(data)
    with patched(_WIDE_MIN_BYTES=0, _CHUNK_BYTES=1024, use_native=False):  # many chunks
        rs = ReedSolomon(k, m)
        assert_blocks_equal(rs.encode(data), want)
        lost = list(range(min(m, k)))
        avail = {i: b for i, b in enumerate(data + want) if i not in lost}
        assert_blocks_equal(rs.decode(avail), data)


def test_large_blocks_round_trip() -> None:
    # above _WIDE_MIN_BYTES: the default plan uses 64K-entry tables
    rng = np.random.default_rng(5)
    rs = ReedSolomon(4, 4)
    data = blocks(rng, 4, (1 << 20) + 3)
    parity = rs.encode(data)
    for p, i in zip(rs.encode(data, [3, 1]), [3, 1]):
        np.testing.assert_array_equal(p, parity[i])
    avail = {i: b for i, b in enumerate(data + parity) if i not in (0, 2, 5)}
    assert_blocks_equal(rs.decode(avail), data)


def test_parity_subset_equals_full_encode() -> None:
    rng = np.random.default_rng(2)
    rs = ReedSolomon(5, 6)
    data = blocks(rng, 5, 101)
    full = rs.encode(data)
    for i in range(6):
        assert_blocks_equal(rs.encode(data, [i]), [full[i]])
    assert_blocks_equal(rs.encode(data, [5, 0, 3, 3]), [full[5], full[0], full[3], full[3]])
    assert rs.encode(data, []) == []


def test_bytes_like_input_and_padding() -> None:
    rs = ReedSolomon(3, 2)
    data = [b"abcdef", bytearray(b"ghijkl"), memoryview(b"mnopqr")]
    parity = rs.encode(data)
    want = [np.frombuffer(bytes(d), np.uint8) for d in data]
    assert_blocks_equal(rs.decode({1: data[1], 3: parity[0], 4: parity[1].tobytes()}), want)
    # shorter blocks count as zero-padded up to `length`
    out = rs.decode({0: b"ab", 1: b"", 2: b"xyz"}, length=5)
    assert [o.tobytes() for o in out] == [b"ab\0\0\0", b"\0" * 5, b"xyz\0\0"]


# --- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("k,m", [(0, 1), (1, 0), (-1, 2), (200, 57), (256, 1), (2.0, 1), ("3", 1)])
def test_bad_k_m(k, m) -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        ReedSolomon(k, m)


def test_too_few_blocks() -> None:
    rs = ReedSolomon(4, 2)
    data = blocks(np.random.default_rng(3), 4, 10)
    parity = rs.encode(data)
    with pytest.raises(ValueError, match="1 block\\(s\\) missing"):
        rs.decode({0: data[0], 1: data[1], 5: parity[1]})
    with pytest.raises(ValueError, match="4 block\\(s\\) missing"):
        rs.decode({})


def test_bad_arguments() -> None:
    rs = ReedSolomon(2, 2)
    a = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="expected 2 data blocks"):
        rs.encode([a])
    with pytest.raises(ValueError, match="equal lengths"):
        rs.encode([a, np.zeros(5, np.uint8)])
    with pytest.raises(ValueError, match="parity index 2"):
        rs.encode([a, a], [2])
    with pytest.raises(TypeError, match="uint8"):
        rs.encode([a, np.zeros(4, np.int32)])
    with pytest.raises(TypeError, match="uint8"):
        rs.encode([a, np.zeros((2, 2), np.uint8)])
    with pytest.raises(TypeError, match="bytes-like"):
        rs.encode([a, 1234])
    with pytest.raises(ValueError, match="out of range"):
        rs.decode({0: a, 4: a})
    with pytest.raises(ValueError, match="more than length"):
        rs.decode({0: a, 1: a}, length=3)


# --- files ---------------------------------------------------------------------------------

def write_group(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    paths, contents = [], []
    for i, n in enumerate(sizes):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p = tmp_path / f"data{i}"
        p.write_bytes(b)
        paths.append(str(p))
        contents.append(b)
    return paths, contents


def padded(contents, n):
    return [np.frombuffer(c.ljust(n, b"\0"), np.uint8) for c in contents]


@pytest.mark.parametrize("block_size", [7, 64, 1 << 20])
def test_files_round_trip_unequal_sizes(tmp_path, block_size) -> None:
    sizes = [1000, 0, 333, 1001, 64]
    k = m = len(sizes)
    data_paths, contents = write_group(tmp_path, sizes)
    parity_paths = [str(tmp_path / f"parity{j}") for j in range(m)]
    encode_files(data_paths, parity_paths, block_size=block_size)
    assert sorted(os.listdir(tmp_path)) == sorted([f"data{i}" for i in range(k)] + [f"parity{j}" for j in range(m)])
    parity = [Path(p).read_bytes() for p in parity_paths]
    assert [len(p) for p in parity] == [max(sizes)] * m
    want = ReedSolomon(k, m).encode(padded(contents, max(sizes)))
    assert parity == [w.tobytes() for w in want]

    for trial, lost_data in enumerate([[0], [1, 3], [0, 2, 3, 4], [0, 1, 2, 3, 4]]):
        lost_parity = random.Random(trial).sample(range(m), m - len(lost_data))
        dp = [None if i in lost_data else p for i, p in enumerate(data_paths)]
        pp = [None if j in lost_parity else p for j, p in enumerate(parity_paths)]
        outs = {i: str(tmp_path / f"out{trial}_{i}") for i in lost_data + [2]}
        decode_files(dp, pp, sizes, outs, block_size=block_size)
        for i, p in outs.items():
            assert Path(p).read_bytes() == contents[i]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_encode_files_single_parity_row(tmp_path) -> None:
    data_paths, _ = write_group(tmp_path, [10, 300, 299], seed=4)
    full = [str(tmp_path / f"p{j}") for j in range(3)]
    encode_files(data_paths, full, block_size=100)
    mine = str(tmp_path / "mine")
    encode_files(data_paths, [None, mine, None], block_size=64)
    assert Path(mine).read_bytes() == Path(full[1]).read_bytes()
    assert not os.path.exists(str(tmp_path / "p0.tmp"))


def test_decode_files_errors_leave_no_output(tmp_path) -> None:
    sizes = [50, 80]
    data_paths, _ = write_group(tmp_path, sizes, seed=6)
    parity_paths = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    encode_files(data_paths, parity_paths)
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="1 block\\(s\\) missing"):
        decode_files([None, None], [parity_paths[0], None], sizes, {0: out})
    with pytest.raises(ValueError, match="expected 51 bytes"):
        decode_files([data_paths[0], None], parity_paths, [51, 80], {1: out})
    with pytest.raises(ValueError, match="expected 2 sizes"):
        decode_files(data_paths, parity_paths, [50], {})
    with pytest.raises(ValueError, match="out of range"):
        decode_files(data_paths, parity_paths, sizes, {2: out})
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]


def test_encode_files_empty_group(tmp_path) -> None:
    data_paths, _ = write_group(tmp_path, [0, 0], seed=7)
    parity_paths = [str(tmp_path / "p0")]
    encode_files(data_paths, parity_paths)
    assert Path(parity_paths[0]).read_bytes() == b""
    out = str(tmp_path / "out0")
    decode_files([None, data_paths[1]], parity_paths, [0, 0], {0: out})
    assert Path(out).read_bytes() == b""
