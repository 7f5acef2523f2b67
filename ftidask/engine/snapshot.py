"""The snapshot an asynchronous checkpoint writes from: every protected variable as it was at the call.

Three mechanisms, tried in this order by ``async_snapshot = auto``:

``cow``
    Copy-on-write (:mod:`ftidask.memsnap.cow`): the variables' pages are write-protected at the call
    and written out from the live memory; a page the application writes before it is written out is
    copied aside first, by a native thread (no GIL). Extra memory: only those pages. Needs Linux's
    userfaultfd with write protection for kernel writes too (privileged, or
    ``vm.unprivileged_userfaultfd = 1``), the native extension, and contiguous arrays of private
    anonymous memory that no other userfaultfd holds (the differential checkpoints' page tracker
    does: levels 5-8 take ``copy``). ``auto`` copies arrays under 1 MiB instead (a fault costs more
    than their copy); ``cow`` forced takes every array.
``copy``
    Each variable copied at the call into staging buffers (memory speed; large ones by a few threads),
    reused from one checkpoint to the next; their total is bounded by ``async_buffer_mb`` (0: half the
    memory available).
``blocking``
    Neither fits: the checkpoint is written before the call returns, from the live arrays.

Python states are encoded to their bytes at the call, whatever the mechanism (a new array each time).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..memsnap import cow
from ..model.arrays import ArrayBytes, copy_items, stream_order
from ..model.errors import ConfigError
from ..model.pools import LazyPool
from .variables import Protected

log = logging.getLogger("ftidask")

MECHANISMS = ("auto", "cow", "copy", "blocking")
COW_MIN_BYTES = 1 << 20  # smaller variables are copied: a page fault costs more than copying them
PARALLEL_COPY_BYTES = 64 << 20  # larger contiguous variables are copied by several threads at once

COPY_THREADS = min(8, os.cpu_count() or 1)

_copiers = LazyPool(COPY_THREADS, "ftidask-copy")


@dataclasses.dataclass
class FrozenState:
    """A Python state's bytes taken at the call (what the background writes, whatever the state becomes)."""

    kind: str
    data: np.ndarray

    def encode(self) -> np.ndarray:
        """The bytes taken at the call (as :meth:`Holder.encode` gave them then)."""
        return self.data


@dataclasses.dataclass
class Snapshot:
    """What a checkpoint in flight writes: ``variables`` (frozen), and for copy-on-write ones the byte
    sources to read them through. :meth:`release` gives the memory back once the file is written."""

    variables: dict[int, Protected]
    sources: dict[int, Any]
    mechanism: str
    extra_bytes: int = 0  # copied at the call (copy), or peak of pages copied aside (cow, known at release)
    _release: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        """Unprotect what copy-on-write still protects and return staging buffers (idempotent)."""
        while self._release:
            self._release.pop()()


class CopyPool:
    """Staging buffers kept between checkpoints (already faulted in, so a copy runs at memory speed),
    at most ``limit`` bytes in all, in flight or free."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[np.ndarray] = []
        self._held = 0  # bytes in buffers, free or lent
        self._lock = threading.Lock()

    def take(self, sizes: list[int]) -> list[np.ndarray] | None:
        """A buffer of each size (free ones reused), or None, taking nothing, beyond the limit."""
        with self._lock:
            free = sorted(self._free, key=lambda b: b.nbytes)
            reused: list[np.ndarray | None] = []
            need = 0
            for size in sizes:
                at = next((i for i, b in enumerate(free) if size <= b.nbytes <= 2 * size + (1 << 20)), None)
                if at is not None:
                    reused.append(free.pop(at))
                else:
                    reused.append(None)
                    need += size
            spare = sum(b.nbytes for b in free)  # free buffers of sizes no longer asked for: dropped
            if self._held - spare + need > self.limit:
                return None
            self._free = []
            self._held += need - spare
        try:
            return [b if b is not None else np.empty(size, np.uint8) for b, size in zip(reused, sizes, strict=True)]
        except MemoryError:  # more than this machine can give now: no buffer, the checkpoint is written blocking
            with self._lock:
                self._held -= need
                self._free.extend(b for b in reused if b is not None)
            return None

    def give_back(self, buffers: list[np.ndarray]) -> None:
        """Return ``buffers`` (from :meth:`take`) to the free ones, for the next checkpoint."""
        with self._lock:
            self._free.extend(buffers)

    def clear(self) -> None:
        """Drop the free buffers (those lent still count until given back)."""
        with self._lock:
            self._held -= sum(b.nbytes for b in self._free)
            self._free = []


def _frozen_var(p: Protected, array: np.ndarray) -> Protected:
    state = FrozenState(p.state.kind, p.array) if p.state is not None else None
    device = None if p.device is None else str(p.device)  # its name only: nothing downloads into a snapshot
    return dataclasses.replace(p, array=array, state=state, device=device)  # type: ignore[arg-type]


def _copy_into(buf: np.ndarray, array: np.ndarray) -> np.ndarray:
    order = stream_order(array)
    frozen = np.ndarray(array.shape, array.dtype, buffer=buf[:array.nbytes].data, order=order)
    big = array.nbytes >= PARALLEL_COPY_BYTES and COPY_THREADS > 1
    stream = ArrayBytes(array, order).view(0, array.nbytes) if big else None  # None: not contiguous
    if stream is not None:
        _parallel_copy(buf[:array.nbytes], np.frombuffer(stream, np.uint8))
    else:
        copy_items(frozen, array, casting="no")  # a structured dtype's padding too: the buffer holds old bytes
    return frozen


def _parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` in slices on a few threads (NumPy releases the GIL for the copy): one core's
    memcpy leaves most of the memory bandwidth unused, and this copy is all the application waits for."""
    step = (-(-src.nbytes // COPY_THREADS) + 4095) & ~4095  # page-aligned slices
    list(_copiers.get().map(lambda lo: np.copyto(dst[lo:lo + step], src[lo:lo + step]), range(0, src.nbytes, step)))


def take(variables: Mapping[int, Protected], mechanism: str, pool: CopyPool, *,
         cow_ok: bool = True, device_copies: Mapping[int, Any] | None = None) -> Snapshot:
    """Snapshot ``variables`` now (their Python states already encoded) with ``mechanism`` (see the
    module's text; ``cow_ok`` False rules copy-on-write out for this checkpoint). ``device_copies``: CuPy arrays
    already copied in device memory (:meth:`ftidask.engine.device.DeviceHolder.device_copy`), by id: their
    mirrors are neither protected nor copied, the job fills them from those copies before it writes."""
    if mechanism not in MECHANISMS:
        raise ConfigError(f"async_snapshot = {mechanism!r}: expected one of {', '.join(MECHANISMS)}")
    if mechanism == "blocking":
        return Snapshot(_live(variables, device_copies or {}), {}, "blocking")
    # A view: the description (shape, dtype) of the call, whatever the application does to the array's.
    frozen = {vid: _frozen_var(p, p.array.view() if p.state is None else p.array) for vid, p in variables.items()}
    for vid, copy in (device_copies or {}).items():
        frozen[vid] = dataclasses.replace(frozen[vid], device=copy)
    host = {vid: p for vid, p in variables.items() if vid not in (device_copies or {})}
    # auto leaves small arrays to a copy (cheaper than a fault); a forced cow takes every array it can.
    releases: list[Callable[[], None]] = []
    try:
        snap = _take(host, mechanism, pool, cow_ok, frozen, releases)
    except BaseException:  # failed or interrupted (Ctrl-C) part-way: no protection, no buffer held
        for release in releases:
            release()
        raise
    # None: the staging buffers could not be had; the live variables, written before the call returns
    return snap if snap is not None else Snapshot(_live(variables, device_copies or {}), {}, "blocking")


def _live(variables: Mapping[int, Protected], device_copies: Mapping[int, Any]) -> dict[int, Protected]:
    """The live ``variables``, for a checkpoint written before the call returns. A device array's bytes were taken at
    the call, into its mirror or into a device copy (which the checkpoint brings into the mirror): marked so, they
    do not cross the bus again."""
    out = dict(variables)
    for vid, p in variables.items():
        if p.device is not None and not isinstance(p.device, str):
            out[vid] = dataclasses.replace(p, device=device_copies.get(vid, str(p.device)))
    return out


def _take(variables: Mapping[int, Protected], mechanism: str, pool: CopyPool, cow_ok: bool,
          frozen: dict[int, Protected], releases: list[Callable[[], None]]) -> Snapshot | None:
    """:func:`take`'s work on the host's ``variables``, ``releases`` filled as soon as something is held (take
    releases it on an error); None when the staging buffers cannot be had."""
    least = 1 if mechanism == "cow" else COW_MIN_BYTES
    big = [vid for vid, p in variables.items() if p.state is None and p.array.nbytes >= least]
    sources: dict[int, Any] = {}
    used = "copy"
    if mechanism in ("auto", "cow") and cow_ok and big:
        cow = _try_cow([variables[vid].array for vid in big], forced=mechanism == "cow")
        if cow is not None:
            sources = {vid: cow.source(i) for i, vid in enumerate(big)}
            releases.append(cow.release)
            used = "cow"
        elif mechanism == "cow":
            log.info("copy-on-write snapshot unavailable: copying instead")
    to_copy = [vid for vid, p in variables.items() if p.state is None and vid not in sources]
    buffers = pool.take([variables[vid].array.nbytes for vid in to_copy]) if to_copy else []
    if buffers is None:
        while releases:
            releases.pop()()
        log.info("asynchronous checkpoint: %d bytes to copy exceed async_buffer_mb; writing it before returning",
                 sum(variables[vid].array.nbytes for vid in to_copy))
        return None
    if buffers:
        releases.append(lambda: pool.give_back(buffers))
    copied = 0
    for vid, buf in zip(to_copy, buffers, strict=True):
        frozen[vid] = _frozen_var(variables[vid], _copy_into(buf, variables[vid].array))
        copied += variables[vid].array.nbytes
    return Snapshot(frozen, sources, used, copied, list(releases))


def _try_cow(arrays: list[np.ndarray], forced: bool) -> Any:
    """A copy-on-write snapshot of ``arrays``, or None where the kernel or the memory does not allow it."""
    try:
        return cow.CowSnapshot(arrays)
    except cow.CowUnavailable as exc:
        (log.info if forced else log.debug)("copy-on-write snapshot unavailable: %s", exc)
        return None
