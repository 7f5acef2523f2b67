"""The hash check of a file's containers reads the file (``preadv``); it never maps it.

A mapped file that shrinks under its reader, or whose disk fails to read a page, kills the process with
SIGBUS: the recovery could then never fall back to a partner copy, the parity or an older checkpoint. Read
through ``preadv``, the same faults are a short read or an ``OSError``: a damaged file, and the recovery
goes on. The child processes below cut the file between the size check and the hashing (a seam on the
hasher), as another process or a failing disk would.
"""

from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest
from conftest import run_python

import ftidask
from ftidask.ftiff import hashing, verify
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import FormatError

CHILD = textwrap.dedent("""
    import os, sys
    from ftidask.ftiff import hashing, reader
    path, decode = sys.argv[1], sys.argv[2] == "1"
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, path)
    cut = []

    def cutting(real):
        def wrapper(*args, **kwargs):
            if not cut:  # once, after the size check: as another process or a failing disk would
                cut.append(True)
                os.truncate(path, 0)
            return real(*args, **kwargs)
        return wrapper

    hashing.digest = cutting(hashing.digest)
    hashing.new_hasher = cutting(hashing.new_hasher)
    hashing.oneshot = cutting(hashing.oneshot)  # small containers close together: one read, hashed in one call each
    try:
        with open(path, "rb") as fh:
            reader.verify_data(fh, parsed, decode=decode)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
    else:
        print("VERIFIED")
""")


SIZES = {"large": 3 << 20, "small": 32 << 10}  # float64 values: 24 MiB (several pieces of a read, several threads);
# 256 KiB (checked on the caller's thread, in one read per container: verify.INLINE_BYTES)


def _checkpoint(tmp_path, size="large", **kw):
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"), **kw)
    ctx.protect(1, np.arange(SIZES[size], dtype=np.float64))
    ctx.protect(2, np.arange(1000, dtype=np.int32))
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = tmp_path.glob("L/node0/*/l1/ckpt1.*/Ckpt1-Rank0.fti")
    return path


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("compressor", [None, "zstd"])
@pytest.mark.parametrize("decode", [True, False])
def test_a_file_cut_while_it_is_verified_is_damaged_not_a_crash(tmp_path, compressor, decode, size):
    path = _checkpoint(tmp_path, size, **({"compressor": compressor} if compressor else {}))
    proc = run_python(CHILD, str(path), "1" if decode else "0", check=False)
    assert proc.returncode == 0, f"the verifying process died ({proc.returncode}): {proc.stderr[-2000:]}"
    assert "RAISED FormatError" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_every_flipped_byte_of_a_container_is_found(tmp_path, compressor, size):
    """Bytes flipped at the start, inside and at the end of a container (large: spread over several pieces)."""
    path = _checkpoint(tmp_path, size, **({"compressor": compressor} if compressor else {}))
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
    metas = [meta for _b, _c, meta in parsed.containers() if meta.hascontent]
    for meta in metas:
        for offset in (0, meta.chunksize // 2, meta.chunksize - 1):
            raw = bytearray(path.read_bytes())
            raw[meta.fptr + offset] ^= 0x40
            damaged = path.with_name("damaged.fti")
            damaged.write_bytes(bytes(raw))
            with open(damaged, "rb") as fh, pytest.raises(FormatError, match="does not match"):
                verify_data(fh, parse_ftiff(fh, str(damaged)))


@pytest.mark.parametrize(("size", "threads"), [("small", {"MainThread"}), ("large", {"ftidask-verify"})])
def test_a_small_file_is_checked_on_the_callers_thread(tmp_path, monkeypatch, size, threads):
    """Starting the verifying threads cost a small state's recovery more than its reading and hashing (50-100 ms for
    a 1 MiB state on a loaded machine): a file of a few MiB is checked where it is asked for, a large one on the
    verifying threads."""
    path = _checkpoint(tmp_path, size)
    seen = set()
    checked = verify.container_problem

    def seam(*args, **kwargs):
        seen.add(threading.current_thread().name.split("_")[0])
        return checked(*args, **kwargs)

    monkeypatch.setattr(verify, "container_problem", seam)
    with open(path, "rb") as fh:
        verify_data(fh, parse_ftiff(fh, str(path)))
    assert seen == threads


def test_streamed_hashes_equal_whole_ones():
    """The check hashes a container piece by piece: the same digest as in one call, for every hash."""
    data = np.random.default_rng(0).integers(0, 256, (9 << 20) + 13, dtype=np.uint8)
    for name in ("md5", "xxh3_128"):
        hid = hashing.hash_id(name)
        hasher = hashing.new_hasher(hid)
        for lo in range(0, data.size, 1 << 20):
            hasher.update(memoryview(data[lo:lo + (1 << 20)]))
        assert hasher.digest() == hashing.digest(hid, memoryview(data))
