"""L2 and L3 in one process: the level code over a group of threads (transport.threads).

The same `levels.multilevel.protect` / `rebuild` that the MPI and Dask backends run, on a simulated
group whose members are threads and whose nodes are directories: every loss pattern of a group is
checked against the rule of its level, in milliseconds, with the rebuilt files compared byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftidask.levels import multilevel, rs
from ftidask.levels.erasure import decode_files
from ftidask.model.config import Config
from ftidask.storage import files as storage
from ftidask.transport.threads import run_group

CKPT = 1
CFG = Config(block_size=1, transfer_size=1)  # 1 KiB stripes, 1 MiB pieces: several stripes per file


def own(base: Path, i: int) -> Path:
    return base / f"node{i}" / storage.rank_file(CKPT, i)


def redundancy(base: Path, level: int, i: int) -> Path:
    name = storage.partner_file(CKPT, i) if level == 2 else storage.parity_file(CKPT, i)
    return base / f"node{i}" / name


def make_group(base: Path, level: int, sizes: list[int], seed: int) -> dict[int, bytes]:
    """Every member's file, then the level's redundancy written by the group; the files' bytes."""
    rng = np.random.default_rng(seed)
    data = {}
    for i, n in enumerate(sizes):
        own(base, i).parent.mkdir(parents=True, exist_ok=True)  # a node directory may be a mount (test_io_faults)
        data[i] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        own(base, i).write_bytes(data[i])

    def protect(ch):
        return multilevel.protect(ch, CFG, level, CKPT, ch.index, own(base, ch.index), own(base, ch.index).parent,
                                  sizes)

    errors_by_member, errors = run_group(len(sizes), protect)
    assert errors == [] and not any(errors_by_member), (errors, errors_by_member)
    return data


def rebuild(base: Path, level: int, sizes: list[int], data: dict[int, bytes],
            also: dict[int, bytes] | None = None) -> list[bool]:
    """``also``: a member's file that verifies too (a byte changed where its own hashes do not look)."""
    def sound(i: int):
        ok = {hashlib.sha256(data[i]).digest()} | ({hashlib.sha256(also[i]).digest()} if i in (also or {}) else set())
        return lambda p: p.exists() and hashlib.sha256(p.read_bytes()).digest() in ok

    def step(ch):
        i, g = ch.index, ch.size
        own(base, i).parent.mkdir(parents=True, exist_ok=True)  # a lost node's directory comes back
        return multilevel.rebuild(ch, CFG, level, CKPT, i, own(base, i), own(base, i).parent, sizes,
                                  sound(i)(own(base, i)), verify_own=sound(i), verify_partner=sound((i - 1) % g))

    results, errors = run_group(len(sizes), step)
    assert errors == []
    return results


def lose(base: Path, level: int, i: int, what: str, how: str) -> None:
    path = own(base, i) if what == "own" else redundancy(base, level, i)
    if how == "erase":
        path.unlink(missing_ok=True)
    elif path.exists() and path.stat().st_size:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))


def expected(level: int, g: int, lost: set[tuple[int, str]]) -> list[bool]:
    """Which members have their file after a rebuild, by the level's rule."""
    own_lost = {i for i, w in lost if w == "own"}
    if level == 2:  # member i's file comes back from member i+1's partner copy
        return [i not in own_lost or (((i + 1) % g, "red") not in lost) for i in range(g)]
    if len(lost) <= g:  # L3: any g of the 2g files rebuild the rest
        return [True] * g
    return [i not in own_lost for i in range(g)]


@pytest.mark.parametrize("level", [2, 3])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_loss_pattern_follows_the_levels_rule(tmp_path_factory, level, data):
    g = data.draw(st.integers(2, 5), label="group size")
    sizes = data.draw(st.lists(st.integers(0, 5000), min_size=g, max_size=g), label="sizes")
    lost = data.draw(st.sets(st.tuples(st.integers(0, g - 1), st.sampled_from(["own", "red"]))), label="lost")
    how = data.draw(st.sampled_from(["erase", "corrupt"]), label="how")
    base = tmp_path_factory.mktemp("group")
    files = make_group(base, level, sizes, seed=g)
    reference = {i: redundancy(base, level, i).read_bytes() for i in range(g)}
    effective = {(i, w) for i, w in lost if how == "erase" or (sizes[i] if w == "own" else
                                                               len(reference[i])) > 0}
    for i, what in lost:
        lose(base, level, i, what, how)
    want = expected(level, g, effective)
    assert rebuild(base, level, sizes, files) == want
    for i in range(g):
        if want[i]:
            assert own(base, i).read_bytes() == files[i]
    own_lost = any(w == "own" for _, w in effective)
    if all(want) and own_lost:
        for i in range(g):  # a loss was repaired: the redundancy is whole again too
            assert redundancy(base, level, i).read_bytes() == reference[i]
    elif not own_lost and how == "erase":  # every own file sound: an erased redundancy file is rebuilt (a stat)
        for i in range(g):
            assert redundancy(base, level, i).read_bytes() == reference[i]
    elif not own_lost:  # every own file sound, redundancy damaged in place: not touched (the next checkpoint's)
        for i in range(g):
            assert redundancy(base, level, i).exists()
    shutil.rmtree(base)


# Every file a test opens while this list is installed (an audit hook sees every open, in every thread).
_opened: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened and isinstance(args[0], (str, bytes, Path)):
        _opened[-1].append(str(args[0]))


sys.addaudithook(_audit)


def opened_during(fn):
    """``fn()``'s result and the paths opened meanwhile."""
    _opened.append([])
    try:
        return fn(), _opened[-1]
    finally:
        _opened.pop()


def is_redundancy(path: str) -> bool:
    return "Pcof" in path or "RSed" in path


@pytest.mark.parametrize("level", [2, 3])
def test_a_recovery_with_nothing_lost_reads_no_redundancy(tmp_path, level):
    sizes = [3000, 1, 4097, 2048]
    files = make_group(tmp_path, level, sizes, seed=3)
    result, paths = opened_during(lambda: rebuild(tmp_path, level, sizes, files))
    assert result == [True] * 4
    assert [p for p in paths if is_redundancy(p)] == []  # zero bytes read from partner copies or parity
    # the seam sees the redundancy when a loss needs it
    own(tmp_path, 1).unlink()
    result, paths = opened_during(lambda: rebuild(tmp_path, level, sizes, files))
    assert result == [True] * 4 and any(is_redundancy(p) for p in paths)


@pytest.mark.parametrize("level", [2, 3])
def test_erased_redundancy_beside_sound_files_is_rebuilt(tmp_path, level):
    """Sound own files, a partner copy / parity erased (a stat finds it): the rebuild brings it back, the same
    bytes, so that a later loss that needs it is recovered (FTI's ckpt_consistency)."""
    sizes = [3000, 1, 4097, 2048]
    files = make_group(tmp_path, level, sizes, seed=5)
    reference = redundancy(tmp_path, level, 1).read_bytes()
    lose(tmp_path, level, 1, "red", "erase")
    assert rebuild(tmp_path, level, sizes, files) == [True] * 4
    assert redundancy(tmp_path, level, 1).read_bytes() == reference
    own(tmp_path, 0 if level == 2 else 1).unlink()  # L2: member 1 keeps member 0's copy
    assert rebuild(tmp_path, level, sizes, files) == [True] * 4
    for i in range(4):
        assert own(tmp_path, i).read_bytes() == files[i]


@pytest.mark.parametrize("level", [2, 3])
def test_damaged_redundancy_beside_sound_files_is_never_trusted_later(tmp_path, level):
    """Sound own files: a damaged partner copy / parity (its size kept) is left for the next checkpoint, and a
    later loss that needs it finds it damaged (a clean failure at L2, a rebuild from the other files at L3),
    never wrong data."""
    sizes = [3000, 1, 4097, 2048]
    files = make_group(tmp_path, level, sizes, seed=5)
    reference = redundancy(tmp_path, level, 1).read_bytes()
    lose(tmp_path, level, 1, "red", "corrupt")
    damaged = redundancy(tmp_path, level, 1).read_bytes()
    assert rebuild(tmp_path, level, sizes, files) == [True] * 4
    assert redundancy(tmp_path, level, 1).read_bytes() == damaged  # not repaired, not read
    for i in range(4):
        assert own(tmp_path, i).read_bytes() == files[i]
    # L2: member 1 keeps member 0's copy, so losing member 0's file now is a loss for good
    # L3: 2 of 8 files lost, the other 6 rebuild both, the damaged parity included
    lost = 0 if level == 2 else 1
    own(tmp_path, lost).unlink()
    got = rebuild(tmp_path, level, sizes, files)
    if level == 2:
        assert got == [False, True, True, True]
        assert not own(tmp_path, 0).exists() or own(tmp_path, 0).read_bytes() != files[0]
    else:
        assert got == [True] * 4
        assert own(tmp_path, 1).read_bytes() == files[1]
        assert redundancy(tmp_path, level, 1).read_bytes() == reference  # the damaged parity rebuilt too
    for i in range(4):
        if got[i]:
            assert own(tmp_path, i).read_bytes() == files[i]


def test_verify_checks_parity_against_its_record(tmp_path, capsys):
    """`ftidask verify` is how to check the redundancy that a recovery with nothing lost does not read."""
    from ftidask.tools.cli import main

    make_group(tmp_path, 3, [3000, 1, 4097], seed=9)
    parity = redundancy(tmp_path, 3, 1)
    assert main(["verify", str(parity)]) == 0
    lose(tmp_path, 3, 1, "red", "corrupt")
    assert main(["verify", str(parity)]) == 1
    assert "does not match its recorded hash" in capsys.readouterr().out


class _Faulty:
    """A member's group channel whose ``nth`` exchange raises before it is made (a bug in the member's level step)."""

    def __init__(self, ch, nth: int) -> None:
        self.ch, self.nth, self.calls = ch, nth, 0
        self.index, self.size = ch.index, ch.size

    def _tick(self) -> None:
        self.calls += 1
        if self.calls == self.nth:
            raise RuntimeError("injected channel failure")

    def allgather(self, value):
        self._tick()
        return self.ch.allgather(value)

    def allgather_blocks(self, block):
        self._tick()
        return self.ch.allgather_blocks(block)

    def exchange(self, *args):
        self._tick()
        return self.ch.exchange(*args)


@pytest.mark.parametrize("level", [2, 3])
@pytest.mark.parametrize("nth", [1, 3])
def test_a_member_failing_inside_the_level_keeps_the_group_in_step(tmp_path, level, nth):
    """``multilevel.protect_in_step`` (the MPI heads' L2/L3): an exception escaping the level code on one member
    (its channel raising before its first, or third, exchange) is that member's error, and it takes part in the
    rest of the group's exchanges without its file: the other members end the level (no broken or timed-out
    collective, which ``multilevel.protect`` leaves them in) and write their redundancy."""
    sizes = [2_500_000, 2_400_000, 2_600_000, 2_500_000] if level == 2 else [5000, 4000, 6000, 5000]
    for i, n in enumerate(sizes):
        own(tmp_path, i).parent.mkdir(parents=True)
        own(tmp_path, i).write_bytes(bytes([i + 1]) * n)

    def step(ch):
        chan = _Faulty(ch, nth) if ch.index == 1 else ch
        return multilevel.protect_in_step(chan, CFG, level, CKPT, ch.index, own(tmp_path, ch.index),
                                          own(tmp_path, ch.index).parent, sizes)

    results, errors = run_group(len(sizes), step, wait=30)
    assert errors == [] and "injected channel failure" in results[1], (errors, results)
    assert [results[i] for i in (0, 2, 3)] == [""] * 3, results
    assert all(redundancy(tmp_path, level, i).is_file() for i in (0, 2, 3))


def _flip_unhashed(base: Path, i: int, files: dict[int, bytes], at: int = 100) -> dict[int, bytes]:
    """Member ``i``'s file with a byte changed where its own checks (here: ``rebuild``'s ``also``) do not look, as in
    FTI-FF's container slack: its verifier accepts it."""
    flipped = bytearray(files[i])
    flipped[at] ^= 0xFF
    own(base, i).write_bytes(bytes(flipped))
    return {i: bytes(flipped)}


def test_l3_rebuild_takes_the_parity_first_never_a_file_changed_where_no_hash_looks(tmp_path):
    """A byte flipped in a member's file where its hashes do not look (FTI-FF's container slack: the member's file
    still verifies) must not spoil the rebuild of another member's lost file: with every parity file but the lost
    node's whole (each checked against its .hash record), the decoding takes them first. Before, it took the data
    files first, and the lost file came back wrong: a NoCheckpointError for a group within its tolerance (found by
    tests/test_mpi_random_sequences.py, dcp-n1g4, a node lost after a byte of another rank's file was flipped).
    The flipped file does not match the whole-file hash the parity records keep: it is rebuilt as it was written."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=7)
    also = _flip_unhashed(tmp_path, 1, files)
    own(tmp_path, 2).unlink()  # node 2 lost: its file and its parity
    redundancy(tmp_path, 3, 2).unlink()
    assert rebuild(tmp_path, 3, sizes, files, also) == [True] * 4
    assert own(tmp_path, 2).read_bytes() == files[2]
    assert own(tmp_path, 1).read_bytes() == files[1]


def test_l3_a_file_changed_where_no_hash_looks_is_no_input_when_a_parity_is_lost_too(tmp_path):
    """Member 1's parity and member 2's file lost, member 0's file changed where its own hashes do not look: the
    decoding needs a data file besides the three parity files left, and member 0's would be the first. Its
    whole-file hash (kept by every parity's record, as FTI's L3 metadata keeps each rank's checksum) is not the
    recorded one: it counts as lost, member 3's file is the input, and members 0 and 2 come back bit for bit. Before,
    member 0's file spoiled member 2's rebuild (a checkpoint within L3's tolerance lost)."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=8)
    record_path = redundancy(tmp_path, 3, 0).with_name(redundancy(tmp_path, 3, 0).name + ".hash")
    also = _flip_unhashed(tmp_path, 0, files)
    redundancy(tmp_path, 3, 1).unlink()
    own(tmp_path, 2).unlink()
    assert rebuild(tmp_path, 3, sizes, files, also) == [True] * 4
    assert [own(tmp_path, i).read_bytes() for i in range(4)] == [files[i] for i in range(4)]
    record = json.loads(record_path.read_text())
    assert sorted(record["file_hashes"]) == sorted(own(tmp_path, i).name for i in range(4))
    again = redundancy(tmp_path, 3, 1)  # the rebuilt parity keeps the group's whole-file hashes
    assert json.loads(again.with_name(again.name + ".hash").read_text())["file_hashes"] == record["file_hashes"]


def test_l3_files_known_to_differ_rebuild_no_parity_when_they_must_be_inputs(tmp_path):
    """Parities 1 and 2 and file 3 lost, files 0 and 1 changed where their own hashes do not look: two parity files
    and one exact file are not enough, so file 0 is an input after all (as without whole-file hashes). File 3, spoiled
    by it, fails its check; the lost parity files are not rebuilt from it (a rebuilt parity is recorded as sound
    without a check: it would spoil a later rebuild), the next checkpoint writes them."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=8)
    also = {**_flip_unhashed(tmp_path, 0, files), **_flip_unhashed(tmp_path, 1, files)}
    for i in (1, 2):
        redundancy(tmp_path, 3, i).unlink()
    own(tmp_path, 3).unlink()
    assert rebuild(tmp_path, 3, sizes, files, also) == [True, True, True, False]
    assert not redundancy(tmp_path, 3, 1).exists() and not redundancy(tmp_path, 3, 2).exists()
    assert [own(tmp_path, i).read_bytes() for i in range(2)] == [also[0], also[1]]  # left as they are


def test_l3_records_without_whole_file_hashes_rebuild_as_before(tmp_path):
    """Parity records of an older version (no whole-file hashes): a sound file is not read again, and the case above
    still loses member 2's file (its rebuild fails its checks: never wrong data)."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=8)
    for i in range(4):
        path = redundancy(tmp_path, 3, i).with_name(redundancy(tmp_path, 3, i).name + ".hash")
        record = json.loads(path.read_text())
        del record["file_hashes"]
        path.write_text(json.dumps(record))
    also = _flip_unhashed(tmp_path, 0, files)
    redundancy(tmp_path, 3, 1).unlink()
    own(tmp_path, 2).unlink()
    assert rebuild(tmp_path, 3, sizes, files, also) == [True, True, False, True]
    assert own(tmp_path, 0).read_bytes() == also[0]


@pytest.mark.parametrize("forge", [
    {"hash_id": 999}, {"hash_id": "xxh3"}, {"hash_id": -1}, {"file_hashes": [1, 2]}, {"fb_hashes": {"a": 1}},
    "file_hashes: zeros", "file_hashes: not hex"])
def test_l3_forged_parity_records_never_rebuild_wrong_bytes(tmp_path, forge):
    """Every parity's ``.hash`` record forged (untrusted bytes), a parity and a data file lost: the rebuild raises
    nothing, and every file it gives back is the one written. A record whose hash id is not the parity's makes no
    parity trusted (3 data files are too few: member 2 stays lost); forged whole-file hashes leave the decoding to
    the files' own checks."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=8)
    for i in range(4):
        path = redundancy(tmp_path, 3, i).with_name(redundancy(tmp_path, 3, i).name + ".hash")
        record = json.loads(path.read_text())
        if isinstance(forge, dict):
            record.update(forge)
        else:
            record["file_hashes"] = {name: "00" * 16 if forge.endswith("zeros") else "zz"
                                     for name in record["file_hashes"]}
        path.write_text(json.dumps(record))
    redundancy(tmp_path, 3, 1).unlink()
    own(tmp_path, 2).unlink()
    back = rebuild(tmp_path, 3, sizes, files)
    assert back[:2] == [True, True] and back[3]
    assert back[2] == (not (isinstance(forge, dict) and "hash_id" in forge))
    assert all(own(tmp_path, i).read_bytes() == files[i] for i in range(4) if back[i])


@pytest.mark.parametrize("hashes", [True, False])
def test_l3_decode_inputs_never_take_an_unhashed_data_file_before_a_parity(tmp_path, hashes):
    """``rs.decode_inputs`` (the one-process choice of a Dask chunk read's L3 rebuild) follows ``rebuild``'s rule: a
    data file is taken before the parity files only when the records keep its whole-file hash and it matches. With
    records of an older version (no ``file_hashes``), member 1's file changed where its own hashes do not look would be
    an input where the parity files suffice; before, it was (data files first), and the decoded file came out wrong."""
    sizes = [3000, 3100, 2900, 3050]
    files = make_group(tmp_path, 3, sizes, seed=9)
    if not hashes:  # an older version's records
        for i in range(4):
            path = redundancy(tmp_path, 3, i).with_name(redundancy(tmp_path, 3, i).name + ".hash")
            record = json.loads(path.read_text())
            del record["file_hashes"]
            path.write_text(json.dumps(record))
    _flip_unhashed(tmp_path, 1, files)
    own(tmp_path, 2).unlink()  # node 2 lost
    redundancy(tmp_path, 3, 2).unlink()
    data, parity, _why = rs.decode_inputs([str(own(tmp_path, i)) for i in range(4)],
                                          [str(redundancy(tmp_path, 3, i)) for i in range(4)], 2, sizes)
    assert data[1] is None
    assert sum(p is not None for p in data + parity) == 4
    out = tmp_path / "rebuilt"
    out.touch()
    decode_files(data, parity, sizes, {2: str(out)})
    assert out.read_bytes() == files[2]
