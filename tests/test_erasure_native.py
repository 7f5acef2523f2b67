"""The native GF(2^8) kernel (ftidask._native.gf_matmul) against the NumPy reference of erasure.py.

Every code path the CPU has is forced in turn (``gf_set_isa``); each must give the NumPy code's
bytes for any shape, length, buffer offset and accumulate flag, decode every erasure pattern, and
reproduce the golden parity bytes that pin the on-disk format.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_erasure import GOLDEN_4_4, GOLDEN_8_8_SHA256, golden_data

from ftidask.levels import erasure, gf_native
from ftidask.levels.erasure import ReedSolomon

native = pytest.importorskip("ftidask._native", reason="native helpers not built (no C compiler at install)")
if not hasattr(native, "gf_matmul"):  # pragma: no cover - an extension built before the kernel
    pytest.skip("ftidask._native has no GF(2^8) kernel", allow_module_level=True)

ISAS = ["scalar", "ssse3", "avx2", "gfni-avx2", "avx512", "gfni", "neon"]


@pytest.fixture(scope="module", params=ISAS)
def isa(request):
    """Force one code path for the tests that take it; restore the automatic choice after."""
    if not native.gf_set_isa(request.param):
        pytest.skip(f"this CPU (or build) lacks {request.param}")
    assert native.gf_isa() == request.param
    yield request.param
    assert native.gf_set_isa("auto")


def reference(mat: np.ndarray, ins, before: list[np.ndarray], accumulate: bool) -> list[np.ndarray]:
    """What the NumPy codec computes (plus the accumulate XOR)."""
    outs = [np.empty(len(b), np.uint8) for b in before]
    erasure._apply_numpy(mat, [np.frombuffer(a, np.uint8) for a in ins], outs)
    return [o ^ b for o, b in zip(outs, before)] if accumulate else outs


def unaligned(rng: np.random.Generator, n: int, offset: int) -> memoryview:
    """n random bytes at `offset` bytes into a bytearray (a writable, unaligned buffer)."""
    buf = bytearray(rng.integers(0, 256, n + offset, dtype=np.uint8).tobytes())
    return memoryview(buf)[offset:offset + n]


LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 4097]),
                    st.integers(0, 3000))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(k=st.integers(1, 16), m=st.integers(1, 16), n=LENGTHS, seed=st.integers(0, 2**32 - 1),
       in_off=st.integers(0, 63), out_off=st.integers(0, 63), accumulate=st.booleans())
def test_matches_numpy(isa, k, m, n, seed, in_off, out_off, accumulate):
    rng = np.random.default_rng(seed)
    mat = rng.integers(0, 256, (m, k), dtype=np.uint8)
    mat[rng.random((m, k)) < 0.2] = 1  # coefficients 0 and 1 are common in real matrices
    mat[rng.random((m, k)) < 0.1] = 0
    ins = [unaligned(rng, n, (in_off + j) % 64) for j in range(k)]
    outs = [unaligned(rng, n, (out_off + 7 * i) % 64) for i in range(m)]
    before = [np.frombuffer(o, np.uint8).copy() for o in outs]
    native.gf_matmul(mat.tobytes(), ins, outs, accumulate)
    for got, want in zip(outs, reference(mat, ins, before, accumulate)):
        assert bytes(got) == want.tobytes()


@pytest.mark.parametrize("k,m", [(4, 4), (8, 4), (10, 13)])
def test_large_stripes_split_over_threads(isa, k, m, monkeypatch):
    """Above PARALLEL_MIN_BYTES the stripe is cut into pieces on the pool: same bytes, tail included."""
    monkeypatch.setattr(gf_native, "threads", 3)
    rng = np.random.default_rng(k * m)
    n = gf_native.PARALLEL_MIN_BYTES + 12345
    mat = rng.integers(0, 256, (m, k), dtype=np.uint8)
    ins = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]
    for accumulate in (False, True):
        outs = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(m)]
        want = reference(mat, ins, [o.copy() for o in outs], accumulate)
        gf_native.matmul(mat, ins, outs, accumulate)
        for got, w in zip(outs, want):
            np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("offsets", [(0, 0, 0, 0), (5, 5, 5, 5), (5, 6, 5, 5)])
def test_large_calls_stream_their_stores(isa, offsets):
    """Past 8 MiB of traffic, outputs sharing one alignment get a scalar head then streaming
    stores; others keep plain stores. Same bytes either way."""
    rng = np.random.default_rng(sum(offsets))
    n = (9 << 20) // 8 + 77
    mat = ReedSolomon(4, 4).matrix
    ins = [unaligned(rng, n, 3 * j) for j in range(4)]
    outs = [unaligned(rng, n, off) for off in offsets]
    native.gf_matmul(mat.tobytes(), ins, outs)
    for got, want in zip(outs, reference(mat, ins, [np.zeros(n, np.uint8)] * 4, False)):
        assert bytes(got) == want.tobytes()


def test_golden_bytes(isa):
    rs = ReedSolomon(4, 4)
    assert [p.tobytes().hex() for p in rs.encode(golden_data(4, 16))] == GOLDEN_4_4
    big = ReedSolomon(8, 8).encode(golden_data(8, 4099))
    assert hashlib.sha256(b"".join(p.tobytes() for p in big)).hexdigest() == GOLDEN_8_8_SHA256


@pytest.mark.parametrize("k,m", [(1, 1), (2, 3), (4, 4), (5, 2), (8, 4)])
def test_every_erasure_pattern_decodes(isa, k, m):
    assert erasure.use_native
    rng = np.random.default_rng(k + 10 * m)
    rs = ReedSolomon(k, m)
    data = [rng.integers(0, 256, 203, dtype=np.uint8) for _ in range(k)]  # 203: vectors and a tail
    blocks = data + rs.encode(data)
    for r in range(m + 1):
        for lost in itertools.combinations(range(k + m), r):
            got = rs.decode({i: b for i, b in enumerate(blocks) if i not in lost})
            assert all(np.array_equal(a, b) for a, b in zip(got, data)), lost


def test_parity_update_matches_numpy(isa, monkeypatch):
    """gf_add_scaled (rs_delta's parity ^= c * delta) and gf_scale on both paths."""
    rng = np.random.default_rng(9)
    delta = rng.integers(0, 256, 1001, dtype=np.uint8)
    for coef in (0, 1, 2, 29, 255):
        parity = rng.integers(0, 256, 1001, dtype=np.uint8)
        want = parity.copy()
        with monkeypatch.context() as mp:
            mp.setattr(erasure, "use_native", False)
            erasure.gf_add_scaled(coef, delta, want)
            scaled = erasure.gf_scale(coef, delta)
        erasure.gf_add_scaled(coef, delta, parity)
        np.testing.assert_array_equal(parity, want)
        np.testing.assert_array_equal(erasure.gf_scale(coef, delta), scaled)


def test_repeated_inputs_and_empty_shapes():
    a = np.arange(100, dtype=np.uint8)
    out = np.zeros(100, np.uint8)
    native.gf_matmul(bytes([3, 3]), [a, a], [out])  # 3a ^ 3a
    assert not out.any()
    native.gf_matmul(b"", [], [])  # nothing to do
    native.gf_matmul(b"", [], [out])  # no inputs: zeros
    assert not out.any()
    native.gf_matmul(b"", [a], [])


def test_bad_arguments_are_refused():
    a, b, out = np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="matrix holds 3 bytes"):
        native.gf_matmul(b"\1\2\3", [a, b], [out])
    with pytest.raises(ValueError, match="every buffer must hold 64 bytes"):
        native.gf_matmul(b"\1", [a], [np.zeros(63, np.uint8)])
    with pytest.raises(TypeError, match="outputs\\[0\\] must be a writable"):
        native.gf_matmul(b"\1", [a], [bytes(64)])
    with pytest.raises(TypeError, match="outputs\\[0\\] must be a writable"):
        native.gf_matmul(b"\1", [a], [np.zeros(128, np.uint8)[::2]])  # not contiguous
    with pytest.raises(TypeError, match="inputs\\[1\\] must be a"):
        native.gf_matmul(b"\1\1", [a, 5], [out])
    with pytest.raises(TypeError, match="inputs must be a sequence"):
        native.gf_matmul(b"\1", 5, [out])
    with pytest.raises(TypeError):
        native.gf_matmul("not bytes", [a], [out])
    with pytest.raises(ValueError, match="overlaps inputs"):
        native.gf_matmul(b"\1", [a], [a])
    big = np.zeros(200, np.uint8)
    with pytest.raises(ValueError, match="outputs\\[0\\] overlaps outputs\\[1\\]"):
        native.gf_matmul(b"\1\1", [a], [big[:64], big[32:96]])
    with pytest.raises(ValueError, match="at most 256"):
        native.gf_matmul(bytes(257), [a] * 257, [out])
    with pytest.raises(ValueError, match="unknown"):
        native.gf_set_isa("mmx")
    with pytest.raises(TypeError):
        native.gf_set_isa(3)
    with pytest.raises(ValueError, match="out must be"):
        erasure.gf_add_scaled(2, a, bytes(64))
    assert native.gf_isa() in ISAS


def test_auto_picks_an_available_path():
    assert native.gf_set_isa("auto")
    assert gf_native.isa() == native.gf_isa() in ISAS
    assert native.gf_set_isa(native.gf_isa())


def test_an_output_overlapping_the_matrix_is_refused():
    """The kernels read the matrix again after writing the first rows: an output over it computed garbage."""
    mat = bytearray([3])
    with pytest.raises(ValueError, match="outputs\\[0\\] overlaps the matrix"):
        native.gf_matmul(mat, [bytes([5])], [mat])
    assert mat == bytearray([3])
    buf = np.zeros(64, np.uint8)
    buf[:2] = [1, 2]
    with pytest.raises(ValueError, match="outputs\\[1\\] overlaps the matrix"):
        native.gf_matmul(buf[:2], [np.ones(16, np.uint8)], [np.zeros(16, np.uint8), buf[1:17]])


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "ndarray"])
def test_split_stripes_write_the_callers_outputs(monkeypatch, kind):
    """Stripes of 1 MiB or more are cut into pieces; a piece of a bytearray was a copy, left unwritten."""
    monkeypatch.setattr(gf_native, "threads", 4)
    n = 2 << 20
    rng = np.random.default_rng(11)
    ins = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(2)]
    mat = np.array([[5, 7], [1, 2]], np.uint8)
    outs = [bytearray(n) for _ in range(2)]
    if kind == "memoryview":
        outs = [memoryview(o) for o in outs]
    elif kind == "ndarray":
        outs = [np.zeros(n, np.uint8) for _ in outs]
    gf_native.matmul(mat, [bytes(ins[0]), ins[1]], outs)
    want = reference(mat, ins, [np.zeros(n, np.uint8)] * 2, False)
    for got, w in zip(outs, want):
        assert np.array_equal(np.frombuffer(got, np.uint8), w)


@pytest.mark.parametrize("use_native", [False, True])
def test_gf_add_scaled_with_aliasing_arguments(monkeypatch, use_native):
    """out ^= coef * data where data is out, or overlaps it: both paths compute coef * data first."""
    if use_native and not gf_native.available():
        pytest.skip("no native kernel")
    monkeypatch.setattr(erasure, "use_native", use_native)
    x = np.arange(64, dtype=np.uint8)
    erasure.gf_add_scaled(3, x, x)
    assert np.array_equal(x, np.arange(64, dtype=np.uint8) ^ erasure.gf_scale(3, np.arange(64, dtype=np.uint8)))
    z = np.arange(64, dtype=np.uint8)
    erasure.gf_add_scaled(3, z[:32], z[16:48])
    base = np.arange(64, dtype=np.uint8)
    assert np.array_equal(z[16:48], base[16:48] ^ erasure.gf_scale(3, base[:32]))
    assert np.array_equal(z[:16], base[:16]) and np.array_equal(z[48:], base[48:])
