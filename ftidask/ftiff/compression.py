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

A span of more than :data:`FRAME_BYTES` raw bytes is encoded in frames of that many raw bytes (the last
one shorter), each on its own, by several threads (numcodecs releases the GIL), and stored one after the
other; ``extra["codec_frames"]`` maps the container id (a str) to the frames' stored sizes and
``extra["codec_frame_bytes"]`` gives the raw size of a frame. A recovery decodes them on several threads
too. A container without an entry there is one frame (files written before frames, small spans).

Only the codec ids below are ever instantiated from a file (never numcodecs' Pickle codec).
"""

from __future__ import annotations

import itertools
import os
import reprlib
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import numpy as np

from ..model import codecspec
from ..model.codecspec import ALLOWED_IDS
from ..model.errors import ConfigError, FormatError
from ..model.pools import LazyPool
from . import hashing
from .readahead import read_full

T = TypeVar("T")
FRAME_BYTES = 4 << 20  # raw bytes a frame of a larger container holds (a multiple of every element size)
# The smallest frame a file may declare: each frame costs a task and a decoding, so a forged record of tiny
# frames (one a byte) would cost thousands of times its file's bytes in memory and time.
MIN_FRAME_BYTES = 64 << 10
_FRAME_THREADS = min(8, os.cpu_count() or 1)
_FRAME_WINDOW = 4 * _FRAME_THREADS  # frames queued at once while decoding (a future each, not one per frame)
_frames = LazyPool(_FRAME_THREADS, "ftidask-frames")  # its tasks start no other task: no deadlock


def frame_threads() -> int:
    """How many threads of this process encode and decode frames (at most, all callers together)."""
    return _frames.threads


def limit_frame_threads(share: int | None) -> int:
    """Encode and decode frames on at most ``share`` threads in this process (None: the default,
    ``min(8, cores)``); the number now used.

    A process that runs several tasks at once beside other such processes (a Dask worker: ``nthreads``
    tasks, several workers per machine) gives the pool its share, not up to 8 threads each: the pool is the
    process's, shared by all its tasks (a Dask worker gets twice its ``nthreads``, see
    :mod:`ftidask.backends.dask.codecthreads`). The share is also capped by the default (more threads than
    cores would only compete)."""
    _frames.resize(_FRAME_THREADS if share is None else max(1, min(_FRAME_THREADS, int(share))))
    return _frames.threads


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
    """A numcodecs codec for an allowed config (from a file or a user). Without numcodecs (an install without
    the ``zarr`` extra) a :class:`ConfigError` says what to install: the file is not damaged."""
    config = dict(config)
    if config.get("id") not in ALLOWED_IDS:
        raise FormatError(f"codec {config.get('id')!r} is not one ftidask decodes ({', '.join(ALLOWED_IDS)})")
    # A file's config is checked as a user's is: numcodecs hands its integers to C as they are.
    codecspec.check_config(config, FormatError)
    try:
        import numcodecs
    except ImportError:
        raise ConfigError(f"compression (codec {config['id']!r}) needs numcodecs, which is not installed: "
                          "pip install 'ftidask[zarr]'") from None
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


def encode_container(codec: Any, raw: memoryview | bytes,
                     itemsize: int = 1) -> tuple[list[bytes | memoryview], bool, list[int] | None]:
    """``(stored pieces, plain, frame sizes)``: :func:`encode_span`, in frames of :data:`FRAME_BYTES` raw bytes
    encoded on several threads when the span is longer (the frames, their stored sizes; else one piece, None).
    The pieces are written one after the other (never joined: a copy of the whole container)."""
    if len(raw) <= FRAME_BYTES:
        stored, plain = encode_span(codec, raw, itemsize)
        return [stored], plain, None
    view = memoryview(raw)
    view = view if view.ndim == 1 and view.format == "B" else view.cast("B")

    def one(lo: int) -> bytes | Exception:
        # An error comes back as a value, its traceback dropped: raised from its future, it would sit in a
        # cycle (the future, the exception, the frames holding the futures) keeping the caller's buffer
        # exported until a garbage collection (see decode_container).
        try:
            out = codec.encode(_typed(view[lo:lo + FRAME_BYTES], itemsize))
        except Exception as exc:
            return exc.with_traceback(None)
        return out if isinstance(out, bytes) else bytes(out)

    frames = _all_done([_frames.submit(one, lo) for lo in range(0, len(view), FRAME_BYTES)])
    failed = next((f for f in frames if isinstance(f, Exception)), None)
    if failed is not None:
        frames.clear()
        try:
            raise failed
        finally:  # this frame's locals must not hold the exception its traceback holds
            failed = None
    if sum(len(f) for f in frames) >= len(view):
        return [raw], True, None
    return frames, False, [len(f) for f in frames]


def _all_done(futures: list[Future[T]]) -> list[T]:
    """Every result, once every task has ended (a task left running could still write into memory that the
    caller, seeing the first error, unmaps); the first error then."""
    wait(futures)
    return [f.result() for f in futures]


class StoredSpan:
    """Bytes ``[offset, offset + length)`` of a file, read (``pread``) only when a slice of them is made bytes: a
    container decoded a frame at a time from its file, never mapped (a file cut under a map ends the process with
    SIGBUS; here it is a short read, a :class:`FormatError`) nor read whole."""

    def __init__(self, fd: int, offset: int, length: int, what: str = "container") -> None:
        self.fd, self.offset, self.length, self.what = fd, offset, length, what

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> StoredSpan:
        start, stop, _step = key.indices(self.length)
        return StoredSpan(self.fd, self.offset + start, max(stop - start, 0), self.what)

    def __bytes__(self) -> bytes:
        data = os.pread(self.fd, self.length, self.offset)
        if len(data) != self.length:
            raise FormatError(f"{self.what}: the file ends inside its data (it shrank while it was read)")
        return data


def declared_size(codec_id: str, stored: bytes | memoryview | StoredSpan) -> int | None:
    """The raw size that an encoded span's own header declares (Zstd's frame content size, the size LZ4's
    numcodecs codec puts first, Blosc's ``nbytes``), or None when it declares none or is too short.

    Read before decoding: the codec allocates what its header declares, and a hostile file's hash-checked
    bytes can declare anything (a Zstd frame of 32 KiB unpacks to 1 GiB)."""
    head = bytes(stored[:18])
    if codec_id == "lz4":
        return int.from_bytes(head[:4], "little") if len(head) >= 4 else None
    if codec_id == "blosc":
        return int.from_bytes(head[4:8], "little") if len(head) >= 16 else None
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":  # Zstd's magic number (little-endian 0xFD2FB528)
        return None
    fhd = head[4]  # frame header descriptor: size flag (2 bits), single segment, ..., dictionary id flag (2 bits)
    single = (fhd >> 5) & 1
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]  # after the window descriptor and dictionary id
    width = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if width == 0 or len(head) < at + width:
        return None  # no content size: numcodecs never writes such a frame
    return int.from_bytes(head[at:at + width], "little") + (256 if width == 2 else 0)


def decode_span(codec: Any, stored: bytes | memoryview | StoredSpan, span: int, *, what: str = "container",
                into: memoryview | None = None) -> memoryview | bytes:
    """The raw bytes of a verified compressed container (decoded into ``into``, ``span`` bytes long, if
    given); a :class:`FormatError` on a size mismatch, found from the codec's header before anything is
    decoded or allocated."""
    declared = declared_size(codec.codec_id, stored)
    if declared != span:
        said = "no size" if declared is None else f"{declared} raw bytes"
        raise FormatError(f"{what}: cannot be decoded: its {codec.codec_id} header declares {said}, expected {span}")
    if span == 0:
        return b""
    data = bytes(stored)  # a StoredSpan's short read: its own FormatError, said as it is
    out = np.empty(span, np.uint8) if into is None else np.frombuffer(into, np.uint8)
    try:  # the codec writes there, never more (it refuses a buffer smaller than its header declares)
        codec.decode(data, out=out)
    except Exception as exc:  # numcodecs raises RuntimeError/ValueError; the bytes were hash-checked
        raise FormatError(f"{what}: cannot be decoded: {exc}") from None
    return out.data.cast("B")


def decode_container(info: Any, meta: Any, stored: bytes | memoryview | StoredSpan, what: str,
                     out: memoryview | None = None) -> None:
    """Decode compressed container ``meta`` (of the variable ``info``, a VarInfo) from its hash-checked ``stored``
    bytes into ``out`` (as long as its raw span; each frame where it belongs), or, ``out`` None, only check that it
    decodes (a frame at a time held): one frame, or its frames on several threads; a :class:`FormatError`
    otherwise."""
    span = raw_span(info.nbytes, meta.dptr, meta.containersize)
    codec = var_codec(info.extra)
    layout = frame_layout(info, meta, len(stored), what)
    if layout is None:
        decode_span(codec, stored, span, what=what, into=None if out is None else out[:span])
        return
    frame, sizes = layout
    starts = [0, *itertools.accumulate(sizes[:-1])]
    view = stored if isinstance(stored, StoredSpan) else memoryview(stored)
    for lo in range(0, len(sizes), _FRAME_WINDOW):  # a window at a time: the frames after a failure never run
        jobs = []
        for i in range(lo, min(len(sizes), lo + _FRAME_WINDOW)):
            n = min(frame, span - i * frame)
            jobs.append((view[starts[i]:starts[i] + sizes[i]], n, None if out is None else out[i * frame:i * frame + n],
                         f"{what}, frame {i}"))
        problem = decode_frames(codec, jobs)
        if problem:
            raise FormatError(problem)


def frame_layout(info: Any, meta: Any, stored: int, what: str) -> tuple[int, list[int]] | None:
    """``(raw bytes of a frame, stored bytes of each frame)`` of compressed container ``meta`` (``stored`` bytes)
    kept in frames, checked against its raw span; None for one frame; a :class:`FormatError` for a bad record."""
    sizes = _frame_sizes(info.extra, meta.containerid, what)
    if sizes is None:
        return None
    span = raw_span(info.nbytes, meta.dptr, meta.containersize)
    frame = info.extra.get("codec_frame_bytes")
    if isinstance(frame, bool) or not isinstance(frame, int) or frame < MIN_FRAME_BYTES:
        raise FormatError(f"{what}: invalid codec_frame_bytes record {frame!r} (at least {MIN_FRAME_BYTES})")
    if len(sizes) != -(-span // frame) or sum(sizes) != stored:
        raise FormatError(f"{what}: {len(sizes)} frames of {sum(sizes)} stored bytes do not make a span of {span} "
                          f"raw bytes in frames of {frame} from {stored} stored bytes")
    return frame, sizes


def decode_frames(codec: Any, frames: list[tuple[Any, int, memoryview | None, str]]) -> str:
    """Decode each ``(stored bytes, raw size, into, what)`` frame on the frame threads, into its place (``into``
    None: only checked): the first problem, or ''."""
    def one(job: tuple[Any, int, memoryview | None, str]) -> str:
        # An error comes back as its message, never as an exception: one kept in a future (with the frames of
        # its traceback, and their views of the caller's memory) would outlive the call.
        stored, n, into, where = job
        try:
            decode_span(codec, stored, n, what=where, into=into)
        except FormatError as exc:
            return str(exc)
        return ""
    return next((p for p in _all_done([_frames.submit(one, job) for job in frames]) if p), "")


def _frame_sizes(extra: Mapping[str, Any], containerid: int, what: str) -> list[int] | None:
    """The stored sizes of a container's frames (``extra["codec_frames"]``), or None for one frame."""
    table = extra.get("codec_frames")
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise FormatError(f"{what}: invalid codec_frames record {table!r}")
    sizes = table.get(str(containerid))
    if sizes is None:
        return None
    if not isinstance(sizes, list) or not sizes or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes):
        raise FormatError(f"{what}: invalid frame sizes {sizes!r}")
    return sizes


def read_decoded(fd: int, meta: Any, info: Any, hash_id: int, what: str, out: memoryview) -> None:
    """The raw span of compressed container ``meta`` (of the variable ``info``) into ``out``: read whole,
    hash-checked, then decoded; a :class:`FormatError` (no path) when the file ends inside it, the hash does not
    match or the bytes do not decode."""
    stored = bytearray(meta.chunksize)
    if read_full(fd, meta.fptr, memoryview(stored)) != meta.chunksize:
        raise FormatError(f"{what}: file ends inside its data")
    if hashing.digest(hash_id, stored) != meta.hash:
        raise FormatError(f"{what}: data hash does not match (damaged data)")
    decode_container(info, meta, stored, what, out)


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


def encoded(info: Any, meta: Any) -> bool:
    """Whether container ``meta`` of the variable ``info`` (a VarInfo or None) holds encoded bytes: a
    compressed variable's container not stored raw."""
    return info is not None and "codec" in info.extra and meta.containerid not in plain_ids(info.extra)


def plain_ids(extra: Mapping[str, Any]) -> set[int]:
    """Container ids of a compressed variable that are stored raw."""
    try:
        return {int(c) for c in extra.get("codec_plain", [])}
    except (TypeError, ValueError, OverflowError):  # OverflowError: int() of JSON's Infinity
        raise FormatError(f"invalid codec_plain record {reprlib.repr(extra.get('codec_plain'))}") from None


def decode_problem(info: Any, meta: Any, stored: memoryview | bytes | StoredSpan, what: str) -> str:
    """Why a hash-checked container (``meta``, of the variable ``info``: a VarInfo or None) does not decode
    to its raw span, or '' (also for a container stored raw).

    Checked with the hashes, before recovery writes any array: a container that failed to decode only
    while the arrays are filled would leave the variables copied before it recovered and the others not.
    """
    try:
        if not encoded(info, meta):
            return ""
        decode_container(info, meta, stored, what)
    except FormatError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a codec's MemoryError, say: damage too, said here (an exception
        # leaving the verifier's threads would keep, in its traceback, views of the stored bytes)
        return f"{what}: cannot be decoded: {type(exc).__name__}: {exc}"
    return ""


def annotate_trailer(trailer: MutableMapping[str, Any], plain: Mapping[int, list[int]],
                     frames: Mapping[int, Mapping[int, list[int]]] | None = None) -> None:
    """Record, in the variable table, which containers of compressed variables are stored raw, and the
    frames of those stored in frames (by var id, then container id)."""
    frames = frames or {}
    entries = [dict(e) for e in trailer.get("vars", [])]
    for entry in entries:
        vid = entry.get("id")
        extra = dict(entry.get("extra", {}))
        if vid in plain and plain[vid]:
            extra["codec_plain"] = sorted(plain[vid])
        if frames.get(vid):
            extra["codec_frames"] = {str(cid): sizes for cid, sizes in sorted(frames[vid].items())}
            extra["codec_frame_bytes"] = FRAME_BYTES
        if extra:
            entry["extra"] = extra
    trailer["vars"] = entries
