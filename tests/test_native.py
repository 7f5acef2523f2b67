"""The optional native helpers: the same digests as the xxhash binding, and the same files without them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

import ftidask
from ftidask.ftiff import blockhash
from ftidask.ftiff.reader import parse_ftiff
from ftidask.storage import files as storage
from ftidask.storage.files import find_paths

native = pytest.importorskip("ftidask._native", reason="native helpers not built (no C compiler at install)")


@pytest.mark.parametrize("fn,width", [(xxhash.xxh3_128_digest, 16), (xxhash.xxh3_64_digest, 8)])
@pytest.mark.parametrize("size", [0, 1, 239, 240, 241, 511, 512, 1000, 70_000, 1 << 20])
@pytest.mark.parametrize("block", [512, 1000, 16384, 65535])
def test_digests_match_the_binding(fn, width, size, block):
    """Every XXH3 input-length class (<=16, <=128, <=240, long) and a short last block."""
    data = np.random.default_rng(size + block).integers(0, 256, size, dtype=np.uint8)
    got = blockhash.block_digests(memoryview(data), block, fn, width)
    want = [fn(data[lo:lo + block].tobytes()) for lo in range(0, size, block)]
    assert got.shape == (len(want), width)
    assert [row.tobytes() for row in got] == want


def test_bad_arguments_are_refused():
    out = np.empty(16, np.uint8)
    with pytest.raises(ValueError, match="block_size"):
        native.xxh3_blocks(b"x" * 10, 0, out, 16)
    with pytest.raises(ValueError, match="width"):
        native.xxh3_blocks(b"x" * 10, 512, out, 4)
    with pytest.raises(ValueError, match="out holds"):
        native.xxh3_blocks(b"x" * 1025, 512, out, 16)
    with pytest.raises(TypeError):
        native.xxh3_blocks(b"x", 512, b"read-only", 16)
    with pytest.raises(ValueError):
        native.start_writeback(0, -1, 10)
    with pytest.raises(OSError):
        native.start_writeback(987654, 0, 10)  # not an open descriptor


def test_start_writeback_is_only_a_hint(tmp_path: Path):
    path = tmp_path / "f"
    path.write_bytes(b"a" * 100_000)
    fd = os.open(path, os.O_RDWR)
    try:
        storage.start_writeback(fd, 0, 100_000)
        storage.start_writeback(987654, 0, 10)  # failures are ignored by the wrapper
    finally:
        os.close(fd)
    assert path.read_bytes() == b"a" * 100_000


def _hashed_part(path: Path) -> bytes:
    """Blocks, data and block-hash section: all but the FB and the table (they hold the time)."""
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        end = blockhash.DcpInfo(parsed).offset + blockhash.DcpInfo(parsed).section_len
    return path.read_bytes()[96:end]


def _dcp_run(root: Path, arrays: list[np.ndarray]) -> list[bytes]:
    ctx = ftidask.init(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"),
                       enable_dcp=1, dcp_block_size=4096, exec_id="same")
    for i, arr in enumerate(arrays):
        ctx.protect(i, arr)
    files = []
    for step in range(3):
        arrays[0][step * 1000] += 1
        ctx.checkpoint(step + 1, 5)
        files.append(_hashed_part(find_paths(root / "l", f"Ckpt{step + 1}-Rank0.fti")[0]))
    ctx.finalize()
    return files


def test_files_are_identical_without_the_kernel(tmp_path: Path, monkeypatch):
    rng = np.random.default_rng(7)
    start = [rng.random(100_000), rng.integers(0, 9, 33_333, dtype=np.int16)]
    with_kernel = _dcp_run(tmp_path / "a", [a.copy() for a in start])
    monkeypatch.setattr(blockhash, "_native", None)
    without = _dcp_run(tmp_path / "b", [a.copy() for a in start])
    assert with_kernel == without
