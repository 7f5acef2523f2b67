"""GPU arrays (CuPy): protected through a host mirror that every level, format and mechanism already serves.

A CuPy array's variable keeps a host array of the same shape, dtype and memory order (the *mirror*, plain
pageable NumPy memory): at each checkpoint call its bytes are brought over from the device, and the
checkpoint is written from the mirror exactly as from a host array, so that levels 1-8, compression,
asynchronous snapshots, Zarr L4, resharding and the files are those of host arrays (a container holds the
same bytes; the variable table records the device, ``extra["device"]``). A recovery fills the mirror,
verified as always, then uploads it into the CuPy array.

The copy runs in pieces through two pinned host buffers (:data:`PIECE` each): the device copies piece k+1
into one while the CPU moves piece k from the other into the mirror. The CPU writes the mirror (never the
GPU's DMA engine): page tracking (differential checkpoints) and copy-on-write snapshots (an asynchronous
checkpoint still writing the previous values) see every write, as they see the application's. With
differential checkpoints enabled only the pages whose bytes changed are written into the mirror, so that a
dCP checkpoint writes only the blocks that changed on the device; and the device hashes the array's blocks
(:mod:`.devicehash`), so that from the second download on only the blocks whose digests changed cross the bus.

Nothing here imports CuPy before a CuPy array is protected; only this module imports it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..model.errors import ProtectError, RecoveryError
from . import devicehash

PIECE = 64 << 20  # bytes per device-host copy through a pinned buffer
EXTRA_KEY = "device"  # the variable table's record of a device array: "cuda:<id>"
_PAGE = 4096
_bounce: dict[int, list[tuple[Any, np.ndarray]]] = {}  # per device: two pinned buffers (memory, bytes view)
_lock = threading.Lock()
MOVERS = min(4, os.cpu_count() or 1)  # threads moving a piece from the pinned buffer into the mirror
_movers: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
#: bytes brought from a device to the host (the tests and benchmarks read it: a dCP checkpoint's bus traffic)
stats = {"d2h_bytes": 0}


def _forget_after_fork() -> None:
    """A forked child has neither the parent's threads nor its CUDA context: the pool and the buffers go."""
    global _movers, _lock, _pool_lock
    _movers = None
    _bounce.clear()
    _lock, _pool_lock = threading.Lock(), threading.Lock()  # a parent's thread may have held them at the fork


os.register_at_fork(after_in_child=_forget_after_fork)


def is_device_array(obj: Any) -> bool:
    """Whether ``obj`` is a CuPy array (told by its type's module: CuPy is not imported to ask)."""
    return type(obj).__module__.split(".")[0] == "cupy" and hasattr(obj, "__cuda_array_interface__")


def holders(variables: Any) -> dict[int, DeviceHolder]:
    """The device holders of ``variables`` (id -> Protected) that hold a CuPy array, by id."""
    return {vid: p.device for vid, p in variables.items() if isinstance(p.device, DeviceHolder)}


def _bounce_buffers(cupy: Any, device_id: int) -> list[tuple[Any, np.ndarray]]:
    with _lock:
        if device_id not in _bounce:
            bufs = []
            for _ in range(2):
                mem = cupy.cuda.alloc_pinned_memory(PIECE)
                bufs.append((mem, np.frombuffer(mem, np.uint8, PIECE)))
            _bounce[device_id] = bufs
        return _bounce[device_id]


class DeviceHolder:
    """A protected CuPy array and its host mirror (what the engine checkpoints and recovery fills)."""

    hashes = True  # whether a differential download digests the array's blocks on the device

    def __init__(self, array: Any, old: DeviceHolder | None = None) -> None:
        import cupy  # noqa: PLC0415 - only once a CuPy array is protected

        self.cupy, self.obj = cupy, array
        self.device_id = int(array.device.id)
        if array.dtype.hasobject or array.dtype.byteorder not in "=|":
            raise ProtectError(f"a CuPy array of dtype {array.dtype} cannot be protected")
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        if (old is not None and old.mirror.shape == array.shape and old.mirror.dtype == array.dtype
                and (old.mirror.flags.f_contiguous if order == "F" else old.mirror.flags.c_contiguous)):
            self.mirror = old.mirror  # protect again (same shape): the mirror and its pages stay
        else:
            self.mirror = np.zeros(array.shape, array.dtype, order=order)  # zeros: unfaulted, calloc'd
        self.order = order
        self._digests: Any = None  # the device digests of the blocks the mirror holds, when known (dCP only)

    def __str__(self) -> str:  # the variable table's record, and what a frozen copy keeps
        return f"cuda:{self.device_id}"

    def _mirror_bytes(self) -> np.ndarray:
        """The mirror's bytes, flat, in its memory order."""
        return self.mirror.reshape(-1, order="A").view(np.uint8)

    def _flat_device(self, contiguous: bool) -> Any:
        """The array's bytes in the mirror's order, on the device (a contiguous copy if it is strided)."""
        a = self.obj
        if self.order == "F":
            a = a.T  # C-contiguous view of an F-contiguous array
        if not a.flags.c_contiguous:
            if not contiguous:
                return None
            a = self.cupy.ascontiguousarray(a)
        return a.reshape(-1).view(self.cupy.uint8)

    def download(self, compare: bool = False) -> None:
        """Bring the device array's bytes into the mirror; ``compare`` (a differential checkpoint): write only the
        pages that changed, and bring over the bus only the blocks whose device digests changed since the last
        download (all of them the first time, or where the digests cannot be computed)."""
        dst, cupy = self._mirror_bytes(), self.cupy
        if not len(dst):
            return
        old, self._digests = self._digests, None  # none until the mirror holds the bytes they describe
        with cupy.cuda.Device(self.device_id):
            # The values of the call: every stream's work on the device done (the copies run on a stream of their
            # own, which would not wait for the application's)
            cupy.cuda.Device(self.device_id).synchronize()
            src = self._flat_device(contiguous=True)
            if src.data.ptr != self.obj.data.ptr:  # a strided array's contiguous copy, made on the current stream:
                cupy.cuda.Device(self.device_id).synchronize()  # done before the copy stream (non-blocking) reads it
            new = self._block_digests(src) if compare else None
            if new is not None and old is not None and old.shape == new.shape:
                self._download_blocks(src, dst, devicehash.changed(cupy, new, old))
            else:
                self._download_all(src, dst, compare)
            self._digests = new

    def _block_digests(self, src: Any) -> Any:
        """The device digests of ``src``'s blocks; None where they cannot be had (a misaligned or small array, a
        device out of memory for the hash's temporaries: the whole array crosses the bus then)."""
        if not self.hashes or not devicehash.usable(src):
            return None
        try:
            return devicehash.digests(self.cupy, src)
        except Exception:  # noqa: BLE001 - out of device memory (CuPy's error), or any CUDA error: no digests
            return None

    def _download_all(self, src: Any, dst: np.ndarray, compare: bool) -> None:
        """Every byte of ``src`` into ``dst`` through the pinned buffers, the next piece copied while one is moved."""
        cupy, nbytes = self.cupy, len(dst)
        rt = cupy.cuda.runtime
        bufs = _bounce_buffers(cupy, self.device_id)
        stream = cupy.cuda.Stream(non_blocking=True)
        events = [cupy.cuda.Event(), cupy.cuda.Event()]
        cuts = list(range(0, nbytes, PIECE))

        def start(k: int) -> None:
            lo = cuts[k]
            n = min(PIECE, nbytes - lo)
            mem, _view = bufs[k % 2]
            rt.memcpyAsync(mem.ptr, src.data.ptr + lo, n, rt.memcpyDeviceToHost, stream.ptr)
            events[k % 2].record(stream)

        with _lock:  # the pinned buffers are the device's, shared by the process's contexts
            try:
                start(0)
                for k, lo in enumerate(cuts):
                    if k + 1 < len(cuts):
                        start(k + 1)  # in the other buffer, while this one is moved into the mirror
                    events[k % 2].synchronize()
                    n = min(PIECE, nbytes - lo)
                    _move_parallel(bufs[k % 2][1][:n], dst[lo:lo + n], compare)
                    stats["d2h_bytes"] += n
            finally:  # left early (an error, Ctrl-C): no copy may still fill a buffer the next download reuses
                stream.synchronize()

    def _download_blocks(self, src: Any, dst: np.ndarray, idx: np.ndarray) -> None:
        """The blocks ``idx`` (ascending) of ``src`` into ``dst``: gathered on the device, brought over in pieces of
        the pinned buffer, and only their pages that differ written into the mirror."""
        cupy, block = self.cupy, devicehash.BLOCK
        whole = len(dst) // block
        bufs = _bounce_buffers(cupy, self.device_id)
        full = idx[idx < whole]
        rows_src = src[:whole * block].reshape(whole, block)
        pages = dst[:whole * block].reshape(-1, _PAGE)
        per = PIECE // block
        with _lock:
            view = bufs[0][1]
            for lo in range(0, len(full), per):
                some = full[lo:lo + per]
                picked = rows_src[cupy.asarray(some)]  # a contiguous copy of those rows, on the device
                host = view[:len(some) * block].reshape(len(some), block)
                picked.get(out=host)  # ordered after the gather on CuPy's current stream, and waited for
                _move_pages(host, pages, some * (block // _PAGE))
                stats["d2h_bytes"] += host.nbytes
            if len(full) < len(idx):  # the last block, shorter than the others
                rest = src[whole * block:]
                host = view[:len(rest)]
                rest.get(out=host)
                _move(host, dst[whole * block:], compare=True)
                stats["d2h_bytes"] += len(rest)

    def mirror_written(self) -> None:
        """The mirror is being filled from elsewhere (a recovery): the device digests no longer describe it."""
        self._digests = None

    def device_copy(self) -> DeviceCopy | None:
        """A copy of the array's bytes in device memory now (an asynchronous checkpoint's snapshot: the
        application waits for a device-to-device copy only); None where it would take more than half of the
        device's free memory, or fails: the caller brings the bytes to the host instead."""
        nbytes = self.mirror.nbytes
        if nbytes == 0:
            return None
        cupy = self.cupy
        try:
            with cupy.cuda.Device(self.device_id):
                free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
                if nbytes > free // 2:  # the application's next step must still find its memory
                    return None
                cupy.cuda.Device(self.device_id).synchronize()  # the values of the call (see download)
                flat = self._flat_device(contiguous=True)
                contiguous = flat.data.ptr == self.obj.data.ptr or self.obj.flags.c_contiguous or \
                    self.obj.flags.f_contiguous
                copy = flat.copy() if contiguous else flat  # a strided array's flat bytes already are a copy
                cupy.cuda.Device(self.device_id).synchronize()
        except Exception:  # noqa: BLE001 - out of device memory, or any CUDA error: the host path instead
            return None
        # The copy's job fills the mirror with this call's bytes: the digests of the last download no longer describe
        # it (kept, a block set back to its value at that download would compare unchanged and keep this call's bytes)
        self._digests = None
        return DeviceCopy(self, copy)

    def upload(self) -> None:
        """Put the mirror's bytes (just recovered, verified) into the device array."""
        src, cupy = self._mirror_bytes(), self.cupy
        self._digests = None  # the device's bytes change: the next differential download starts afresh
        if not len(src):
            return
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.Device(self.device_id).synchronize()  # no kernel of any stream still writes the array
            flat = self._flat_device(contiguous=False)
            target = flat if flat is not None else cupy.empty(len(src), cupy.uint8)
            rt = cupy.cuda.runtime
            rt.memcpy(target.data.ptr, src.ctypes.data, len(src), rt.memcpyHostToDevice)
            if flat is None:  # a strided array: through a contiguous copy in the mirror's order
                # cudaMemcpy from pageable memory may return before its DMA ends; the scatter below runs on the
                # current stream, which may not wait for the legacy stream (a non-blocking one)
                cupy.cuda.Device(self.device_id).synchronize()
                shaped = target.view(self.obj.dtype).reshape(self.mirror.shape[::-1] if self.order == "F"
                                                             else self.mirror.shape)
                self.obj[...] = shaped.T if self.order == "F" else shaped
            cupy.cuda.Device(self.device_id).synchronize()


class DeviceCopy(DeviceHolder):
    """A protected CuPy array's bytes copied in device memory at an asynchronous checkpoint's call: its background
    job brings them into the variable's mirror (:meth:`download`, once) and writes the mirror; the device memory
    goes back to CuPy's pool then."""

    def __init__(self, holder: DeviceHolder, flat: Any) -> None:  # noqa: D107 - no DeviceHolder.__init__
        self.cupy, self.obj, self.device_id = holder.cupy, flat, holder.device_id
        self.mirror, self.order = holder.mirror, "C"  # flat: the bytes in the mirror's order already
        self._digests = None

    hashes = False  # a copy is brought over once: its digests would serve no later download

    def download(self, compare: bool = False) -> None:
        """As :meth:`DeviceHolder.download`, once; the device copy then goes back to CuPy's pool (also on failure)."""
        try:
            super().download(compare)
        finally:
            self.obj = None


def _move_parallel(src: np.ndarray, dst: np.ndarray, compare: bool) -> None:
    """:func:`_move` in page-aligned slices on a few threads (NumPy releases the GIL): one core's copy would be
    what an asynchronous checkpoint of a device array blocks for, several times the bus's copy."""
    step = -(-len(src) // (MOVERS * _PAGE)) * _PAGE  # a slice per thread, whole pages
    if MOVERS < 2 or len(src) < 2 * _PAGE * MOVERS:
        _move(src, dst, compare)
        return
    global _movers
    with _pool_lock:
        if _movers is None:
            _movers = ThreadPoolExecutor(MOVERS, thread_name_prefix="ftidask-device")
    list(_movers.map(lambda lo: _move(src[lo:lo + step], dst[lo:lo + step], compare), range(0, len(src), step)))


def _move_pages(src: np.ndarray, pages: np.ndarray, first: np.ndarray) -> None:
    """Write rows ``src`` (each a whole number of pages) at pages ``first[i]`` onward of ``pages`` (the mirror's
    bytes as rows of a page): only the pages that differ."""
    per = src.shape[1] // _PAGE
    new = src.reshape(-1, _PAGE)
    at = (first[:, None] + np.arange(per)).reshape(-1)
    differ = np.flatnonzero((new.view(np.uint64) != pages[at].view(np.uint64)).any(axis=1))
    if len(differ):
        pages[at[differ]] = new[differ]


def _move(src: np.ndarray, dst: np.ndarray, compare: bool) -> None:
    """Copy ``src`` into ``dst`` (bytes of equal length); ``compare``: only the pages that differ are written."""
    if not compare:
        np.copyto(dst, src)
        return
    whole = len(src) // _PAGE * _PAGE
    if whole:
        a, b = src[:whole].reshape(-1, _PAGE), dst[:whole].reshape(-1, _PAGE)
        try:  # eight bytes at a time where both are aligned to them
            changed = np.flatnonzero((a.view(np.uint64) != b.view(np.uint64)).any(axis=1))
        except ValueError:
            changed = np.flatnonzero((a != b).any(axis=1))
        if len(changed):
            b[changed] = a[changed]  # only those rows (pages) of the mirror are written
    if whole < len(src) and not np.array_equal(src[whole:], dst[whole:]):
        np.copyto(dst[whole:], src[whole:])


def holder_of(array: Any, old: Any = None) -> DeviceHolder | None:
    """A :class:`DeviceHolder` for a CuPy array (``old``: the variable's previous one), else None."""
    if not is_device_array(array):
        return None
    return DeviceHolder(array, old if isinstance(old, DeviceHolder) else None)


def host_chunk(chunk: Any) -> np.ndarray:
    """A Dask chunk's values on the host: a CuPy chunk copied from its device (on the worker that holds it), any
    other chunk as a NumPy array."""
    if not is_device_array(chunk):
        return np.asarray(chunk)
    import cupy  # noqa: PLC0415 - only for a chunk that lives on a device

    with cupy.cuda.Device(chunk.device.id):  # .get() waits for the current stream only: the kernels that made the
        cupy.cuda.Device(chunk.device.id).synchronize()  # chunk may run on another (a per-thread default stream)
        return chunk.get()


def device_chunk(chunk: np.ndarray) -> Any:
    """A chunk read from a checkpoint (verified) put on the worker's current device: a CuPy array."""
    import cupy  # noqa: PLC0415 - only for a variable that lives on a device

    return cupy.asarray(chunk)


def device_meta(ndim: int, dtype: Any) -> Any:
    """The ``meta`` of a Dask array of CuPy chunks: an empty CuPy array of ``ndim`` dimensions and ``dtype``."""
    import cupy  # noqa: PLC0415 - only for a variable that lives on a device

    return cupy.empty((0,) * ndim, dtype=dtype)


def chunks_on_device(held: Any, default: bool) -> bool:
    """Whether a recovered Dask variable's chunks go on the workers' devices: as those of the Dask array protected
    now (``held``) are, else (none) ``default`` (as those of the array checkpointed were)."""
    meta = getattr(held, "_meta", None)
    return is_device_array(meta) if meta is not None else default


def onto_devices(arr: Any) -> Any:
    """A Dask array of NumPy chunks as one of CuPy chunks, each put on the device of the worker that holds it."""
    return arr.map_blocks(device_chunk, dtype=arr.dtype, meta=device_meta(arr.ndim, arr.dtype))


def realloc_target(new: np.ndarray, array: Any, old: Any) -> Any:
    """:meth:`ftidask.Context.realloc`'s array: ``new`` (a host array of the stored size) on the device when
    ``array`` is a CuPy array (itself where it already fits) or the variable (``old``: its device holder) lives on
    one, in the device memory of the same device; else ``new`` itself."""
    like = array if is_device_array(array) else old.obj if isinstance(old, DeviceHolder) else None
    if like is None:
        return new
    if is_device_array(array) and array.dtype == new.dtype and array.shape == new.shape:
        return array
    import cupy  # noqa: PLC0415 - only once a CuPy array is protected

    with cupy.cuda.Device(int(like.device.id)):
        try:
            return cupy.empty(new.shape, new.dtype, order="F" if new.flags.f_contiguous and not new.flags.c_contiguous
                              else "C")
        except (TypeError, ValueError) as exc:  # a dtype CuPy has no arrays of (str, datetime64, structured)
            raise RecoveryError(f"the checkpoint holds {new.dtype}, which a CuPy array cannot hold ({exc}); "
                                "realloc into a NumPy array") from None
