"""Reed-Solomon erasure code over GF(2^8) for FTI's level 3 (L3).

A group of k nodes each holds one data file and one parity file; any k of
the k + m files rebuild all data files.

On-disk format (parity files written by one version must decode in every
later one; ``tests/test_erasure.py`` pins golden bytes):

* Field GF(2^8) with the primitive polynomial x^8 + x^4 + x^3 + x^2 + 1
  (0x11D); addition is XOR.
* Generator ``[I_k; C]`` (systematic).  ``C`` is the m x k Cauchy matrix
  ``C0[i][j] = 1 / ((k + i) XOR j)``, normalised: every column j is divided
  by ``C0[0][j]``, then every row i by its (new) column-0 entry.  Row 0 and
  column 0 of ``C`` are all ones, so parity 0 is the XOR of the data.
  Scaling rows and columns keeps every square minor of a Cauchy matrix
  non-zero, hence any k rows of ``[I_k; C]`` are invertible (MDS).  Row i
  depends on (k, i) only: a larger m adds parity rows without changing
  existing ones.
* Bytes are independent: byte t of parity i is XOR_j C[i][j] * data_j[t];
  blocks shorter than the longest one of the group count as zero-padded.

Speed: with the native extension, ``ftidask._native.gf_matmul`` computes the same bytes with
SIMD table lookups or GFNI, on every core for large stripes (:mod:`ftidask.levels.gf_native`).
Without it, or with ``use_native = False`` (tests), the NumPy code of :mod:`ftidask.levels.gf_numpy`
(table lookups, one per two input bytes for a large 4+4 encode), the reference both are tested against.
"""

from __future__ import annotations

import contextlib
import io
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from numbers import Integral
from pathlib import Path

import numpy as np

from ..storage import files as storage
from . import gf_native
from .gf_numpy import MUL, gf_invert, inv
from .gf_numpy import apply_numpy as _apply_numpy

__all__ = ["DEFAULT_BLOCK_SIZE", "ReedSolomon", "decode_files", "encode_files", "gf_add_scaled", "gf_scale"]

#: Compute with the native kernel when it is built; False forces the NumPy code (the reference).
use_native: bool = gf_native.available()

DEFAULT_BLOCK_SIZE = 16 << 20


def _apply(mat: np.ndarray, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], accumulate: bool = False) -> None:
    """outs[i] = XOR_j mat[i][j] * ins[j] (``^=`` with accumulate), all 1-D contiguous uint8 of one length."""
    if use_native and len(outs):
        gf_native.matmul(mat, ins, outs, accumulate)
    elif accumulate:
        tmp = [np.empty_like(o) for o in outs]
        _apply_numpy(mat, ins, tmp)
        for o, t in zip(outs, tmp):
            np.bitwise_xor(o, t, out=o)
    else:
        _apply_numpy(mat, ins, outs)


def _as_block(x: object, what: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8 or x.ndim != 1:
            raise TypeError(f"{what} must be a 1-D uint8 array, got {x.dtype} of shape {x.shape}")
        return np.ascontiguousarray(x)
    try:
        return np.frombuffer(x, dtype=np.uint8)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} must be a uint8 array or bytes-like, got {type(x).__name__}") from None


def gf_scale(coef: int, data: np.ndarray) -> np.ndarray:
    """``coef * data`` byte by byte in GF(2^8) (``data`` uint8; a new array)."""
    if not 0 <= coef <= 255:
        raise ValueError(f"a GF(2^8) coefficient is 0..255, got {coef}")
    block = np.ascontiguousarray(data, np.uint8)
    out = np.empty_like(block)
    _apply(np.array([[coef]], np.uint8), [block], [out])  # the codec's chunked tables: 2.5x a plain lookup
    return out


def gf_add_scaled(coef: int, data: np.ndarray, out: np.ndarray) -> None:
    """``out ^= coef * data`` in place (a parity update from a delta); both 1-D uint8 of one length."""
    if not 0 <= coef <= 255:
        raise ValueError(f"a GF(2^8) coefficient is 0..255, got {coef}")
    block = np.ascontiguousarray(data, np.uint8)
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 and out.flags.c_contiguous
            and out.flags.writeable and len(out) == len(block)):
        raise ValueError(f"out must be a writable contiguous 1-D uint8 array of {len(block)} bytes")
    if use_native and np.may_share_memory(block, out):
        # The kernel refuses an output overlapping its input; the NumPy code computes coef * data
        # before it touches out, which a copy of data gives the kernel too (gf_add_scaled(c, x, x)).
        block = block.copy()
    _apply(np.array([[coef]], np.uint8), [block], [out], accumulate=True)


class ReedSolomon:
    """Systematic RS code over GF(2^8): k data blocks, m parity blocks."""

    def __init__(self, k: int, m: int) -> None:
        if not (isinstance(k, Integral) and isinstance(m, Integral)) or k < 1 or m < 1 or k + m > 256:
            raise ValueError(f"need integers k >= 1, m >= 1 and k + m <= 256, got k={k!r}, m={m!r}")
        k, m = int(k), int(m)
        self.k: int = k
        self.m: int = m
        c = np.array([[inv((k + i) ^ j) for j in range(k)] for i in range(m)], np.uint8)
        c = MUL[c, np.array([inv(int(v)) for v in c[0]], np.uint8)[None, :]]
        c = MUL[c, np.array([inv(int(v)) for v in c[:, 0]], np.uint8)[:, None]]
        self._parity: np.ndarray = c
        self._generator: np.ndarray = np.concatenate([np.eye(k, dtype=np.uint8), c])

    @property
    def matrix(self) -> np.ndarray:
        """The m x k parity matrix C (a copy)."""
        return self._parity.copy()

    def encode(self, data: Sequence[np.ndarray], parity_indices: Sequence[int] | None = None) -> list[np.ndarray]:
        """Parity blocks (all m, or those in `parity_indices`) of k equal-length data blocks."""
        if len(data) != self.k:
            raise ValueError(f"expected {self.k} data blocks, got {len(data)}")
        blocks = [_as_block(d, f"data block {j}") for j, d in enumerate(data)]
        if len({len(b) for b in blocks}) > 1:
            raise ValueError(f"data blocks must have equal lengths, got {[len(b) for b in blocks]}")
        wanted = range(self.m) if parity_indices is None else [operator.index(i) for i in parity_indices]
        for i in wanted:
            if not 0 <= i < self.m:
                raise ValueError(f"parity index {i} out of range 0..{self.m - 1}")
        outs = [np.empty(len(blocks[0]), np.uint8) for _ in wanted]
        _apply(self._parity[list(wanted)], blocks, outs)
        return outs

    def _solve(self, have: Sequence[int], lost: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """(k block indices to read, matrix giving the `lost` data blocks from them)."""
        bad = [i for i in have if not 0 <= i < self.k + self.m]
        if bad:
            raise ValueError(f"block indices {bad} out of range 0..{self.k + self.m - 1}")
        have = sorted(set(have))
        if len(have) < self.k:
            raise ValueError(
                f"cannot decode: {self.k - len(have)} block(s) missing; need {self.k} of the "
                f"{self.k + self.m} blocks, got {len(have)} (indices {have})"
            )
        chosen = have[: self.k]  # data blocks first: identity rows keep the system small
        return chosen, gf_invert(self._generator[chosen])[list(lost)]

    def decode(self, available: Mapping[int, np.ndarray], length: int | None = None) -> list[np.ndarray]:
        """All k data blocks from any k blocks (index < k: data, else parity k..k+m-1).

        Blocks shorter than `length` (default: the longest given) are zero-padded.
        """
        lost = [j for j in range(self.k) if j not in available]  # survivors are all in chosen
        chosen, mat = self._solve(list(available), lost)
        blocks = {i: _as_block(available[i], f"block {i}") for i in chosen}
        n = max(len(b) for b in blocks.values()) if length is None else length
        for i, b in blocks.items():
            if len(b) > n:
                raise ValueError(f"block {i} has {len(b)} bytes, more than length={n}")
            if len(b) < n:
                blocks[i] = np.concatenate([b, np.zeros(n - len(b), np.uint8)])
        outs = {j: np.empty(n, np.uint8) for j in lost}
        _apply(mat, [blocks[i] for i in chosen], list(outs.values()))
        return [outs[j] if j in outs else blocks[j].copy() for j in range(self.k)]


def _read_into(f: io.FileIO, buf: np.ndarray) -> None:
    """Fill buf from f; past end of file, zeros (the conceptual padding)."""
    view, got = buf.data, 0
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    buf[got:] = 0


@contextlib.contextmanager
def _atomic_writers(paths: Sequence[str]) -> Iterator[list[io.BufferedWriter]]:
    """Files written at new temporary names beside each path, fsynced and renamed over path on success only."""
    files: list[io.BufferedWriter] = []
    tmps: list[str] = []
    try:
        for p in paths:
            fd, tmp = storage.create_temp(Path(p), os.O_WRONLY)
            tmps.append(str(tmp))
            files.append(os.fdopen(fd, "wb"))  # closed below, on every path
        yield files
        for f, p, tmp in zip(files, paths, tmps):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, p)
        for d in {os.path.dirname(os.path.abspath(p)) for p in paths}:
            with contextlib.suppress(OSError):  # make the renames durable where supported
                fd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except BaseException:
        for f, tmp in zip(files, tmps):
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def encode_files(
    data_paths: Sequence[str], parity_paths: Sequence[str | None], *, block_size: int = DEFAULT_BLOCK_SIZE
) -> None:
    """Write the parity files of k data files, streaming `block_size` bytes at a time.

    m = len(parity_paths); a None entry skips that parity row (a rank writes its own only).
    Each parity file is as long as the longest data file.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    rs = ReedSolomon(len(data_paths), len(parity_paths))
    wanted = [i for i, p in enumerate(parity_paths) if p is not None]
    targets = [p for p in parity_paths if p is not None]
    size = max(os.path.getsize(p) for p in data_paths)
    block_size = min(block_size, max(size, 1))
    bufs = [np.empty(block_size, np.uint8) for _ in data_paths]
    outs = [np.empty(block_size, np.uint8) for _ in wanted]
    with contextlib.ExitStack() as stack:
        srcs = [stack.enter_context(storage.open_read(p, buffering=0)) for p in data_paths]
        dsts = stack.enter_context(_atomic_writers(targets))
        for off in range(0, size, block_size):
            n = min(block_size, size - off)
            for src, b in zip(srcs, bufs):
                _read_into(src, b[:n])
            _apply(rs._parity[wanted], [b[:n] for b in bufs], [o[:n] for o in outs])
            for dst, o in zip(dsts, outs):
                dst.write(o[:n].data)


def decode_files(
    data_paths: Sequence[str | None],
    parity_paths: Sequence[str | None],
    sizes: Sequence[int],
    out_paths: Mapping[int, str],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> None:
    """Rebuild data files: out_paths[i] receives data file i, truncated to sizes[i].

    data_paths[i] / parity_paths[j] is None for a lost file; any k files suffice.
    """
    k, m = len(data_paths), len(parity_paths)
    if len(sizes) != k:
        raise ValueError(f"expected {k} sizes, got {len(sizes)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    bad = [i for i in out_paths if not 0 <= i < k]
    if bad:
        raise ValueError(f"out_paths keys {bad} out of range 0..{k - 1}")
    rs = ReedSolomon(k, m)
    paths = list(data_paths) + list(parity_paths)
    size = max(sizes)
    for i, p in enumerate(paths):  # a size mismatch means a damaged or foreign file
        want = sizes[i] if i < k else size
        if p is not None and os.path.getsize(p) != want:
            raise ValueError(f"{p}: expected {want} bytes, found {os.path.getsize(p)}")
    have = {i: p for i, p in enumerate(paths) if p is not None}
    lost = [i for i in sorted(out_paths) if data_paths[i] is None]
    chosen, mat = rs._solve(list(have), lost)
    block_size = min(block_size, max(size, 1))
    bufs = [np.empty(block_size, np.uint8) for _ in chosen]
    outs = dict(zip(lost, (np.empty(block_size, np.uint8) for _ in lost)))
    for i in out_paths:  # surviving data files asked for are copied (chosen holds them all)
        if i not in outs:
            outs[i] = bufs[chosen.index(i)]
    targets = sorted(out_paths)
    with contextlib.ExitStack() as stack:
        srcs = [stack.enter_context(storage.open_read(have[i], buffering=0)) for i in chosen]
        dsts = stack.enter_context(_atomic_writers([out_paths[i] for i in targets]))
        for off in range(0, size, block_size):
            n = min(block_size, size - off)
            for src, b in zip(srcs, bufs):
                _read_into(src, b[:n])
            _apply(mat, [b[:n] for b in bufs], [outs[i][:n] for i in lost])
            for dst, i in zip(dsts, targets):
                dst.write(outs[i][: max(0, min(n, sizes[i] - off))].data)
