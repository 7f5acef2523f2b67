"""Compression of FTI-FF containers with numcodecs (Blosc, Zstd, LZ4).

The rule (containers are fixed once created, so a size that varies between checkpoints must
still fit): containers are planned by the *raw* size of the bytes they hold, exactly as for an
uncompressed variable, and a compressed container stores its raw span ``[dptr, dptr + span)``
encoded, with ``chunksize`` = the stored (compressed) size <= ``containersize``. ``fptr`` and
``containersize`` keep their FTI-FF meaning; the unused tail of a container stays a hole in
the file. A container whose encoding would not be smaller than its raw span is stored as is and
listed in the variable's ``extra["codec_plain"]`` (its container ids). The codec's JSON config is
recorded per variable in the variable table (``extra["codec"]``), so recovery needs no
configuration. The container hash covers the stored bytes: damage is found before decoding.

Only the codec ids below are ever instantiated from a file (never numcodecs' Pickle codec).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from ..model import codecspec
from ..model.codecspec import ALLOWED_IDS
from ..model.errors import ConfigError, FormatError
from . import hashing


def parse_compressor(spec: Any) -> dict[str, Any] | None:
    """The numcodecs config for a user's compressor spec (see :func:`ftidask.model.codecspec.parse_compressor`),
    checked by instantiating the codec, or None for no compression."""
    config = codecspec.parse_compressor(spec)
    if config is not None:
        try:
            get_codec(config)
        except FormatError as exc:
            raise ConfigError(str(exc)) from None
    return config


def get_codec(config: Mapping[str, Any]) -> Any:
    """A numcodecs codec for an allowed config (from a file or a user)."""
    import numcodecs

    config = dict(config)
    if config.get("id") not in ALLOWED_IDS:
        raise FormatError(f"codec {config.get('id')!r} is not one ftidask decodes ({', '.join(ALLOWED_IDS)})")
    # A file's config is checked as a user's is: numcodecs hands its integers to C as they are.
    codecspec.check_config(config, FormatError)
    try:
        return numcodecs.get_codec(config)
    except (TypeError, ValueError, OverflowError) as exc:  # unknown keys, values of the wrong type
        raise FormatError(f"invalid codec config {config!r}: {exc}") from None


def _typed(raw: memoryview | bytes, itemsize: int) -> np.ndarray:
    # Blosc's shuffle works per element: hand it the element size when the span allows it.
    data = np.frombuffer(raw, np.uint8)
    if itemsize in (2, 4, 8) and len(data) % itemsize == 0:
        return data.view(f"<u{itemsize}")
    return data


def encode_span(codec: Any, raw: memoryview | bytes, itemsize: int = 1) -> tuple[bytes | memoryview, bool]:
    """``(stored bytes, plain)``: the encoded span, or the raw one when encoding does not shrink it."""
    if len(raw) == 0:
        return raw, True
    encoded = codec.encode(_typed(raw, itemsize))
    encoded = bytes(encoded) if not isinstance(encoded, bytes) else encoded
    if len(encoded) >= len(raw):
        return raw, True
    return encoded, False


def decode_span(codec: Any, stored: bytes | memoryview, span: int, *, what: str = "container") -> bytes:
    """The raw bytes of a verified compressed container; a :class:`FormatError` on a size mismatch."""
    try:
        out = codec.decode(bytes(stored))
    except Exception as exc:  # numcodecs raises RuntimeError/ValueError; the bytes were hash-checked
        raise FormatError(f"{what}: cannot be decoded: {exc}") from None
    raw = np.asarray(out).reshape(-1).view(np.uint8).tobytes() if not isinstance(out, bytes) else out
    if len(raw) != span:
        raise FormatError(f"{what}: decodes to {len(raw)} bytes, expected {span}")
    return raw


def read_decoded(fd: int, meta: Any, info: Any, hash_id: int, what: str) -> bytes:
    """The raw span of compressed container ``meta`` (of the variable ``info``): read whole, hash-checked,
    then decoded; a :class:`FormatError` (no path) when the file ends inside it, the hash does not match
    or the bytes do not decode."""
    stored = bytearray(meta.chunksize)
    view, got = memoryview(stored), 0
    while got < meta.chunksize:
        n = os.preadv(fd, [view[got:]], meta.fptr + got)
        if n <= 0:
            break
        got += n
    if got != meta.chunksize:
        raise FormatError(f"{what}: file ends inside its data")
    if hashing.digest(hash_id, stored) != meta.hash:
        raise FormatError(f"{what}: data hash does not match (damaged data)")
    return decode_span(var_codec(info.extra), stored, raw_span(info.nbytes, meta.dptr, meta.containersize), what=what)


def raw_span(nbytes: int, dptr: int, containersize: int) -> int:
    """Raw bytes of a variable held by a container (FTI-FF's chunksize rule on the raw stream)."""
    return max(0, min(containersize, nbytes - dptr))


def var_codec(extra: Mapping[str, Any]) -> Any | None:
    """The codec recorded for a variable (its ``VarInfo.extra``), or None when it is stored raw."""
    config = extra.get("codec")
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise FormatError(f"invalid codec record {config!r}")
    return get_codec(config)


def plain_ids(extra: Mapping[str, Any]) -> set[int]:
    """Container ids of a compressed variable that are stored raw."""
    try:
        return {int(c) for c in extra.get("codec_plain", [])}
    except (TypeError, ValueError, OverflowError):  # OverflowError: int() of JSON's Infinity
        raise FormatError(f"invalid codec_plain record {extra.get('codec_plain')!r}") from None


def decode_problem(info: Any, meta: Any, stored: memoryview | bytes, what: str) -> str:
    """Why a hash-checked container (``meta``, of the variable ``info``: a VarInfo or None) does not decode
    to its raw span, or '' (also for a container stored raw).

    Checked with the hashes, before recovery writes any array: a container that failed to decode only
    while the arrays are filled would leave the variables copied before it recovered and the others not.
    """
    if info is None or "codec" not in info.extra or meta.containerid in plain_ids(info.extra):
        return ""
    try:
        decode_span(var_codec(info.extra), stored, raw_span(info.nbytes, meta.dptr, meta.containersize), what=what)
    except FormatError as exc:
        return str(exc)
    return ""


def annotate_trailer(trailer: MutableMapping[str, Any], plain: Mapping[int, list[int]]) -> None:
    """Record, in the variable table, which containers of compressed variables are stored raw."""
    entries = [dict(e) for e in trailer.get("vars", [])]
    for entry in entries:
        vid = entry.get("id")
        if vid in plain and plain[vid]:
            extra = dict(entry.get("extra", {}))
            extra["codec_plain"] = sorted(plain[vid])
            entry["extra"] = extra
    trailer["vars"] = entries
