"""L3 for differential files: parity updated from old XOR new deltas equals a full re-encoding.

Members are threads of one process joined by the queue-based group channel of
tests/test_partner_delta.py (the MPI run is in tests/test_dcp_mpi.py).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_partner_delta import ThreadChannel, ThreadGroup

from ftidask.dcp.delta import file_fb_hash
from ftidask.dcp.files import write_dcp_file
from ftidask.ftiff.layout import plan_layout
from ftidask.levels import rs, rs_delta
from ftidask.levels.erasure import ReedSolomon
from ftidask.model.arrays import ArrayBytes, VarInfo

SIZE = 3


class BlockChannel(ThreadChannel):
    def allgather_blocks(self, block):
        return [np.asarray(b, np.uint8) for b in self.allgather(np.array(block, np.uint8, copy=True))]


def _write(path: Path, arrays, base, pool, note="", spill_dir=None):
    layout = plan_layout(None, [(vid, a.nbytes) for vid, a in arrays.items()])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        infos = [VarInfo.of(vid, f"v{vid}", a) for vid, a in arrays.items()]
        _w, stats, state = write_dcp_file(fd, layout, {vid: ArrayBytes(a) for vid, a in arrays.items()}, infos,
                                          {"format": "ftidask", "note": note}, base, block_size=4096, bid=4,
                                          hash_id=2, pool=pool,
                                          capture_xor=True, **({} if spill_dir is None else {"spill_dir": spill_dir}))
    finally:
        os.close(fd)
    return stats, state


def _in_group(fn):
    group = ThreadGroup(SIZE)
    with ThreadPoolExecutor(SIZE) as ex:
        return list(ex.map(lambda i: fn(BlockChannel(group, i), i), range(SIZE)))


def _reference(files):
    datas = [np.frombuffer(f.read_bytes(), np.uint8) for f in files]
    width = max(d.size for d in datas)
    padded = [np.concatenate([d, np.zeros(width - d.size, np.uint8)]) for d in datas]
    return [p.tobytes() for p in ReedSolomon(SIZE, SIZE).encode(padded)]


@pytest.fixture
def group(tmp_path):
    """Every member's base file, and each member's parity of the base files kept as its spare."""
    pool = ThreadPoolExecutor(2)
    rng = np.random.default_rng(0)
    members = []
    for i in range(SIZE):
        d = tmp_path / f"node{i}"
        d.mkdir()
        arrays = {1: rng.random(60_000 + 5_000 * i), 2: rng.integers(0, 9, 20_000).astype(np.int32)}
        _stats, state = _write(d / "own.fti", arrays, None, pool)
        members.append({"dir": d, "arrays": arrays, "state": state, "own": d / "own.fti"})
    sizes = [m["own"].stat().st_size for m in members]
    hashes = [file_fb_hash(m["own"]) for m in members]
    errors = _in_group(lambda ch, i: rs.encode(ch, members[i]["own"], members[i]["dir"] / "spare.rsed", sizes,
                                               1 << 16, 2, hashes))
    assert errors == [""] * SIZE
    yield members, pool
    pool.shutdown()


def _patch_all(members, pool, change, notes=("", "", ""), spill=None):
    xors = []
    for i, m in enumerate(members):
        change(i, m["arrays"])
        stats, m["state"] = _write(m["own"], m["arrays"], m["state"], pool, notes[i],
                                   None if spill is None else spill(m))
        xors.append(stats.xor)
    sizes = [m["own"].stat().st_size for m in members]
    results = _in_group(lambda ch, i: rs_delta.update(
        ch, xors[i], file_fb_hash(members[i]["own"]), members[i]["dir"] / "spare.rsed",
        members[i]["dir"] / "new.rsed", sizes, 2))
    return xors, results


@pytest.mark.parametrize("stripe", [None, (5000, 777), (4096, 4096)])
def test_updated_parity_equals_a_full_encoding(group, monkeypatch, stripe):
    """``stripe``: the deltas exchanged in stripes of that many bytes and the parity patched in pieces of so many
    (not one of each, as with the defaults here): windows that cut ranges and pieces anywhere."""
    members, pool = group
    rng = np.random.default_rng(1)
    if stripe is not None:
        monkeypatch.setattr(rs_delta, "STRIPE", stripe[0])
        monkeypatch.setattr(rs_delta, "PATCH_PIECE", stripe[1])

    def change(i, arrays):
        arrays[1][rng.integers(0, arrays[1].size, 15)] = -1.0 - i
        arrays[1][i * 1000:i * 1000 + 3000] += 1.0  # a run of changed blocks, longer than a stripe

    xors, results = _patch_all(members, pool, change)
    assert results == [None] * SIZE
    total = sum(m["own"].stat().st_size for m in members)
    assert sum(x.nbytes for x in xors) < total // 5  # only the changed ranges travelled
    want = _reference([m["own"] for m in members])
    for i, m in enumerate(members):
        assert (m["dir"] / "new.rsed").read_bytes() == want[i]
        assert rs.parity_ok(m["dir"] / "new.rsed", len(want[i]), 1 << 16)
        record = json.loads(rs.hash_path(m["dir"] / "new.rsed").read_text())
        assert record["fb_hashes"] == [file_fb_hash(x["own"]) for x in members]  # ready for the next update
    # the updated parity rebuilds a lost file: member 1's, from member 0's and 2's files and a parity
    width = len(want[0])
    pad = [np.frombuffer(m["own"].read_bytes().ljust(width, b"\0"), np.uint8) for m in members]
    got = ReedSolomon(SIZE, SIZE).decode({0: pad[0], 2: pad[2], SIZE + 1: np.frombuffer((members[1]["dir"] / "new.rsed").read_bytes(), np.uint8)})
    assert got[1].tobytes() == pad[1].tobytes()


@pytest.mark.parametrize("o_tmpfile", [True, False])
@pytest.mark.parametrize("in_memory", [0, 20_000])
def test_a_delta_spilled_to_its_scratch_file_patches_the_same_parity(group, monkeypatch, in_memory, o_tmpfile):
    """Past ``files.XOR_IN_MEMORY`` bytes a member's delta is kept in an unnamed scratch file beside its spare (all of
    it, or the runs after the first 20,000 bytes): the parity patched from it is byte for byte a full encoding's,
    exactly as from a delta held in memory, and nothing is left in the directory. Made with ``O_TMPFILE``, or
    (``delta.USE_O_TMPFILE`` false: a system or file system without it) at a hidden temporary name unlinked at once."""
    from ftidask.dcp import delta, files
    from ftidask.dcp.delta import Spilled

    members, pool = group
    monkeypatch.setattr(delta, "USE_O_TMPFILE", o_tmpfile)
    monkeypatch.setattr(files, "XOR_IN_MEMORY", in_memory)
    monkeypatch.setattr(files, "SPILL_PIECE", 5000)  # runs cut in pieces anywhere
    monkeypatch.setattr(rs_delta, "STRIPE", 7000)
    rng = np.random.default_rng(3)
    listing = {i: sorted(p.name for p in m["dir"].iterdir()) for i, m in enumerate(members)}

    def change(i, arrays):
        arrays[1][rng.integers(0, arrays[1].size, 15)] = -1.0 - i
        arrays[1][i * 1000:i * 1000 + 6000] += 1.0  # a run of changed blocks, longer than a piece and a stripe

    xors, results = _patch_all(members, pool, change, spill=lambda m: m["dir"])
    assert results == [None] * SIZE
    for x in xors:
        spilled = [p for p in x.pieces if isinstance(p, Spilled)]
        assert spilled and sum(p.nbytes for p in spilled) > x.nbytes // 2
        kept = sum(int(p.nbytes) for p in x.pieces if not isinstance(p, Spilled))  # metadata (< 4 KiB), first runs
        assert (kept > 4096) == (in_memory > 0) and kept <= in_memory + 4096
        name = os.readlink(f"/proc/self/fd/{x.scratch.fd}").rsplit("/", 1)[1]  # unnamed: "#inode (deleted)"
        assert name.startswith("#" if o_tmpfile else ".XorDelta.tmp-") and name.endswith(" (deleted)"), name
        x.close()
    want = _reference([m["own"] for m in members])
    for i, m in enumerate(members):
        assert (m["dir"] / "new.rsed").read_bytes() == want[i]
        names = sorted(p.name for p in m["dir"].iterdir())
        assert names == sorted({*listing[i], "new.rsed", "new.rsed.hash"} - {"spare.rsed", "spare.rsed.hash"}), names


@pytest.mark.parametrize("planted", ["file", "link"])
def test_a_file_planted_at_the_scratch_files_temporary_name_is_never_read(group, monkeypatch, tmp_path, planted):
    """Without ``O_TMPFILE`` the scratch file is created ``O_EXCL`` at a hidden temporary name: a file, or a link to
    one elsewhere, planted at the first name it tries (``.XorDelta.tmp-{pid}``) is never opened, followed, read or
    written; another name is taken, and the parity is patched from the deltas (not re-encoded), a full encoding's.
    Nothing but the planted file is left in the directory."""
    from ftidask.dcp import delta, files

    members, pool = group
    monkeypatch.setattr(delta, "USE_O_TMPFILE", False)
    monkeypatch.setattr(files, "XOR_IN_MEMORY", 0)
    garbage = bytes(range(256)) * 64
    target = tmp_path / "elsewhere"
    target.write_bytes(garbage)
    listing = {}
    for i, m in enumerate(members):
        at = m["dir"] / f".XorDelta.tmp-{os.getpid()}"
        if planted == "file":
            at.write_bytes(garbage)
        else:
            at.symlink_to(target)
        listing[i] = sorted(p.name for p in m["dir"].iterdir())

    def change(i, arrays):
        arrays[1][i * 1000:i * 1000 + 4000] += 1.0

    xors, results = _patch_all(members, pool, change, spill=lambda m: m["dir"])
    assert results == [None] * SIZE, results  # patched from the deltas: no file made the checkpoint fail
    for x in xors:
        assert x.scratch is not None and x.scratch.size > 0
        x.close()
    want = _reference([m["own"] for m in members])
    for i, m in enumerate(members):
        assert (m["dir"] / "new.rsed").read_bytes() == want[i]
        at = m["dir"] / f".XorDelta.tmp-{os.getpid()}"
        assert at.is_symlink() == (planted == "link") and at.read_bytes() == garbage
        names = sorted(p.name for p in m["dir"].iterdir())
        assert names == sorted({*listing[i], "new.rsed", "new.rsed.hash"} - {"spare.rsed", "spare.rsed.hash"}), names
    assert target.read_bytes() == garbage


def test_a_scratch_file_that_cannot_be_made_means_full_encoding(group, monkeypatch):
    """The scratch directory refuses the file (gone here; a full disk alike): the write goes on without a delta,
    and the group encodes the parity again in full, which is a full encoding's."""
    from ftidask.dcp import files

    members, pool = group
    monkeypatch.setattr(files, "XOR_IN_MEMORY", 0)

    def change(i, arrays):
        arrays[1][i * 1000:i * 1000 + 3000] += 1.0

    xors, results = _patch_all(members, pool, change, spill=lambda m: m["dir"] / "gone")
    assert xors == [None] * SIZE and all(r is not None for r in results)
    want = _reference([m["own"] for m in members])
    errors = _in_group(lambda ch, i: rs.encode(ch, members[i]["own"], members[i]["dir"] / "new.rsed",
                                               [m["own"].stat().st_size for m in members], 1 << 16, 2,
                                               [file_fb_hash(m["own"]) for m in members]))
    assert errors == [""] * SIZE
    assert all((m["dir"] / "new.rsed").read_bytes() == want[i] for i, m in enumerate(members))


@pytest.mark.parametrize("everyone", [True, False])
def test_updated_record_keeps_whole_file_hashes_only_when_every_member_gives_its_own(group, everyone):
    """The heads hash each new file as they compare it with its base (``own_whole``): the patched parity's record keeps
    the group's whole-file hashes (rs.rebuild checks a sound file against them). A member without one (a rank's
    differential writer) leaves them out: no stale hash of the base files, rs.rebuild checks nothing more."""
    members, pool = group
    names = [f"Ckpt2-Rank{i}.fti" for i in range(SIZE)]
    record = json.loads(rs.hash_path(members[0]["dir"] / "spare.rsed").read_text())
    assert "file_hashes" not in record  # the fixture's files share a name: a record cannot tell them apart
    xors = []
    for i, m in enumerate(members):
        m["arrays"][1][i * 7] = -5.0
        stats, m["state"] = _write(m["own"], m["arrays"], m["state"], pool)
        xors.append(stats.xor)
    sizes = [m["own"].stat().st_size for m in members]
    wholes = [rs.file_hash(m["own"], 2) for m in members]
    results = _in_group(lambda ch, i: rs_delta.update(
        ch, xors[i], file_fb_hash(members[i]["own"]), members[i]["dir"] / "spare.rsed", members[i]["dir"] / "new.rsed",
        sizes, 2, (names[i], wholes[i]) if everyone or i != 1 else None))
    assert results == [None] * SIZE
    for m in members:
        record = json.loads(rs.hash_path(m["dir"] / "new.rsed").read_text())
        assert record.get("file_hashes") == (dict(zip(names, wholes, strict=True)) if everyone else None)


@pytest.mark.parametrize("notes", [("x" * 100_000, "", ""), ("", "", "y" * 300)])
def test_the_largest_file_may_change_size(group, notes):
    """A longer table makes member 0 the largest file (the parity grows), or member 2 (the largest)
    grows a little: the updated parity still equals a full encoding of the new files."""
    members, pool = group
    sizes_before = [m["own"].stat().st_size for m in members]

    def change(i, arrays):
        arrays[2][i] += 1

    _xors, results = _patch_all(members, pool, change, notes)
    assert results == [None] * SIZE
    assert max(m["own"].stat().st_size for m in members) != max(sizes_before)
    want = _reference([m["own"] for m in members])
    for i, m in enumerate(members):
        assert (m["dir"] / "new.rsed").read_bytes() == want[i]


def test_a_chain_of_updates_as_the_largest_file_grows_then_shrinks(group):
    members, pool = group

    def change(i, arrays):
        arrays[1][100 * i] = 3.0

    for notes in [("", "", "y" * 300), ("", "", ""), ("z" * 100_000, "", ""), ("", "", "")]:
        _xors, results = _patch_all(members, pool, change, notes)
        assert results == [None] * SIZE
        want = _reference([m["own"] for m in members])
        for i, m in enumerate(members):
            new = m["dir"] / "new.rsed"
            assert new.read_bytes() == want[i]
            os.replace(new, m["dir"] / "spare.rsed")  # what retiring the checkpoint does
            os.replace(rs.hash_path(new), rs.hash_path(m["dir"] / "spare.rsed"))


def test_a_stale_parity_record_means_full_encoding_and_nothing_touched(group):
    members, pool = group
    spare = members[1]["dir"] / "spare.rsed"
    record = json.loads(rs.hash_path(spare).read_text())
    record["fb_hashes"][0] = "00" * 16  # encodes another file than member 0's base
    rs.hash_path(spare).write_text(json.dumps(record))
    before = [(m["dir"] / "spare.rsed").read_bytes() for m in members]

    def change(i, arrays):
        arrays[1][:10] = 7.0

    _xors, results = _patch_all(members, pool, change)
    assert all(r is not None and "does not encode" in r for r in results)
    assert [(m["dir"] / "spare.rsed").read_bytes() for m in members] == before
    assert not any((m["dir"] / "new.rsed").exists() for m in members)


def test_a_layout_change_means_full_encoding(group):
    members, pool = group

    def change(i, arrays):
        if i == 2:
            arrays[1] = np.concatenate([arrays[1], np.ones(3_000)])  # grows: a new block, no delta

    xors, results = _patch_all(members, pool, change)
    assert xors[2] is None and xors[0] is not None
    assert all(r is not None for r in results)


def test_a_torn_spare_is_not_used_again(group, tmp_path):
    members, pool = group
    # a crash right after the members agreed: the spare's record is gone, its bytes half patched
    for m in members:
        rs.hash_path(m["dir"] / "spare.rsed").unlink()
        shutil.copyfile(m["own"], m["dir"] / "spare.rsed")

    def change(i, arrays):
        arrays[2][:5] = 1

    _xors, results = _patch_all(members, pool, change)
    assert all(r is not None for r in results)


def test_a_damaged_spare_parity_is_not_patched_into_a_parity_that_looks_sound(group):
    """A byte of member 1's spare parity flipped on disk (its record untouched): the group re-encodes in full.
    Before, the spare was patched as it was and given a fresh hash: a wrong parity that verified, so the L3
    redundancy was lost without a word until a lost node needed it."""
    members, pool = group
    spare = members[1]["dir"] / "spare.rsed"
    with open(spare, "r+b") as fh:
        fh.seek(spare.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))

    def change(i, arrays):
        arrays[1][:10] = 7.0

    _xors, results = _patch_all(members, pool, change)
    assert all(r is not None and "does not" in r for r in results)
    assert not any((m["dir"] / "new.rsed").exists() for m in members)


def test_a_delta_read_and_its_windows_in_stripes_give_each_byte_once():
    """XorDelta.read and rs_delta._windows start from the piece and range that hold the stripe (never a scan from
    the first one): every payload byte comes back once, at its place, whatever the stripe cuts (empty pieces too)."""
    import itertools

    from ftidask.dcp.delta import XorDelta

    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(0, 40, 300)]  # some pieces and ranges empty
    pieces = tuple(rng.integers(0, 256, n, dtype=np.uint8) for n in sizes)
    ranges = tuple((1000 * k, n) for k, n in enumerate(sizes))
    delta = XorDelta(b"\0" * 16, ranges, pieces)
    payload = np.concatenate(pieces)
    assert delta.nbytes == len(payload)
    starts = [0, *itertools.accumulate(sizes)]
    for stripe in (1, 7, 64, len(payload) + 5):
        width = len(payload) + 3  # padded, as a member narrower than the group's widest
        got = np.concatenate([delta.read(lo, min(stripe, width - lo)) for lo in range(0, width, stripe)])
        assert np.array_equal(got[:len(payload)], payload) and not got[len(payload):].any()
        placed = {}
        for lo in range(0, width, stripe):
            for off, part in rs_delta._windows([list(r) for r in ranges], starts, lo, got[lo:lo + stripe]):
                for j, byte in enumerate(part):
                    assert off + j not in placed
                    placed[off + j] = int(byte)
        assert placed == {off + j: int(p[j]) for (off, _n), p in zip(ranges, pieces) for j in range(len(p))}


def test_a_member_whose_patch_fails_midway_takes_its_part_in_every_stripe_left(group, monkeypatch):
    """One member's write of the parity fails in its first stripe (a full disk), stripes left to exchange: it still
    gathers every one (the others never wait for it), then raises, its parity never renamed into the checkpoint;
    the others patch every stripe and finish. (Without the drain in rs_delta.update, the others' barrier breaks.)"""
    import errno
    import threading

    members, pool = group
    monkeypatch.setattr(rs_delta, "STRIPE", 4096)
    monkeypatch.setattr(rs_delta, "PATCH_PIECE", 1024)
    rng = np.random.default_rng(5)
    xors = []
    for i, m in enumerate(members):
        m["arrays"][1][rng.integers(0, m["arrays"][1].size, 40)] = -1.0 - i  # deltas of different sizes
        stats, m["state"] = _write(m["own"], m["arrays"], m["state"], pool)
        xors.append(stats.xor)
    sizes = [m["own"].stat().st_size for m in members]
    assert len({x.nbytes for x in xors}) > 1 and max(x.nbytes for x in xors) > 3 * rs_delta.STRIPE
    real, writes = rs_delta.storage.pwrite_all, []

    def full_disk(fd, data, offset):
        if "node1" in os.readlink(f"/proc/self/fd/{fd}"):
            writes.append(offset)
            if len(writes) > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(rs_delta.storage, "pwrite_all", full_disk)
    threads = ThreadGroup(SIZE)
    threads.barrier = threading.Barrier(SIZE, timeout=60)  # a member left waiting fails the test, never hangs it
    gathered = [0] * SIZE

    class Counting(BlockChannel):
        def allgather_blocks(self, block):
            gathered[self.index] += 1
            return super().allgather_blocks(block)

    def member(i):
        try:
            return rs_delta.update(Counting(threads, i), xors[i], file_fb_hash(members[i]["own"]),
                                   members[i]["dir"] / "spare.rsed", members[i]["dir"] / "new.rsed", sizes, 2)
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(SIZE) as ex:
        results = list(ex.map(member, range(SIZE)))
    stripes = -(-max(x.nbytes for x in xors) // rs_delta.STRIPE)
    assert gathered == [stripes] * SIZE
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], OSError) and results[1].errno == errno.ENOSPC
    assert not (members[1]["dir"] / "new.rsed").exists()  # never renamed into the checkpoint
    want = _reference([m["own"] for m in members])
    assert all((members[i]["dir"] / "new.rsed").read_bytes() == want[i] for i in (0, 2))
