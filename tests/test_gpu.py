"""GPU arrays (CuPy): protected, checkpointed and recovered as host arrays are, on the device they live on.

Needs CuPy and a CUDA device: skipped otherwise (CI has none; these run on a GPU machine). Every check is bit
for bit against the device array's own bytes (``.get()``): every dtype CuPy has, C and F order, strided views,
0-d and empty arrays; levels 1-4 over four ranks sharing the device; differential checkpoints that write only
the changed blocks; asynchronous checkpoints whose arrays are overwritten at once, by each snapshot mechanism;
incremental checkpoints; a damaged file that leaves the device array untouched; a device checkpoint recovered
into host arrays and a host checkpoint into device arrays (the same bytes in the file).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi
from mpi_util import run as mpi_run

import ftidask
from ftidask.api.context import Context
from ftidask.engine import device, devicehash
from ftidask.engine.device import DeviceHolder
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.model.errors import NoCheckpointError

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the GPU tests run on a machine with a GPU)")
try:
    _DEVICES = cupy.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001 - CuPy installed, no driver or no device
    _DEVICES = 0
pytestmark = pytest.mark.skipif(_DEVICES == 0, reason="no CUDA device")

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]


def _kw(root: Path, **extra) -> dict:
    kw = dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=3)
    kw.update(extra)
    return kw


def _values(shape: tuple, dtype: str, seed: int, order: str = "C"):
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize,
                                               dtype=np.uint8)
    host = raw.view(dtype).reshape(shape) if shape else raw.view(dtype).reshape(())
    if dtype == "bool":
        host = raw.reshape(shape) % 2 == 1 if shape else np.bool_(raw[0] % 2)
    return cupy.asarray(np.asarray(host, order=order), order=order)


def _device_copies(monkeypatch, on_device: bool = True) -> list[bool]:
    """Whether each snapshot was a device copy (appended at each call): the device-copy tests must see one, for
    ``device_copy`` falls back to the host on any failure, and the values would be right either way. With
    ``on_device`` false, the test seam refuses every device copy (the host path)."""
    made: list[bool] = []
    real = DeviceHolder.device_copy

    def spy(self):
        copy = real(self) if on_device else None
        made.append(copy is not None)
        return copy

    monkeypatch.setattr(DeviceHolder, "device_copy", spy)
    return made


def _same(device, host) -> bool:
    got = device.get()
    return got.dtype == host.dtype and got.shape == host.shape and got.tobytes() == np.asarray(host).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, order", [((), "C"), ((0,), "C"), ((7,), "C"), ((33, 65), "C"), ((33, 65), "F"),
                                          ((3, 4, 5), "F")])
def test_round_trip_bit_for_bit(tmp_path, dtype, shape, order):
    a = _values(shape, dtype, 1, order)
    want = a.get()
    with ftidask.init(**_kw(tmp_path)) as ctx:
        ctx.protect(1, a)
        assert ctx.protected[1] is a  # the device array itself, not its host copy
        ctx.checkpoint(1, 1)
        a[...] = _values(shape, dtype, 2, order)  # changed on the device after the checkpoint
        out = ctx.recover()
        assert out[1] is a and _same(a, want)
        assert a.flags.f_contiguous == (order == "F" or a.ndim < 2)


def test_a_strided_view_is_recovered_in_place(tmp_path):
    base = _values((64, 40), "float64", 3)
    view = base[::2, 1::3]  # neither C nor F contiguous
    want, untouched = view.get(), base[1::2].get()
    with ftidask.init(**_kw(tmp_path)) as ctx:
        ctx.protect(1, view)
        ctx.checkpoint(1, 1)
        base[...] = 0
        ctx.recover()
    assert _same(view, want) and not base[1::2].any()  # only the view's elements were written
    assert untouched.view(np.uint8).any()  # random bytes, read as bytes (as float64, some are NaN)


def test_a_new_process_recovers_on_the_device_and_on_the_host(tmp_path):
    """A restart protects new arrays (a device one, then a host one): both get the device array's bytes."""
    a = _values((1000, 3), "float32", 4)
    want = a.get()
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx._closed = True  # a crash: the run stays for the restart
    for target in (cupy.zeros((1000, 3), "float32"), np.zeros((1000, 3), "float32")):
        restart = ftidask.init(**_kw(tmp_path))
        assert restart.status() == 1
        restart.protect(1, target)
        restart.recover()
        got = target.get() if hasattr(target, "get") else target
        assert got.tobytes() == want.tobytes()
        restart._closed = True


def test_a_host_checkpoint_recovers_into_a_device_array(tmp_path):
    host = np.random.default_rng(5).random((300, 7))
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, host)
    ctx.checkpoint(1, 4)
    ctx._closed = True
    restart = ftidask.init(**_kw(tmp_path))
    a = cupy.zeros((300, 7))
    restart.protect(1, a)
    restart.recover()
    assert _same(a, host)
    restart.finalize()


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_every_level_over_four_ranks_sharing_the_device(tmp_path, level):
    cfg = load_config(None, **_kw(tmp_path, local_test=1, node_size=1, group_size=4))

    def write(t):
        ctx = Context(cfg, t)
        a = _values((2000 + 100 * t.rank,), "float64", t.rank)
        ctx.protect(1, a)
        ctx.checkpoint(1, level)
        return a.get()

    wanted, errors = run_ranks(cfg, 4, write, wait=120)
    assert errors == []
    lost = next(tmp_path.glob("l/**/Ckpt1-Rank1.fti"), None)
    if level in (2, 3):  # a rank's file lost: its partner copy or the group's parity brings it back
        lost.unlink()

    def restart(t):
        ctx = Context(cfg, t)
        a = cupy.full((2000 + 100 * t.rank,), 7.0)
        ctx.protect(1, a)
        ctx.recover()
        return a.get().tobytes() == wanted[t.rank].tobytes()

    results, errors = run_ranks(cfg, 4, restart, wait=120)
    assert errors == [] and results == [True] * 4


def test_a_differential_checkpoint_writes_only_the_blocks_that_changed(tmp_path):
    with ftidask.init(**_kw(tmp_path, enable_dcp=1, dcp_block_size=4096)) as ctx:
        a = _values((1 << 22,), "uint8", 6)  # 1024 blocks of 4 KiB
        ctx.protect(1, a)
        ctx.checkpoint(1, 5)
        ctx.checkpoint(2, 5)  # checkpoint 1's file becomes the spare
        same = ctx.checkpoint(3, 5)
        assert same.blocks_changed == 0 and same.bytes_written == 0
        a[5000:5000 + 10] += 1  # block 1
        a[-1] += 1  # the last block
        before = device.stats["d2h_bytes"]
        two = ctx.checkpoint(4, 5)
        assert two.blocks_changed == 2 and two.bytes_written == 2 * 4096
        # the device's digests found the two blocks: only they crossed the bus
        assert device.stats["d2h_bytes"] - before == 2 * devicehash.BLOCK
        want = a.get()
        a[...] = 0
        ctx.recover()
        assert _same(a, want)


def test_a_differential_checkpoint_after_one_percent_changed_moves_one_percent_over_the_bus(tmp_path):
    blocks = 4096  # 64 MiB of float32
    with ftidask.init(**_kw(tmp_path, enable_dcp=1)) as ctx:
        a = cupy.random.default_rng(3).random((blocks * devicehash.BLOCK // 4,), dtype=cupy.float32)
        ctx.protect(1, a)
        ctx.checkpoint(1, 5)  # every byte: no digests yet
        picked = np.random.default_rng(4).choice(blocks, blocks // 100, replace=False)
        for b in picked.tolist():
            a[b * devicehash.BLOCK // 4 + 17] += 1
        before = device.stats["d2h_bytes"]
        ctx.checkpoint(2, 5)
        moved = device.stats["d2h_bytes"] - before
        assert moved == len(picked) * devicehash.BLOCK  # 1% of 64 MiB
        want = a.get()
        a[...] = 0
        ctx.recover()
        assert _same(a, want)


def test_a_failed_upload_between_differential_checkpoints_leaves_nothing_stale(tmp_path, monkeypatch):
    """A recovery fills the mirror, then its upload fails (the test seam: a device error): the mirror and the device
    now differ, and the digests of the last download describe neither. The next differential checkpoint must still
    hold what is on the device: it brings every byte over again."""
    with ftidask.init(**_kw(tmp_path, enable_dcp=1)) as ctx:
        a = _values((1 << 20,), "float32", 11)
        ctx.protect(1, a)
        ctx.checkpoint(1, 5)
        a += 1
        ctx.checkpoint(2, 5)  # the digests: of these values, on the device still after the failed recovery below

        def broken(self):
            raise RuntimeError("cudaErrorLaunchFailure (the test's)")

        with monkeypatch.context() as patch:
            patch.setattr(DeviceHolder, "upload", broken)
            with pytest.raises(ftidask.FTIError, match="putting it back on cuda"):
                ctx.recover(ckpt_id=1)  # the mirror: checkpoint 1's values; the device: checkpoint 2's
        a[12345] = -7
        want = a.get()
        ctx.checkpoint(3, 5)
        a[...] = 0
        ctx.recover()
        assert _same(a, want)


def test_a_misaligned_device_array_is_downloaded_whole(tmp_path):
    """A view that starts off an 8-byte boundary cannot be read as 8-byte words on the device: no digests, every
    byte crosses the bus, the checkpoint is right."""
    with ftidask.init(**_kw(tmp_path, enable_dcp=1)) as ctx:
        base = _values(((1 << 20) + 3,), "uint8", 12)
        a = base[3:]
        ctx.protect(1, a)
        ctx.checkpoint(1, 5)
        a[100] += 1
        before = device.stats["d2h_bytes"]
        ctx.checkpoint(2, 5)
        assert device.stats["d2h_bytes"] - before == a.nbytes
        want = a.get()
        a[...] = 0
        ctx.recover()
        assert _same(a, want)


@pytest.mark.parametrize("on_device", [True, False], ids=["device-copy", "host-copy"])
@pytest.mark.parametrize("mechanism", ["cow", "copy"])
def test_an_async_checkpoint_holds_the_values_of_the_call(tmp_path, monkeypatch, mechanism, on_device):
    """The snapshot of a device array is a copy in device memory where it fits, else its bytes brought to the
    host at the call (the test seam refuses the device copy); either way the checkpoint holds the call's values."""
    made = _device_copies(monkeypatch, on_device)
    with ftidask.init(**_kw(tmp_path, async_snapshot=mechanism)) as ctx:
        a = _values((1 << 21,), "float32", 7)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        want = a.get()
        handle = ctx.checkpoint(2, 1, wait=False)
        a[...] = -1  # at once, on the device
        handle.result()
        ctx.recover()
        assert _same(a, want)
        a[...] = -1
        ctx.checkpoint(3, 1, wait=False)  # the mirror's pages written while nothing holds them any more
        a[...] = 5
        ctx.wait()
        ctx.recover()
        assert (a.get() == -1).all()
    assert made == [on_device] * 2, made  # the path named: a device copy at each asynchronous call, or none


@pytest.mark.parametrize("on_device", [True, False], ids=["device-copy", "host-copy"])
@pytest.mark.parametrize("why", ["staging-pool-too-small", "mechanism-blocking"])
def test_an_async_checkpoint_written_before_returning_copies_from_the_device_once(tmp_path, monkeypatch, why,
                                                                                    on_device):
    """When an asynchronous checkpoint must be written before the call returns (its staging buffers cannot be had,
    or the snapshot mechanism says so), the bytes taken at the call are those written: the array crosses the bus
    once (from a device copy or straight into the mirror), not a second time for the write."""
    made = _device_copies(monkeypatch, on_device)
    extra = dict(async_snapshot="copy", async_buffer_mb=1) if why == "staging-pool-too-small" else \
        dict(async_snapshot="blocking")
    with ftidask.init(**_kw(tmp_path, **extra)) as ctx:
        host = np.zeros(1 << 20, np.float32)  # 4 MiB to copy into 1 MiB of staging buffers
        a = _values((1 << 21,), "float32", 8)
        ctx.protect(1, a)
        ctx.protect(2, host)
        before = device.stats["d2h_bytes"]
        handle = ctx.checkpoint(1, 1, wait=False)
        assert handle.mechanism == "blocking" and handle.done()
        assert device.stats["d2h_bytes"] - before == a.nbytes
        # a device copy is tried only where the snapshot would have been taken (not with mechanism "blocking")
        assert made == ([on_device] if why == "staging-pool-too-small" else []), made
        want = a.get()
        a[...] = 0
        ctx.recover()
        assert _same(a, want)


def test_async_checkpoints_in_a_loop_each_hold_their_call(tmp_path, monkeypatch):
    """Checkpoints in flight one after the other (two at most), the array changed after every call: each one's
    file holds its own call's values (a device copy is written into the host copy by its own job, in turn)."""
    made = _device_copies(monkeypatch)
    with ftidask.init(**_kw(tmp_path, max_inflight=2)) as ctx:
        a = _values((1 << 20,), "float64", 13)
        ctx.protect(1, a)
        handles = []
        for i in range(1, 6):
            a[...] = i
            handles.append(ctx.checkpoint(i, 1, wait=False))
        a[...] = 0
        assert [h.result().id for h in handles] == [1, 2, 3, 4, 5]
        ctx.recover()
        assert ctx.recovered_from[0] == 5 and (a.get() == 5).all()
    assert made == [True] * 5, made


@pytest.mark.parametrize("level", [1, 5])
def test_a_block_set_back_after_an_async_device_copy_is_written_by_the_next_differential_download(tmp_path, level,
                                                                                                  monkeypatch):
    """An asynchronous checkpoint's device copy fills the host copy with its call's bytes: a block set back, after
    it, to its value at the last differential download must still be brought over (its device digest equals the
    old one; the host copy holds the async call's bytes). Seen wrong: checkpoint 3 held checkpoint 2's block."""
    made = _device_copies(monkeypatch)
    with ftidask.init(**_kw(tmp_path, enable_dcp=1)) as ctx:
        v1 = _values((1 << 18,), "int32", 21)
        a = v1.copy()
        ctx.protect(1, a)
        ctx.checkpoint(1, 5)  # a differential download: the device digests of v1 kept
        a += 1
        handle = ctx.checkpoint(2, 1, wait=False)
        assert handle.result().id == 2 and made == [True], made  # the path this test is about
        a[:4096] = v1[:4096]  # one block back to its value at checkpoint 1
        want = a.get()
        ctx.checkpoint(3, level)
        a[...] = 0
        ctx.recover()
        assert ctx.recovered_from[0] == 3 and _same(a, want)


def test_a_large_strided_view_is_checkpointed_with_the_values_of_the_call(tmp_path):
    """A strided view is made contiguous on the device, then brought over on a copy stream of its own: the copy
    must wait for the contiguous copy (1 GiB: long enough for an unordered read to be seen)."""
    base = cupy.arange(1 << 28, dtype=cupy.float64)  # 2 GiB
    view = base[::2]
    with ftidask.init(**_kw(tmp_path)) as ctx:
        ctx.protect(1, view)
        want = view.get()
        ctx.checkpoint(1, 1)
        view[...] = -1
        ctx.recover()
        assert _same(view, want)


def test_an_empty_device_array_does_not_make_async_checkpoints_wait(tmp_path, monkeypatch):
    """An empty CuPy array has no bytes for a job in flight to write: it makes no asynchronous call wait for the
    checkpoints in flight (it did: the device copies were counted against every device array)."""
    with ftidask.init(**_kw(tmp_path, max_inflight=2)) as ctx:
        ctx.protect(1, _values((1 << 20,), "float64", 3))
        ctx.protect(2, cupy.empty(0, cupy.float32))
        drains = []
        real = ctx._async.drain
        monkeypatch.setattr(ctx._async, "drain", lambda *a, **k: (drains.append(1), real(*a, **k))[1])
        for i in range(1, 5):
            ctx.checkpoint(i, 1, wait=False)
        ctx.wait()
        assert drains == []


def test_an_incremental_checkpoint_writes_each_value_of_its_call(tmp_path):
    with ftidask.init(**_kw(tmp_path)) as ctx:
        a, b = _values((5000,), "int32", 8), _values((3000,), "int64", 9)
        ctx.protect(1, a)
        ctx.protect(2, b)
        ctx.init_icp(1, 1)
        a[...] = 1
        ctx.add_var_icp(1)
        b[...] = 2
        ctx.add_var_icp(2)
        a[...] = 3  # after its add: not in the checkpoint
        ctx.finalize_icp()
        ctx.recover()
        assert (a.get() == 1).all() and (b.get() == 2).all()


def test_a_damaged_file_leaves_the_device_array_untouched(tmp_path):
    with ftidask.init(**_kw(tmp_path)) as ctx:
        a = _values((100000,), "float64", 10)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        path = next(tmp_path.glob("l/**/Ckpt1-Rank0.fti"))
        with open(path, "r+b") as fh:
            fh.seek(1000)
            byte = fh.read(1)
            fh.seek(1000)
            fh.write(bytes([byte[0] ^ 0xFF]))
        a[...] = 3.5
        with pytest.raises(NoCheckpointError):
            ctx.recover()
        assert (a.get() == 3.5).all()


def test_realloc_gives_a_device_array_of_the_stored_size(tmp_path):
    a = _values((1000, 4), "int16", 14, "F")
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    ctx._closed = True
    restart = ftidask.init(**_kw(tmp_path))
    restart.protect(1, cupy.zeros(10, "int16"))  # a restart that does not know the size yet
    b = restart.realloc(1)
    assert type(b) is type(a) and b.shape == (1000, 4) and b.dtype == a.dtype and b.flags.f_contiguous
    assert restart.protected[1] is b
    restart.recover()
    assert _same(b, a.get())
    restart.finalize()


def test_realloc_of_a_dtype_cupy_has_no_arrays_of_is_a_clear_error(tmp_path):
    """A checkpoint of strings realloc'ed into a CuPy variable: CuPy's own ValueError came out raw."""
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.array(["ab", "cd"], dtype="U4"))
    ctx.checkpoint(1, 1)
    ctx._closed = True
    restart = ftidask.init(**_kw(tmp_path))
    a = cupy.zeros(3)
    restart.protect(1, a)
    with pytest.raises(ftidask.RecoveryError, match="which a CuPy array cannot hold"):
        restart.realloc(1)
    assert restart.protected[1] is a
    restart.finalize()


def test_protect_again_with_a_new_shape(tmp_path):
    with ftidask.init(**_kw(tmp_path)) as ctx:
        a = _values((100,), "float64", 11)
        ctx.protect(1, a)
        ctx.checkpoint(1, 1)
        b = _values((250,), "float64", 12)  # realloc: a bigger array under the same id
        ctx.protect(1, b)
        ctx.checkpoint(2, 1)
        want = b.get()
        b[...] = 0
        ctx.recover()
        assert _same(b, want) and ctx.stored_size(1) == 250 * 8


_MPI = need_mpi()


@_MPI[0]
@_MPI[1]
@pytest.mark.parametrize("level", [2, 3])
def test_mpi_ranks_sharing_the_device_lose_a_file_and_recover(tmp_path, level):
    mpi_run(4, "gpu_job.py", str(tmp_path), "write", str(level), timeout=180)
    next(tmp_path.glob("l/**/Ckpt1-Rank2.fti")).unlink()  # one rank's node lost
    out = mpi_run(4, "gpu_job.py", str(tmp_path), "recover", str(level), timeout=180).stdout
    assert "exact [True, True, True, True]" in out.splitlines()
