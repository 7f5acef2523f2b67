"""The 16-byte digests of FTI-FF, by the id the file records.

FTI 1.1 used MD5 everywhere. MD5 runs at about 0.45 GiB/s here, slower than the page
cache, so ftidask's default is XXH3-128 (about 6 GiB/s per core, and it releases the GIL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import xxhash

from ..model.errors import FormatError


class Hasher(Protocol):
    """What a hash object of :data:`_HASHES` offers (hashlib's and xxhash's share it)."""

    def update(self, data: bytes | memoryview, /) -> None:
        """Add ``data`` to the hashed bytes."""

    def digest(self) -> bytes:
        """The digest of the bytes added so far."""

    def hexdigest(self) -> str:
        """The digest of the bytes added so far, as hex."""


#: id recorded in the file block -> (name, constructor, the digest of one buffer in one call: a few small
#: containers' hashes cost less without a hasher object each). Ids are part of the format: never reuse one.
_HASHES: dict[int, tuple[str, Callable[[], Hasher], Callable[[bytes | memoryview], bytes]]] = {
    1: ("md5", hashlib.md5, lambda data: hashlib.md5(data).digest()),
    2: ("xxh3_128", xxhash.xxh3_128, xxhash.xxh3_128_digest),
}
_IDS = {name: hid for hid, (name, _new, _oneshot) in _HASHES.items()}


def hash_id(name: str) -> int:
    """The format id of the hash called ``name``."""
    try:
        return _IDS[name]
    except KeyError:
        raise ValueError(f"unknown hash {name!r}; known: {', '.join(_IDS)}") from None


def hash_name(hid: int) -> str:
    """The name of the hash with format id ``hid``."""
    try:
        return _HASHES[hid][0]
    except KeyError:
        raise FormatError(f"unknown hash id {hid} in file block") from None


def new_hasher(hid: int) -> Hasher:
    """A fresh incremental hasher for format id ``hid``."""
    try:
        return _HASHES[hid][1]()
    except KeyError:
        raise FormatError(f"unknown hash id {hid} in file block") from None


def oneshot(hid: int) -> Callable[[bytes | memoryview], bytes]:
    """The function giving the 16-byte digest of one buffer for format id ``hid`` (what :func:`digest` of one
    part gives, without a hasher object per call)."""
    try:
        return _HASHES[hid][2]
    except KeyError:
        raise FormatError(f"unknown hash id {hid} in file block") from None


def digest(hid: int, *parts: bytes | memoryview) -> bytes:
    """The 16-byte digest of the concatenation of ``parts``."""
    hasher = new_hasher(hid)
    for part in parts:
        hasher.update(part)
    return hasher.digest()
