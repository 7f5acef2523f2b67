"""Digests of a device array's blocks, computed where the array lives, so that a differential checkpoint of a
CuPy array brings over the bus only the blocks that changed (FTI hashes its dCP blocks on the GPU for the same
reason).

A block's digest is two 64-bit lanes. Each lane is the sum (mod 2**64) over the block's 8-byte words of a
bijective mix (MurmurHash3's 64-bit finalizer) of the word XOR a key of its position in the block; each lane has
keys of its own. It is written with array operations only, for NumPy or CuPy alike (``xp``): no kernel to compile,
so the same code runs, and is tested, on the host. The array is hashed in slices of :data:`SLICE` bytes, so that
the temporaries stay a few times that in device memory.

What it promises: one changed word always changes both lanes (the mix is a bijection, the sum of the others is
unchanged); several changed words leave both as they were only by a coincidence of 128 bits, for data not crafted
against the keys (a sign flipped in two words, two words swapped: each term moves by a pseudo-random amount).
The digests only decide which blocks cross the bus: what a checkpoint writes is hashed on the host as ever, and a
recovery verifies that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 16 << 10  # bytes per digest: a changed byte brings this many over the bus
SLICE = 32 << 20  # bytes hashed per round of array operations
_SEED = 0x5EED_F71D_A5C0_0001  # the position keys: fixed, so that two runs give the same digests
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S = np.uint64(33)
_keys_cache: dict[tuple[int, Any, int], Any] = {}  # (array module's id, device, words per block) -> (2, words) keys


def usable(flat: Any, block: int = BLOCK) -> bool:
    """Whether the bytes ``flat`` (1-d uint8, on a device or not) can be hashed here: 8-byte aligned (a device
    reads a misaligned 8-byte word with an error that ends its context) and at least two blocks long."""
    ptr = flat.data.ptr if hasattr(flat.data, "ptr") else flat.ctypes.data
    return ptr % 8 == 0 and len(flat) >= 2 * block and block % 8 == 0


def _keys(xp: Any, flat: Any, words: int) -> Any:
    """The position keys, in the memory of ``flat``'s device (each device its own: another's would be a peer read)."""
    key = (id(xp), getattr(getattr(flat, "device", None), "id", None), words)
    keys = _keys_cache.get(key)
    if keys is None:
        host = np.random.default_rng(_SEED).integers(0, 2**64 - 1, size=(2, words), dtype=np.uint64, endpoint=True)
        keys = _keys_cache[key] = xp.asarray(host)
    return keys


def _mix(x: Any) -> Any:
    """MurmurHash3's fmix64 of every element of ``x`` (uint64), in place."""
    x ^= x >> _S
    x *= _M1
    x ^= x >> _S
    x *= _M2
    x ^= x >> _S
    return x


def digests(xp: Any, flat: Any, block: int = BLOCK) -> Any:
    """The digests of the blocks of ``flat`` (1-d uint8 of the module ``xp``, :func:`usable`): an array of
    ``(ceil(len / block), 2)`` uint64 of ``xp``. The last block, when short, is hashed padded with zeros."""
    n = len(flat)
    nblocks, words = -(-n // block), block // 8
    out = xp.empty((nblocks, 2), dtype=xp.uint64)
    keys = _keys(xp, flat, words)
    step = max(1, SLICE // block) * block
    for lo in range(0, n, step):
        seg = flat[lo:lo + step]
        if len(seg) % block:  # the array's last block
            padded = xp.zeros(-(-len(seg) // block) * block, dtype=xp.uint8)
            padded[:len(seg)] = seg
            seg = padded
        rows = seg.view(xp.uint64).reshape(-1, words)
        first = lo // block
        for lane in (0, 1):
            mixed = rows ^ keys[lane]
            out[first:first + len(rows), lane] = _mix(mixed).sum(axis=1, dtype=xp.uint64)
    return out


def changed(xp: Any, new: Any, old: Any) -> np.ndarray:
    """The indices (on the host, ascending) of the blocks whose digests differ between ``new`` and ``old``."""
    return np.asarray(_host(xp.flatnonzero((new != old).any(axis=1))), dtype=np.int64)


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a
