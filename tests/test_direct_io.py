"""Rank files written around the page cache (O_DIRECT, ftidask.storage.direct): the same bytes as through the
cache, on every layout; the data really not cached; a refusal of the file system or a failure handled."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.engine.checkpointing import write_rank_file
from ftidask.ftiff import reader, writer
from ftidask.ftiff.layout import plan_layout
from ftidask.ftiff.structs import FB_SIZE
from ftidask.ftiff.writer import write_ftiff
from ftidask.model.arrays import ArrayBytes
from ftidask.storage import direct

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this system")


def _arrays(sizes: list[int], seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {vid: rng.integers(0, 256, n, np.uint8) for vid, n in enumerate(sizes, start=1)}


def _write(path: Path, arrays: dict[int, np.ndarray], layout, direct_io: bool, sources=None):
    sources = sources or {v: ArrayBytes(a) for v, a in arrays.items()}
    with open(path, "w+b") as fh:
        return write_ftiff(fh, layout, sources, hash_id=2, trailer={"vars": []}, timestamp=7, direct=direct_io)


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore(2) of a read-only mapping of it)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
        vec = np.zeros((size + page - 1) // page, np.uint8)
        if libc.mincore(np.frombuffer(mm, np.uint8).ctypes.data, size, vec.ctypes.data) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        return int((vec & 1).sum())


def _read_back(path: Path, arrays: dict[int, np.ndarray]) -> None:
    """Verify the file's hashes and read every variable back: the same bytes as the arrays written."""
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
        reader.verify_data(fh, parsed)
        outs = {v: np.zeros(a.nbytes, np.uint8) for v, a in arrays.items()}
        reader.read_into(fh, parsed, {v: ArrayBytes(o) for v, o in outs.items()})
    for v, a in arrays.items():
        assert np.array_equal(outs[v], np.ascontiguousarray(a).reshape(-1).view(np.uint8)), v


@pytest.fixture
def small_direct_min(monkeypatch):
    """Direct writes for files of any size (the default leaves small files to the page cache)."""
    monkeypatch.setattr(writer, "DIRECT_MIN", 1)


@pytest.mark.parametrize("sizes", [
    [1], [4095, 4097, 1], [3 << 20, 5, (9 << 20) + 13], [100] * 300 + [(17 << 20) + 1], [8 << 20, 8 << 20],
    [(1 << 20) + 3, 7, (2 << 20) + 5, 300_000, 1, (9 << 20) + 1, 4096, 262_144, 262_145],
])
def test_the_same_bytes_as_through_the_page_cache(tmp_path, small_direct_min, sizes):
    arrays = _arrays(sizes)
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    a = _write(tmp_path / "cached.fti", arrays, layout, False)
    b = _write(tmp_path / "direct.fti", arrays, layout, True)
    assert a == b
    assert (tmp_path / "cached.fti").read_bytes() == (tmp_path / "direct.fti").read_bytes()
    _read_back(tmp_path / "direct.fti", arrays)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(1, 5000), st.integers(4090, 4100), st.integers(20_000, 70_000)),
                      min_size=1, max_size=12),
       grow=st.lists(st.integers(1, 70_000), max_size=4))
def test_any_sizes_small_pieces(tmp_path, monkeypatch, sizes, grow):
    """Pieces of 16 KiB and containers inline up to 4 KiB (instead of 8 MiB and 256 KiB): every way pieces, small
    containers, gaps and a grown layout's second block share blocks, on small files; the same bytes either way."""
    monkeypatch.setattr(writer, "DIRECT_MIN", 1)
    monkeypatch.setattr(writer, "COPY_PIECE", 16 << 10)
    monkeypatch.setattr(writer, "_INLINE", 4 << 10)
    arrays = _arrays(sizes)
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    if grow:  # a second block: containers appended for arrays that grew, and new arrays
        arrays = _arrays([max(n, g) for n, g in zip(sizes, grow)] + sizes[len(grow):] + grow, seed=1)
        layout = plan_layout(layout, [(v, a.nbytes) for v, a in arrays.items()])
    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        a = _write(Path(d) / "cached.fti", arrays, layout, False)
        b = _write(Path(d) / "direct.fti", arrays, layout, True)
        assert a == b
        assert (Path(d) / "cached.fti").read_bytes() == (Path(d) / "direct.fti").read_bytes()
        _read_back(Path(d) / "direct.fti", arrays)


def test_a_grown_layout_with_its_appended_block(tmp_path, small_direct_min):
    """The second block's metadata sits between the first block's data and its own: a gap the stream fills with
    zeros and the metadata written through the cache after it lands on the pages written directly."""
    first = _arrays([5000, 3 << 20, 77])
    layout = plan_layout(None, [(v, a.nbytes) for v, a in first.items()])
    grown = _arrays([9000, (6 << 20) + 3, 77, 12345], seed=1)
    layout = plan_layout(layout, [(v, a.nbytes) for v, a in grown.items()])
    assert len(layout.blocks) == 2
    _write(tmp_path / "cached.fti", grown, layout, False)
    _write(tmp_path / "direct.fti", grown, layout, True)
    assert (tmp_path / "cached.fti").read_bytes() == (tmp_path / "direct.fti").read_bytes()
    _read_back(tmp_path / "direct.fti", grown)


def test_a_strided_source_and_the_default_threshold(tmp_path):
    """A non-contiguous array (its bytes come in pieces) above DIRECT_MIN, through write_rank_file."""
    base = np.random.default_rng(3).random((2048, 2 * 1024 + 7))  # 33 MiB, every other column: 16.5 MiB
    arr = base[:, ::2]
    assert not arr.flags.c_contiguous and arr.nbytes >= writer.DIRECT_MIN
    arrays = {1: arr, 2: np.arange(1000, dtype=np.int32)}
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    paths = {}
    for direct_io in (False, True):
        paths[direct_io] = tmp_path / f"Ckpt1-Rank0-{direct_io}.fti"
        write_rank_file(paths[direct_io], layout, {v: ArrayBytes(a) for v, a in arrays.items()}, [],
                        hash_id=2, meta={"t": 1}, direct=direct_io)
    cached, direct_bytes = paths[False].read_bytes(), paths[True].read_bytes()
    # the file blocks differ (timestamps), not a byte after them
    assert cached[FB_SIZE:] == direct_bytes[FB_SIZE:] and len(cached) == len(direct_bytes)
    _read_back(paths[True], arrays)


def test_the_data_is_not_left_in_the_page_cache(tmp_path):
    arrays = _arrays([64 << 20])
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    _write(tmp_path / "cached.fti", arrays, layout, False)
    _write(tmp_path / "direct.fti", arrays, layout, True)
    pages = (64 << 20) // mmap.PAGESIZE
    assert _resident_pages(tmp_path / "cached.fti") >= pages // 2  # written through the cache: there (unless evicted)
    assert _resident_pages(tmp_path / "direct.fti") <= 8  # only the pages the metadata shares with the data


def test_a_file_system_refusing_direct_writes_gets_them_through_the_page_cache(tmp_path, monkeypatch,
                                                                             small_direct_min):
    """Every direct write refused with EINVAL (misaligned for real: the stream's alignment set to 1 byte, as a
    device whose blocks the stream does not know): the same bytes through the cache, no error."""
    monkeypatch.setattr(direct, "ALIGN", 1)
    monkeypatch.setattr(writer, "ALIGN", 1)
    monkeypatch.setattr(direct, "_free", [])
    arrays = _arrays([(3 << 20) + 5, 11])
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    seen = []
    real = direct.open_stream

    def spy(fd):
        stream = real(fd)
        seen.append(stream)
        return stream

    monkeypatch.setattr(writer, "open_stream", spy)
    _write(tmp_path / "direct.fti", arrays, layout, True)
    monkeypatch.undo()
    _write(tmp_path / "cached.fti", arrays, layout, False)
    assert (tmp_path / "cached.fti").read_bytes() == (tmp_path / "direct.fti").read_bytes()
    assert seen and seen[0] is not None and not seen[0].direct  # it fell back


class _Failing(ArrayBytes):
    """A source whose bytes past ``fail_at`` cannot be read (an error while the data streams)."""

    def __init__(self, arr: np.ndarray, fail_at: int) -> None:
        super().__init__(arr)
        self.fail_at = fail_at

    def view(self, start, stop):
        return None

    def pieces(self, start, stop):
        if stop > self.fail_at:
            raise RuntimeError("source failed")
        yield memoryview(self.array.reshape(-1).view(np.uint8)[start:stop])


def test_a_failure_while_streaming_leaves_no_file_and_the_descriptor_usable(tmp_path, small_direct_min):
    arr = _arrays([40 << 20])[1]
    layout = plan_layout(None, [(1, arr.nbytes)])
    path = tmp_path / "Ckpt1-Rank0.fti"
    with pytest.raises(RuntimeError, match="source failed"):
        write_rank_file(path, layout, {1: _Failing(arr, 30 << 20)}, [], hash_id=2, meta={}, direct=True)
    assert not path.exists() and not [p for p in tmp_path.iterdir()]  # the temporary file removed too
    # The next file writes (no buffer still in use by a write in flight, no thread stuck).
    write_rank_file(path, layout, {1: ArrayBytes(arr)}, [], hash_id=2, meta={}, direct=True)
    _read_back(path, {1: arr})


def _rank_files(root: Path, ckpt_id: int) -> list[Path]:
    return sorted(p for p in root.rglob(f"Ckpt{ckpt_id}-Rank*.fti"))


@pytest.mark.parametrize("level", [1, 4])
def test_a_checkpoint_writes_its_rank_file_direct_and_recovers_it(tmp_path, level):
    """Through init/protect/checkpoint/recover: the file's data is not in the page cache after the checkpoint (it
    is with direct_io = 0), and the recovery gives every array back bit for bit."""
    rng = np.random.default_rng(level)
    big, small = rng.random((3, 1 << 20)), np.arange(1001, dtype=np.int16)  # 24 MiB and 2 KiB
    resident = {}
    for direct_io in (0, 1):
        root = tmp_path / f"d{direct_io}"
        dirs = {k: str(root / n) for k, n in (("ckpt_dir", "l"), ("glbl_dir", "g"), ("meta_dir", "m"))}
        with ftidask.init(direct_io=direct_io, **dirs) as ctx:
            a, b = big.copy(), small.copy()
            ctx.protect(1, a)
            ctx.protect(2, b)
            ctx.checkpoint(1, level)
            (path,) = _rank_files(root, 1)
            resident[direct_io] = _resident_pages(path)
            a[:] = 0
            b[:] = 0
            ctx.recover()
            assert a.tobytes() == big.tobytes() and b.tobytes() == small.tobytes()
    assert resident[1] <= 8 < (24 << 20) // mmap.PAGESIZE // 2 <= resident[0]


NWORKERS = 2


@pytest.mark.dask
def test_a_dask_checkpoint_writes_direct_on_the_workers_and_recovers(dask_client, tmp_path):
    da = pytest.importorskip("dask.array")
    dirs = {k: str(tmp_path / n) for k, n in (("ckpt_dir", "l"), ("glbl_dir", "g"), ("meta_dir", "m"))}
    x = da.random.default_rng(5).random((4096, 2048), chunks=(2048, 2048)).persist()  # 2 chunks of 32 MiB
    want = x.compute()
    ctx = ftidask.init(client=dask_client, direct_io=1, **dirs)
    try:
        ctx.protect(1, x)
        ctx.checkpoint(1, 1)
        files = _rank_files(tmp_path / "l", 1)
        assert files and all(_resident_pages(p) <= 8 for p in files)
        got = ctx.recover()[1].compute()
        assert got.tobytes() == want.tobytes()
    finally:
        ctx.finalize()


@pytest.mark.parametrize("level", [1, 4])
def test_a_full_disk_in_the_middle_of_a_direct_write_keeps_the_previous_checkpoint(tmp_path, level):
    """A real full file system (a tmpfs, which takes O_DIRECT since Linux 6.6) with room for a few MiB of the
    second checkpoint's 20 MiB: ENOSPC from a direct write, the file named in the CheckpointError, no temporary file
    left, checkpoint 1 recovered."""
    from diskfull import fill, tmpfs

    with tmpfs(tmp_path / "fs", "48m") as fs:
        fs.chmod(0o700)
        where = "glbl_dir" if level == 4 else "ckpt_dir"
        dirs = {"ckpt_dir": str(tmp_path / "Local"), "glbl_dir": str(tmp_path / "Global"),
                "meta_dir": str(tmp_path / "Meta"), where: str(fs / "run"), "verbosity": 4, "direct_io": 1}
        data = np.random.default_rng(0).random(20 << 17)  # 20 MiB
        first = data.copy()
        with ftidask.init(**dirs) as ctx:
            ctx.protect(1, data)
            ctx.checkpoint(1, level)
            filler = fill(fs, leave=6 << 20)
            data += 1
            with pytest.raises(ftidask.CheckpointError, match="No space left on device") as failed:
                ctx.checkpoint(2, level)
            assert "Ckpt2-Rank0.fti" in str(failed.value), failed.value
            assert not [p for p in fs.rglob("*") if ".tmp-" in p.name]
            filler.unlink()
            ctx.recover()
            assert ctx.recovered_from == (1, level) and data.tobytes() == first.tobytes()
