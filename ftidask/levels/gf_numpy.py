"""The NumPy reference of the GF(2^8) arithmetic behind :mod:`ftidask.levels.erasure`: the field's tables,
matrix inversion, and ``outs[i] = XOR_j mat[i][j] * ins[j]`` with table lookups.

GF multiplications are table lookups (``np.take``, ~2 ns each whatever the entry size); one lookup serves
several output rows (entries pack the products for up to 8 rows) and, for large blocks, tables are indexed by
byte pairs (65536 entries), so a 4+4 encode does one lookup per two input bytes. The native kernel
(:mod:`ftidask.levels.gf_native`) computes the same bytes; this code is the reference it is tested against
and the fallback when it is not built. Separate from the codec (:mod:`ftidask.levels.erasure`: the code's
matrix, its format and the files), which chooses between the two.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

_POLY = 0x11D
_WIDE_MIN_BYTES = 1 << 20  # below this, building 64K-entry tables costs more than it saves
_WIDE_TABLE_BUDGET = 2 << 20  # tables used per chunk must stay in L2, else lookups thrash
_CHUNK_BYTES = 128 << 10  # input bytes per step: inputs, tables and accumulator stay in L2
_ACC_BYTES = 512 << 10  # cap on the packed accumulator (slots x chunk)


def _gf_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(510, np.uint8)
    log = np.zeros(256, np.int64)
    x = 1
    for i in range(255):
        exp[i], log[x] = x, i
        x = (x << 1) ^ (_POLY if x & 0x80 else 0)
    exp[255:] = exp[:255]
    mul = np.zeros((256, 256), np.uint8)
    mul[1:, 1:] = exp[log[1:, None] + log[None, 1:]]
    return exp, log, mul


#: Powers of the generator (twice over, so that a sum of logs indexes it), logs, and the full product table.
EXP, LOG, MUL = _gf_tables()


def inv(a: int) -> int:
    """The inverse of non-zero field element ``a``."""
    return int(EXP[255 - LOG[a]])


def gf_invert(a: np.ndarray) -> np.ndarray:
    """Inverse of a square GF(2^8) matrix by Gauss-Jordan elimination."""
    n = len(a)
    aug = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        rows = np.nonzero(aug[col:, col])[0]
        if not len(rows):
            raise ValueError("singular matrix")  # cannot happen for an MDS generator
        piv = col + int(rows[0])
        aug[[col, piv]] = aug[[piv, col]]
        aug[col] = MUL[inv(int(aug[col, col]))][aug[col]]
        factors = aug[:, col].copy()
        factors[col] = 0
        aug ^= MUL[factors[:, None], aug[col][None, :]]
    return aug[:, n:]


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@functools.lru_cache(maxsize=32)  # at most 32 x 512 KiB
def _table(wide: int, coefs: tuple[int, ...]) -> np.ndarray:
    """Lookup table: `wide` input bytes -> their products with each coef, packed.

    Entry layout is (slot, byte) so that output row q is the q-th run of `wide`
    bytes of each entry; unused slots (padding to a power of two) stay zero.
    """
    slots = 1 << (len(coefs) - 1).bit_length()
    keys = np.arange(256**wide, dtype=_UINT[wide]).view(np.uint8).reshape(-1, wide)
    tab = np.zeros((len(keys), slots, wide), np.uint8)
    for q, c in enumerate(coefs):
        tab[:, q, :] = MUL[c][keys]
    return tab.reshape(len(keys), -1).view(_UINT[wide * slots]).reshape(-1)


def _plan(rows: int, k: int, nbytes: int) -> tuple[int, int]:
    """Pick (index width, rows per lookup) minimising lookups per input byte."""
    group8 = min(rows, 8)
    cost8 = -(-rows // group8)  # byte tables: one lookup per byte per group of <= 8 rows
    if nbytes >= max(_WIDE_MIN_BYTES, 2):
        for g in (min(4, rows), min(2, rows), 1):
            if k * 65536 * 2 * (1 << (g - 1).bit_length()) <= _WIDE_TABLE_BUDGET:
                if -(-rows // g) * 0.5 < cost8:  # pair tables: a lookup covers 2 bytes
                    return 2, g
                break
    return 1, group8

def apply_numpy(mat: np.ndarray, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
    """outs[i] = XOR_j mat[i][j] * ins[j], all 1-D contiguous uint8 of one length (the NumPy reference)."""
    rows, k = mat.shape
    if not rows:
        return
    n = len(outs[0])
    wide, group = _plan(rows, k, n)
    if wide == 2 and n % 2:  # the odd last byte goes through byte tables
        apply_numpy(mat, [a[n - 1 :] for a in ins], [o[n - 1 :] for o in outs])
        n -= 1
    for g0 in range(0, rows, group):
        rs = range(g0, min(g0 + group, rows))
        slots = 1 << (len(rs) - 1).bit_length()
        chunk = max(min(_CHUNK_BYTES, _ACC_BYTES // slots) // wide * wide, wide)
        cols = [(j, tuple(int(mat[i, j]) for i in rs)) for j in range(k)]
        cols = [(j, c) for j, c in cols if any(c)]
        dt = _UINT[wide * slots]
        tmp = np.empty(chunk // wide, dt)
        acc = np.empty(chunk // wide, dt) if slots > 1 else None
        for off in range(0, n, chunk):
            end = min(off + chunk, n)
            h = (end - off) // wide
            a = acc[:h] if acc is not None else outs[rs[0]][off:end].view(dt)
            first = True
            for j, coefs in cols:
                src = ins[j][off:end].view(_UINT[wide])
                if coefs == (1,):  # single row, coefficient 1: plain XOR, no lookup
                    val = src
                else:
                    val = np.take(_table(wide, coefs), src, out=a if first else tmp[:h], mode="clip")
                if first:
                    if val is not a:
                        np.copyto(a, val)
                    first = False
                else:
                    np.bitwise_xor(a, val, out=a)
            if first:
                a[:] = 0
            if acc is not None:  # unpack slot q of every entry into output row q
                packed = a.view(_UINT[wide]).reshape(h, slots)
                for q, i in enumerate(rs):
                    outs[i][off:end].view(_UINT[wide])[:] = packed[:, q]
