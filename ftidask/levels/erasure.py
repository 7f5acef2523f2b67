"""Reed-Solomon erasure code over GF(2^8) (systematic, Cauchy matrix).

PLACEHOLDER written by the MPI helper with the agreed API, so that L3 can be built and tested
before the real codec lands on main; on merge, take main's version of this file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import FTIError

_EXP = np.zeros(512, dtype=np.uint8)
_LOG = np.zeros(256, dtype=np.int32)
_x = 1
for _i in range(255):
    _EXP[_i] = _x
    _LOG[_x] = _i
    _x <<= 1
    if _x & 0x100:
        _x ^= 0x11D
_EXP[255:510] = _EXP[0:255]


def _mul(a: int, b: int) -> int:
    return 0 if a == 0 or b == 0 else int(_EXP[_LOG[a] + _LOG[b]])


def _inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(_EXP[255 - _LOG[a]])


_TABLES: dict[int, np.ndarray] = {}


def _table(c: int) -> np.ndarray:
    t = _TABLES.get(c)
    if t is None:
        t = np.array([_mul(c, v) for v in range(256)], dtype=np.uint8)
        _TABLES[c] = t
    return t


def _matinv(m: list[list[int]]) -> list[list[int]]:
    n = len(m)
    a = [row[:] + [1 if i == j else 0 for j in range(n)] for i, row in enumerate(m)]
    for col in range(n):
        piv = next(r for r in range(col, n) if a[r][col])
        a[col], a[piv] = a[piv], a[col]
        f = _inv(a[col][col])
        a[col] = [_mul(f, v) for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                g = a[r][col]
                a[r] = [v ^ _mul(g, w) for v, w in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]


class ReedSolomon:
    """k data blocks, m parity blocks; any k of the k+m rebuild the data."""

    def __init__(self, k: int, m: int) -> None:
        if k < 1 or m < 0 or k + m > 256:
            raise FTIError(f"Reed-Solomon: bad k={k}, m={m}")
        self.k, self.m = k, m
        self.matrix = [[_inv((k + i) ^ j) for j in range(k)] for i in range(m)]

    def _combine(self, coefs: Sequence[int], blocks: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros(len(blocks[0]), dtype=np.uint8)
        for c, b in zip(coefs, blocks, strict=True):
            if c == 1:
                out ^= b
            elif c:
                out ^= _table(c)[b]
        return out

    def encode(self, data_blocks: Sequence[np.ndarray], parity_indices: Sequence[int] | None = None
               ) -> list[np.ndarray]:
        """Parity blocks (all m, or those numbered ``parity_indices`` in 0..m-1)."""
        blocks = [np.frombuffer(b, dtype=np.uint8) for b in data_blocks]
        idx = range(self.m) if parity_indices is None else parity_indices
        return [self._combine(self.matrix[i], blocks) for i in idx]

    def decode(self, available: Mapping[int, np.ndarray], length: int) -> list[np.ndarray]:
        """The k data blocks from any k available blocks (index 0..k-1 data, k..k+m-1 parity)."""
        if len(available) < self.k:
            raise FTIError(f"Reed-Solomon: {len(available)} blocks available, {self.k} needed")
        chosen = sorted(available)[: self.k]
        rows = [[1 if i == j else 0 for j in range(self.k)] if i < self.k else self.matrix[i - self.k]
                for i in chosen]
        inv = _matinv(rows)
        blocks = [np.frombuffer(available[i], dtype=np.uint8)[:length] for i in chosen]
        return [blocks[chosen.index(j)].copy() if j in chosen else self._combine(inv[j], blocks)
                for j in range(self.k)]
