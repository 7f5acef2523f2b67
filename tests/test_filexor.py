"""The heads' differential L3 delta (``dcp.filexor``): which blocks of two files differ, their XOR read back from both
files when the exchange asks for it, never held; a file that changed meanwhile is an error, never a wrong delta.

Members of a group are threads (tests/test_rs_delta.py's group); the MPI run with heads is tests/test_mpi_heads_l7.py.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import test_rs_delta
from test_rs_delta import SIZE, _in_group, _reference, _write

from ftidask.dcp import filexor
from ftidask.dcp.delta import XorDelta, file_fb_hash
from ftidask.dcp.filexor import files_xor_delta
from ftidask.levels import rs_delta
from ftidask.model.errors import FormatError, FTIError

sys.path.insert(0, os.path.dirname(__file__))
import leaks  # noqa: E402

group = test_rs_delta.group  # the fixture: every member's base file and its spare parity of them
BLOCK = 3000  # not a divisor of a stripe nor of a read piece: both cut blocks


def _padded(path: Path, width: int) -> np.ndarray:
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    return np.concatenate([raw, np.zeros(width - raw.size, np.uint8)])


def _expected(base: Path, new: Path, block: int) -> tuple[list[tuple[int, int]], bytes]:
    """The blocks that differ (adjacent ones joined) and their XOR, computed whole in memory (what the heads held)."""
    width = max(base.stat().st_size, new.stat().st_size)
    xor = _padded(base, width) ^ _padded(new, width)
    ranges: list[tuple[int, int]] = []
    for off in range(0, width, block):
        n = min(block, width - off)
        if xor[off:off + n].any():
            if ranges and sum(ranges[-1]) == off:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
            else:
                ranges.append((off, n))
    return ranges, b"".join(xor[o:o + n].tobytes() for o, n in ranges)


def _read_in_windows(xor: XorDelta, sizes: list[int]) -> bytes:
    out, pos, k = [], 0, 0
    while pos < xor.nbytes:
        n = sizes[k % len(sizes)]
        out.append(xor.read(pos, n)[:max(0, xor.nbytes - pos)].tobytes())
        pos, k = pos + n, k + 1
    return b"".join(out)[:xor.nbytes]


@pytest.fixture
def pair(tmp_path):
    """A checkpoint file (the base, with an FB) and a new file: some of its blocks changed, then ``tail`` appended."""
    pool = ThreadPoolExecutor(2)
    rng = np.random.default_rng(5)
    arrays = {1: rng.random(40_000), 2: rng.integers(0, 9, 9_000).astype(np.int32)}
    base = tmp_path / "base.fti"
    _write(base, arrays, None, pool)
    pool.shutdown()

    def make(change, tail: bytes = b"", cut: int = 0) -> Path:
        new = tmp_path / "new.fti"
        raw = bytearray(base.read_bytes())
        for off in change:
            raw[off] ^= 0x5A
        raw = raw[:len(raw) - cut] + tail
        new.write_bytes(bytes(raw))
        return new

    return base, make


@pytest.mark.parametrize(("tail", "cut"), [(b"", 0), (b"\x07" * 4500, 0), (b"", 2500)])
def test_the_delta_read_back_from_both_files_is_the_xor_they_had(pair, tmp_path, tail, cut):
    """The ranges are the blocks that differ, the payload their ``base XOR new`` (each file zero-padded to the longer:
    the new one longer by more than a block, or shorter), read in windows that cut blocks and pieces anywhere; the
    delta holds the two files' descriptors, and none once closed. Not picklable (its descriptors mean nothing
    elsewhere)."""
    base, make = pair
    size = base.stat().st_size
    new = make([7, 9000, 9001, 25_000, 25_000 + BLOCK, size // 2, size - 3], tail, cut)
    before = leaks.descriptors(tmp_path)
    xor = files_xor_delta(base, new, BLOCK, 1 << 30)
    assert xor is not None
    try:
        want_ranges, want = _expected(base, new, BLOCK)
        assert list(xor.ranges) == want_ranges and xor.base_fb_hash.hex() == file_fb_hash(base)
        assert xor.nbytes == len(want) < size // 2
        assert isinstance(xor.scratch, filexor.FilesXor)
        assert leaks.grown(before, leaks.descriptors(tmp_path)) == {str(base): 1, str(new): 1}
        for windows in ([xor.nbytes + 100], [5000, 777], [1], [BLOCK, 2 * BLOCK + 1]):
            assert _read_in_windows(xor, windows) == want, windows
        with pytest.raises(TypeError):
            pickle.dumps(xor)
    finally:
        xor.close()
    assert leaks.descriptors(tmp_path) == before
    xor.close()  # twice: nothing


def test_no_delta_leaves_no_descriptor(pair, tmp_path):
    """More than ``limit`` bytes differ, the base has no FB or is gone: no delta (the group encodes in full), nothing
    left open."""
    base, make = pair
    new = make(range(0, base.stat().st_size, 1000))
    before = leaks.descriptors(tmp_path)
    assert files_xor_delta(base, new, BLOCK, 10 * BLOCK) is None
    short = tmp_path / "short.fti"
    short.write_bytes(base.read_bytes()[:50])  # no whole FB
    assert files_xor_delta(short, new, BLOCK, 1 << 30) is None
    assert files_xor_delta(tmp_path / "gone.fti", new, BLOCK, 1 << 30) is None
    assert leaks.descriptors(tmp_path) == before


def test_files_replaced_by_name_after_the_comparison_are_not_read(pair, tmp_path):
    """Both files are read through the descriptors the comparison opened: a file put at either name afterwards (a
    rename over it) is never what the delta reads."""
    base, make = pair
    new = make([100, 20_000])
    want_ranges, want = _expected(base, new, BLOCK)
    xor = files_xor_delta(base, new, BLOCK, 1 << 30)
    assert xor is not None
    try:
        for path in (base, new):
            other = tmp_path / "other"
            other.write_bytes(os.urandom(path.stat().st_size))
            os.replace(other, path)
        assert list(xor.ranges) == want_ranges and _read_in_windows(xor, [4096]) == want
    finally:
        xor.close()


@pytest.mark.parametrize("damage", ["base-cut", "new-cut", "base-flip", "new-flip"])
def test_a_file_that_changed_after_the_comparison_is_an_error_not_a_wrong_delta(pair, damage):
    """A file cut shorter than when compared (its changed blocks' bytes gone), or a byte of a changed block flipped:
    reading the delta raises (the member's part of the exchange fails), it never gives another XOR. A byte flipped in
    a block that did not differ is never read: the delta stays right (the parity it patches encodes the new files)."""
    base, make = pair
    size = base.stat().st_size
    new = make([100, size // 2])
    xor = files_xor_delta(base, new, BLOCK, 1 << 30)
    assert xor is not None
    try:
        _ranges, want = _expected(base, new, BLOCK)
        victim = base if damage.startswith("base") else new
        with open(victim, "r+b") as fh:
            fh.seek(3 * BLOCK + 5)  # a block that did not differ
            byte = fh.read(1)
            fh.seek(3 * BLOCK + 5)
            fh.write(bytes([byte[0] ^ 1]))
        assert _read_in_windows(xor, [7000]) == want
        if damage.endswith("cut"):
            os.truncate(victim, size // 2 - 10)
            error, match = OSError, "shorter than when it was compared"
        else:
            with open(victim, "r+b") as fh:
                fh.seek(size // 2 + 1)  # in a block that differs
                byte = fh.read(1)
                fh.seek(size // 2 + 1)
                fh.write(bytes([byte[0] ^ 0x10]))
            error, match = FormatError, "changed since they were compared"
        with pytest.raises(error, match=match):
            _read_in_windows(xor, [7000])
    finally:
        xor.close()


def _bases_and_new_files(members, pool, change):
    """Each member's file kept as ``base.fti`` (the previous checkpoint's), then patched in place into the new one."""
    for i, m in enumerate(members):
        shutil.copyfile(m["own"], m["dir"] / "base.fti")
        change(i, m["arrays"])
        _stats, m["state"] = _write(m["own"], m["arrays"], m["state"], pool)


def test_the_group_patches_from_files_deltas_the_parity_a_full_encoding_gives(group, monkeypatch, tmp_path):
    """Each member's delta computed from its two files (as a head does) patches the spare parity into a full
    encoding's, byte for byte, exchanged in stripes that cut blocks; afterwards no descriptor is left."""
    members, pool = group
    monkeypatch.setattr(rs_delta, "STRIPE", 7001)
    monkeypatch.setattr(rs_delta, "PATCH_PIECE", 999)
    monkeypatch.setattr(filexor, "READ_PIECE", 5 * BLOCK + 1)
    rng = np.random.default_rng(4)

    def change(i, arrays):
        arrays[1][rng.integers(0, arrays[1].size, 15)] = -1.0 - i
        arrays[1][i * 1000:i * 1000 + 6000] += 1.0  # a run of changed blocks, longer than a stripe

    _bases_and_new_files(members, pool, change)
    before = leaks.descriptors(tmp_path)
    xors = [files_xor_delta(m["dir"] / "base.fti", m["own"], BLOCK, 1 << 30) for m in members]
    sizes = [m["own"].stat().st_size for m in members]
    try:
        results = _in_group(lambda ch, i: rs_delta.update(ch, xors[i], file_fb_hash(members[i]["own"]),
                                                          members[i]["dir"] / "spare.rsed",
                                                          members[i]["dir"] / "new.rsed", sizes, 2))
    finally:
        for x in xors:
            x.close()
    assert results == [None] * SIZE
    assert leaks.descriptors(tmp_path) == before
    want = _reference([m["own"] for m in members])
    for i, m in enumerate(members):
        assert (m["dir"] / "new.rsed").read_bytes() == want[i]


def test_a_member_whose_base_was_cut_before_the_exchange_fails_its_part(group):
    """Member 1's base is cut after the comparison: its reads fail, it still takes its part in every stripe (the
    others are not left waiting) and raises after the last one; the caller's agreement then fails the checkpoint
    everywhere (tests/test_mpi_heads_l7.py)."""
    members, pool = group

    def change(i, arrays):
        arrays[1][i * 1000:i * 1000 + 6000] += 1.0

    _bases_and_new_files(members, pool, change)
    xors = [files_xor_delta(m["dir"] / "base.fti", m["own"], BLOCK, 1 << 30) for m in members]
    os.truncate(members[1]["dir"] / "base.fti", 1000)
    sizes = [m["own"].stat().st_size for m in members]

    def member(ch, i):
        try:
            return rs_delta.update(ch, xors[i], file_fb_hash(members[i]["own"]), members[i]["dir"] / "spare.rsed",
                                   members[i]["dir"] / "new.rsed", sizes, 2)
        except FTIError as exc:
            return str(exc)
        finally:
            xors[i].close()

    results = _in_group(member)
    assert results[0] is None and results[2] is None, results
    assert "shorter than when it was compared" in results[1], results
