"""Differential checkpointing on one process: files, change detection, and a model-based property test."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.dcp.delta import DeltaMismatch, apply_delta, read_payload
from ftidask.engine.recovery import load_file
from ftidask.ftiff.blockhash import FLAG_DCP
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import CheckpointError, FormatError, LevelError
from ftidask.storage.files import find_paths
from ftidask.transport.base import SerialTransport


def _kw(root: Path, **extra):
    kw = dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), enable_dcp=1,
              dcp_block_size=512, verbosity=3)
    kw.update(extra)
    return kw


def _recover_fresh(root: Path, model: dict[int, np.ndarray], **extra) -> dict[int, np.ndarray]:
    """A second process's view: init, protect arrays shaped like the model, recover."""
    ctx = ftidask.init(**_kw(root, **extra))
    assert ctx.status() == 1
    out = {vid: np.zeros_like(arr) for vid, arr in model.items()}
    for vid, arr in out.items():
        ctx.protect(vid, arr)
    ctx.recover()
    ctx._closed = True  # leave the run as it is (no finalize: the writer still owns it)
    return out


def _rank_file(ctx) -> Path:
    records = ctx.state.records()
    return ctx._rank_file(records[-1])


def _assert_same(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    assert set(got) == set(want)
    for vid in want:
        assert got[vid].dtype == want[vid].dtype and got[vid].shape == want[vid].shape
        assert got[vid].tobytes() == want[vid].tobytes(), f"variable {vid} differs"


def test_dcp_file_is_valid_ftiff_and_verified(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(10_000, dtype=np.float64)
    ctx.protect(1, a)
    info = ctx.checkpoint(1, 5)
    assert info.level == 5 and info.blocks_total == -(-a.nbytes // 512)
    path = _rank_file(ctx)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
    assert parsed.fb.flags & FLAG_DCP
    assert parsed.trailer["dcp"]["block_size"] == 512 and parsed.trailer["dcp"]["block_hash"] == "xxh3_128"
    # Damage one data byte: verification names the block; recovery refuses the file.
    meta = next(m for _b, _c, m in parsed.containers())
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + 3 * 512 + 7)
        byte = fh.read(1)
        fh.seek(meta.fptr + 3 * 512 + 7)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(path, "rb") as fh, pytest.raises(FormatError, match="data block 3"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    ctx2 = ftidask.init(**_kw(tmp_path))
    ctx2.protect(1, np.zeros_like(a))
    with pytest.raises(ftidask.NoCheckpointError):
        ctx2.recover()


def test_damaged_block_hash_section_is_detected(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.arange(5000, dtype=np.int32))
    ctx.checkpoint(1, 5)
    path = _rank_file(ctx)
    with open(path, "rb") as fh:
        fs = parse_ftiff(fh, str(path)).fb.fs
    with open(path, "r+b") as fh:
        fh.seek(fs + 5)
        fh.write(b"\x00\x01")
    with open(path, "rb") as fh, pytest.raises(FormatError, match="block hashes do not match"):
        verify_data(fh, parse_ftiff(fh, str(path)))


def test_only_changed_blocks_are_written(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.zeros(1 << 16, dtype=np.uint8)  # 128 blocks of 512 bytes
    ctx.protect(1, a)
    first = ctx.checkpoint(1, 5)
    assert first.blocks_changed == first.blocks_total == 128  # nothing to patch yet: full
    ctx.checkpoint(2, 5)  # no spare yet: full again; checkpoint 1's file becomes the spare
    same = ctx.checkpoint(3, 5)
    assert same.blocks_changed == 0 and same.bytes_written == 0
    a[700] = 1  # block 1
    one = ctx.checkpoint(4, 5)
    assert one.blocks_changed == 1 and one.bytes_written == 512 and one.blocks_total == 128
    a[-1] = 9  # last block; the spare (checkpoint 3's file) also lacks block 1
    two = ctx.checkpoint(5, 5)
    assert two.blocks_changed == 2 and two.bytes_written == 1024
    assert two.file_bytes < a.nbytes // 4
    _assert_same(_recover_fresh(tmp_path, {1: a}), {1: a})


def test_levels_and_flag(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path, enable_dcp=0))
    ctx.protect(1, np.ones(10))
    with pytest.raises(LevelError, match="enable_dcp"):
        ctx.checkpoint(1, 5)
    ctx = ftidask.init(**_kw(tmp_path / "b"))
    a = np.arange(3000.0)
    ctx.protect(1, a)
    with pytest.raises(LevelError, match="several nodes"):
        ctx.checkpoint(1, 6)
    assert ctx.checkpoint(1, 4, dcp=True).level == 8
    a[5] = -1
    info = ctx.checkpoint(2, 8)
    assert ctx.state.records()[-1].level == 4 and ctx.state.records()[-1].extra == {"dcp": True}
    assert info.blocks_total == -(-a.nbytes // 512)
    a[7] = -2
    ctx.checkpoint(3, 1)  # a plain full checkpoint between differential ones
    a[9] = -3
    ctx.checkpoint(4, 5)
    _assert_same(_recover_fresh(tmp_path / "b", {1: a}), {1: a})


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 5])
def test_every_block_hash_round_trips(tmp_path, mode):
    ctx = ftidask.init(**_kw(tmp_path, dcp_mode=mode))
    a = np.random.default_rng(mode).random(4000)
    ctx.protect(1, a)
    for i in range(1, 4):
        a[i * 100] = i
        ctx.checkpoint(i, 5)
    _assert_same(_recover_fresh(tmp_path, {1: a}, dcp_mode=mode), {1: a})


@pytest.mark.parametrize(("mode", "name"), [(1, "md5"), (2, "crc32"), (0, "md5"), (3, "xxh3_128")])
def test_dcp_mode_numbers_are_ftis(mode, name):
    """FTI reads dcp_mode 1 as MD5 and 2 as CRC32 (conf.c adds 2000: 2001, 2002); 1 was CRC32 here, so an FTI
    config asking for MD5 got a 32-bit hash."""
    from ftidask.ftiff import blockhash
    assert blockhash.block_hash(blockhash.block_hash_id(ftidask.load_config(None, dcp_mode=mode).dcp_mode))[0] == name


def test_restart_then_differential_again(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.int64)
    ctx.protect(1, a)
    for i in range(1, 4):
        a[i] = -i
        ctx.checkpoint(i, 5)
    ctx._closed = True  # the process "dies"
    ctx2 = ftidask.init(**_kw(tmp_path))
    b = np.zeros_like(a)
    ctx2.protect(1, b)
    ctx2.recover()
    assert b.tobytes() == a.tobytes()
    b[100] = 1
    first = ctx2.checkpoint(4, 5)  # the spare (checkpoint 2's file) is trusted from its own hashes
    assert first.blocks_changed == 2  # block 0 (a[3], changed at checkpoint 3) and block 1 (b[100])
    b[200] = 2
    diff = ctx2.checkpoint(5, 5)  # the recovered file is now the spare: differential
    assert diff.blocks_changed == 2
    _assert_same(_recover_fresh(tmp_path, {1: b}), {1: b})
    ctx2.finalize()
    assert not any(p.name.startswith("Spare") for p in find_paths(tmp_path / "l", "*"))


# --- property test against a model -------------------------------------------------------------

_DTYPES = [np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.float64)]

_op = st.one_of(
    st.tuples(st.just("poke"), st.integers(0, 2), st.lists(st.integers(0, 10**6), min_size=1, max_size=4)),
    st.tuples(st.just("region"), st.integers(0, 2), st.integers(0, 10**6), st.integers(1, 3000)),
    st.tuples(st.just("resize"), st.integers(0, 2), st.integers(0, 6000)),
    st.tuples(st.just("checkpoint"), st.sampled_from([5, 5, 5, 1, 8])),
)


def _apply(op, arrays: dict[int, np.ndarray], rng: np.random.Generator) -> None:
    kind, vid = op[0], op[1]
    arr = arrays[vid]
    if kind == "poke" and arr.size:
        for pos in op[2]:
            arr.reshape(-1)[pos % arr.size] = rng.integers(0, 100)
    elif kind == "region" and arr.size:
        start = op[2] % arr.size
        arr.reshape(-1)[start:start + op[3]] = rng.integers(0, 100, size=len(arr.reshape(-1)[start:start + op[3]]))
    elif kind == "resize":
        new = np.zeros(op[2], arr.dtype)
        keep = min(op[2], arr.size)
        new[:keep] = arr.reshape(-1)[:keep]  # growth adds a container, shrinking empties some
        arrays[vid] = new


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=14), seed=st.integers(0, 2**16))
def test_recovery_equals_state_at_each_checkpoint(ops, seed):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ctx = ftidask.init(**_kw(root))
        arrays = {vid: rng.integers(0, 100, size=int(rng.integers(0, 4000))).astype(_DTYPES[vid])
                  for vid in range(3)}
        for vid, arr in arrays.items():
            ctx.protect(vid, arr)
        ckpt = 0
        for op in [*ops, ("checkpoint", 5)]:
            if op[0] != "checkpoint":
                _apply(op, arrays, rng)
                for vid, arr in arrays.items():
                    if ctx.protected[vid] is not arr:
                        ctx.protect(vid, arr)
                continue
            ckpt += 1
            info = ctx.checkpoint(ckpt, op[1])
            assert info.bytes_written <= sum(a.nbytes for a in arrays.values())
            _assert_same(_recover_fresh(root, arrays), arrays)
            path = _rank_file(ctx)
            with open(path, "rb") as fh:
                verify_data(fh, parse_ftiff(fh, str(path)))
        ctx.finalize()
        leftovers = [p for p in find_paths(root, "*.fti")]
        assert leftovers == [], leftovers


def test_non_contiguous_and_fortran_arrays(tmp_path):
    ctx = ftidask.init(**_kw(tmp_path))
    base = np.arange(40_000, dtype=np.float32).reshape(200, 200)
    view = base[::2, 1::3]  # not contiguous: copied in pieces
    fort = np.asfortranarray(np.arange(6000, dtype=np.int32).reshape(60, 100))
    ctx.protect(1, view)
    ctx.protect(2, fort)
    for i in range(1, 5):
        view[i, i] = -i
        fort[i, :] = i
        ctx.checkpoint(i, 5)
    got = _recover_fresh(tmp_path, {1: np.ascontiguousarray(view), 2: fort})
    assert got[1].tobytes() == np.ascontiguousarray(view).tobytes()
    assert np.array_equal(got[2], fort)


def test_failed_differential_checkpoint_keeps_previous(tmp_path, monkeypatch):
    from ftidask.engine import dcpstore

    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(5000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 5)
    ctx.checkpoint(2, 5)
    saved = a.copy()
    a[3] = 42

    def full_disk(*_args, **_kw):  # patching the spare fails as on a full disk
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(dcpstore, "DcpFileWriter", full_disk)
        with pytest.raises(CheckpointError, match="previous checkpoint is kept"):
            ctx.checkpoint(3, 5)
    _assert_same(_recover_fresh(tmp_path, {1: a}), {1: saved})
    a[4] = 43
    info = ctx.checkpoint(4, 5)  # works again (the spare was not touched: its record still describes it)
    assert info.blocks_changed >= 1
    _assert_same(_recover_fresh(tmp_path, {1: a}), {1: a})


class _RecordingTransport(SerialTransport):
    """One process; keeps the deltas the engine hands to the level hook."""

    def __init__(self) -> None:
        self.deltas = []

    def protect_files_delta(self, level, ckpt_id, own_file, ckpt_dir, delta, xor=None):
        self.deltas.append((own_file, delta))
        super().protect_files_delta(level, ckpt_id, own_file, ckpt_dir, delta, xor=xor)


def test_delta_rebuilds_the_new_file_from_a_copy_of_its_base(tmp_path):
    t = _RecordingTransport()
    ctx = ftidask.Context(ftidask.load_config(**_kw(tmp_path)), t)
    a = np.arange(100_000, dtype=np.float64)
    ctx.protect(1, a)
    ctx.checkpoint(1, 5)
    ctx.checkpoint(2, 5)
    assert [d for _f, d in t.deltas] == [None, None]  # full writes: no base, no delta
    t.deltas.clear()
    partner_copy = tmp_path / "partner" / "spare.fti"
    partner_copy.parent.mkdir()
    shutil.copyfile(ctx._dcp.spare_path(1), partner_copy)  # what a partner would keep
    a[10] = -1
    a[50_000:50_100] = -2
    info = ctx.checkpoint(3, 5)
    (own, delta), = t.deltas
    assert delta.nbytes < 4 * info.file_bytes and delta.nbytes < a.nbytes // 20
    rebuilt = tmp_path / "partner" / "Ckpt3-Pcof0.fti"
    apply_delta(partner_copy, rebuilt, delta, read_payload(own, delta))
    with open(rebuilt, "rb") as fh:
        parsed = parse_ftiff(fh, str(rebuilt))
        verify_data(fh, parsed)
    with open(own, "rb") as fh:
        assert parse_ftiff(fh, str(own)).fb.hash == parsed.fb.hash
    b = np.zeros_like(a)
    load_file(parsed, {1: b})
    assert b.tobytes() == a.tobytes()
    # A partner whose base differs is told so (it must get the whole file).
    with pytest.raises(DeltaMismatch):
        apply_delta(rebuilt, tmp_path / "x.fti", delta, read_payload(own, delta))


def test_cli_inspects_and_verifies_a_dcp_file(tmp_path, capsys):
    from ftidask.tools.cli import main

    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(20_000, dtype=np.float64)
    ctx.protect(1, a)
    for i in range(1, 4):
        a[i * 3000] = -i
        ctx.checkpoint(i, 5)
    path = _rank_file(ctx)
    assert main(["inspect", str(path)]) == 0
    assert "Differential (dCP): blocks of 512 bytes, block hash xxh3_128" in capsys.readouterr().out
    assert main(["verify", str(path)]) == 0
    capsys.readouterr()
    with open(path, "r+b") as fh:
        fh.seek(parse_ftiff(fh, str(path)).blocks[0][1][0].fptr + 512 * 10)
        fh.write(b"\xff\xfe")
    assert main(["verify", str(path)]) != 0
    assert "data block 10 does not match" in capsys.readouterr().out


def test_stateless_differential_writes_for_task_based_backends(tmp_path):
    """What a Dask task does: no state between checkpoints, the spare's digests read from the file."""
    from concurrent.futures import ThreadPoolExecutor

    from ftidask.engine.dcpstore import write_differential
    from ftidask.ftiff.layout import plan_layout
    from ftidask.model.arrays import ArrayBytes, VarInfo

    pool = ThreadPoolExecutor(2)
    a = np.arange(50_000, dtype=np.float64)
    layout = plan_layout(None, [(1, a.nbytes)])
    spare = tmp_path / "dcp" / "Spare-Rank0.fti"

    def write(n, expected):
        final = tmp_path / f"ckpt{n}" / "Ckpt-Rank0.fti"
        written, stats = write_differential(spare, final, expected, layout, {1: ArrayBytes(a)},
                                            [VarInfo.of(1, "a", a)], {"format": "ftidask"}, block_size=512,
                                            bid=4, hash_id=2, pool=pool)
        return final, written, stats

    f1, w1, s1 = write(1, None)
    f2, w2, s2 = write(2, None)
    assert s1.blocks_changed == s2.blocks_changed == s1.blocks_total
    os.replace(f1, spare)  # checkpoint 1 retired: the backend keeps its file as the spare
    a[100] = -1
    f3, w3, s3 = write(3, w1.fb.hash)  # the client passes the hash from checkpoint 1's commit record
    assert s3.blocks_changed == 1
    got = _read(f3, a)
    assert got.tobytes() == a.tobytes()
    # A spare torn by a crash while it was patched is never trusted: its FB was invalidated first.
    os.replace(f2, spare)
    with open(spare, "r+b") as fh:
        fh.write(bytes(96))  # what a kill after the writer's first step leaves
    a[200] = -2
    f4, w4, s4 = write(4, w2.fb.hash)
    assert s4.blocks_changed == s4.blocks_total
    assert _read(f4, a).tobytes() == a.tobytes()
    # A wrong expected hash (another file) is not trusted either.
    os.replace(f3, spare)
    a[300] = -3
    _f5, _w5, s5 = write(5, w1.fb.hash)
    assert s5.blocks_changed == s5.blocks_total
    pool.shutdown()


def _read(path, like):
    out = np.zeros_like(like)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
    load_file(parsed, {1: out})
    return out


def test_inconsistent_dcp_tables_are_refused(tmp_path):
    """A table that lies about the block-hash section is a FormatError, never a wrong read."""
    import dataclasses
    import json

    from ftidask.ftiff import hashing
    from ftidask.ftiff.structs import FB_SIZE
    from ftidask.ftiff.trailer import pack_trailer

    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.arange(3000.0))
    ctx.checkpoint(1, 5)
    path = _rank_file(ctx)
    raw = path.read_bytes()
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    section = raw[parsed.fb.fs:parsed.fb.fs + parsed.trailer["dcp"]["section_len"]]

    def rewrite(table, name):
        # A well-formed file (valid FB and metadata checksum) around a tampered table.
        tail = pack_trailer(json.dumps(table).encode())
        checksum = hashing.new_hasher(parsed.fb.hash_id)
        for bmd, metas in parsed.blocks:
            checksum.update(bmd.pack() + b"".join(m.pack() for m in metas))
        checksum.update(tail)
        fb = dataclasses.replace(parsed.fb, checksum=checksum.hexdigest()[:32]).sealed()
        out = tmp_path / name
        out.write_bytes(fb.pack() + raw[FB_SIZE:parsed.fb.fs] + section + tail)
        return out

    good = rewrite(dict(parsed.trailer), "same.fti")
    with open(good, "rb") as fh:
        verify_data(fh, parse_ftiff(fh, str(good)))  # the rewriting itself is sound
    for change, match in ((lambda d: d.pop("dcp"), "no 'dcp' entry"),
                          (lambda d: d["dcp"].update(section_len=16), "block-hash section"),
                          (lambda d: d["dcp"].update(block_size=1024), "block-hash section"),
                          (lambda d: d["dcp"].update(block_size=100), "outside"),
                          (lambda d: d["dcp"].update(block_hash_id=99), "unknown block hash")):
        table = json.loads(json.dumps(parsed.trailer))
        change(table)
        bad = rewrite(table, "bad.fti")
        with open(bad, "rb") as fh, pytest.raises(FormatError, match=match):
            verify_data(fh, parse_ftiff(fh, str(bad)))


def test_dcp_and_icp_with_a_compressor_configured(tmp_path):
    """Compressed containers cannot be patched in place: dCP and iCP files are stored uncompressed."""
    pytest.importorskip("numcodecs")
    ctx = ftidask.init(**_kw(tmp_path, compressor="zstd"))
    a = np.zeros(50_000)
    ctx.protect(1, a)
    plain = ctx.checkpoint(1, 1)  # compressed: zeros shrink
    assert plain.bytes_written < a.nbytes // 10
    for i in range(2, 5):
        a[i * 1000] = i
        info = ctx.checkpoint(i, 5)
    assert info.blocks_changed == 2 and info.bytes_written == 1024
    _assert_same(_recover_fresh(tmp_path, {1: a}, compressor="zstd"), {1: a})
    with pytest.raises(CheckpointError, match="uncompressed"):
        ctx.init_icp(9, 1)
    ctx.init_icp(9, 5)  # differential iCP is uncompressed anyway
    ctx.add_var_icp(1)
    ctx.finalize_icp()


def test_recover_at_a_differential_level_says_which_level_to_ask(tmp_path):
    """A checkpoint written at level 5 (L1_DCP) is recorded at level 1: recover(level=5) finds nothing, and says to
    ask for level 1 (before: only "no committed checkpoint ... (level=5)")."""
    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.arange(1000.0))
    ctx.checkpoint(1, 5)
    ctx._close()
    ctx2 = ftidask.init(**_kw(tmp_path))
    ctx2.protect(1, np.zeros(1000))
    with pytest.raises(ftidask.NoCheckpointError, match=r"\(level=5\): a differential checkpoint \(level 5\) is "
                                                        r"recorded at its base level, recover\(level=1\)"):
        ctx2.recover(level=5)
    assert ctx2.recover(level=1)[1].tobytes() == np.arange(1000.0).tobytes()
    ctx2.finalize()


def test_finalize_when_another_rank_removed_the_shared_l4_spare_directory_meanwhile(tmp_path, monkeypatch):
    """Found by the MPI crash campaign (3 ranks, seed 5): L4's spare directory ``{glbl}/{exec}/l4/dcp`` is every
    rank's; one rank's finalize removed it between another's look at it and its listing of its trash there, and that
    finalize failed (ENOENT). Here the directory really goes at that moment: the finalize ends the run all the same."""
    import os
    import shutil

    ctx = ftidask.init(**_kw(tmp_path))
    ctx.protect(1, np.arange(4096.0))
    for ckpt in (1, 2, 3):
        ctx.checkpoint(ckpt, 8)
    shared = ctx._dcp.spare_path(4).parent
    assert shared.is_dir()
    real = os.scandir

    def scandir(path=".", *args):
        if str(path) == str(shared) and shared.exists():
            shutil.rmtree(shared)  # another rank's clear, just now
        return real(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    ctx.finalize()
    monkeypatch.undo()
    assert ftidask.init(**_kw(tmp_path)).status() == 0


@pytest.mark.parametrize("level", [5, 8])
@pytest.mark.parametrize("planted", ["directory link", "spare link", "spare fifo", "directory a file"])
def test_odd_things_at_the_spares_place_are_cleared_never_followed(tmp_path, level, planted):
    """A link at the spares' directory (l{n}/dcp) was followed: the spares were written, then removed at finalize,
    in the directory it pointed to. A link or FIFO at the spare's own name, or a file at the directory's, failed
    every later differential checkpoint of the level, across restarts. Cleared now; nothing outside is touched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "Spare-Rank0.fti").write_bytes(b"someone else's")
    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "enable_dcp": 1, "exec_id": "run"}
    ctx = ftidask.init(**dirs)
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, level)
    ctx.checkpoint(2, level)  # checkpoint 1's file is the spare now
    (spare,) = [p for p in tmp_path.rglob("Spare-Rank0.fti") if outside not in p.parents]
    place = spare.parent
    if planted == "directory link":
        shutil.rmtree(place)
        place.symlink_to(outside)
    elif planted == "directory a file":
        shutil.rmtree(place)
        place.write_text("x")
    elif planted == "spare link":
        spare.unlink()
        spare.symlink_to(outside / "Spare-Rank0.fti")
    else:
        spare.unlink()
        os.mkfifo(spare)
    for ckpt in (3, 4):
        a += 1
        ctx.checkpoint(ckpt, level)
    ctx._close()
    again = ftidask.init(**dirs)
    got = np.zeros(1000)
    again.protect(1, got)
    again.recover()
    assert again.recovered_from[0] == 4 and (got == a).all()
    again.checkpoint(5, level)
    again.finalize()
    assert sorted(p.name for p in outside.iterdir()) == ["Spare-Rank0.fti"]
    assert (outside / "Spare-Rank0.fti").read_bytes() == b"someone else's"
