"""Files written by FTI 1.1 are read; hostile files are refused before any large allocation."""

import json
import struct
import tracemalloc

import numpy as np
import pytest
from ftiff_builders import fti11_file

import ftidask
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.tools.cli import main as cli_main


def _fti11(tmp_path):
    a = np.arange(1000, dtype=np.int32)
    b = np.linspace(0, 1, 300)
    # var 1 in two containers (it grew), var 2 in one container that is partly filled (it shrank).
    raw = fti11_file({1: a.tobytes(), 2: b.tobytes()},
                     [[(1, 0, 0, 0, 2400), (2, 1, 0, 0, 3200)], [(1, 0, 1, 2400, 1600)]])
    path = tmp_path / "Ckpt1-Rank0.fti"
    path.write_bytes(raw)
    return path, a, b


def test_fti11_inspect_verify_recover(tmp_path, dirs, capsys):
    path, a, b = _fti11(tmp_path)
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FTI 1.1 file (MD5)" in out and "containersize: 3200" in out and "chunksize: 2400" in out
    assert cli_main(["verify", str(path)]) == 0
    ctx = ftidask.init(**dirs)
    x, y = np.zeros(1000, np.int32), np.zeros(300)
    ctx.protect(1, x)
    ctx.protect(2, y)
    ctx.recover_file(path)
    assert x.tobytes() == a.tobytes() and y.tobytes() == b.tobytes()
    # A wrong size is refused without touching anything.
    ctx.protect(2, np.zeros(10))
    with pytest.raises(ftidask.RecoveryError, match="3200|2400|bytes"):
        ctx.recover_file(path)


def test_fti11_damage_detected(tmp_path, dirs):
    path, _a, _b = _fti11(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1
    path.write_bytes(bytes(raw))
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        with pytest.raises(ftidask.FormatError, match="hash does not match|checksum"):
            verify_data(fh, parsed)


def test_fti11_file_block_holds_ftis_values(tmp_path):
    """FTI 1.1 writes ckptSize = fs = the whole file's size, and -1 for ptFs/maxFs at L1/L4."""
    path, _a, _b = _fti11(tmp_path)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
    fb = parsed.fb
    assert fb.legacy and fb.ckpt_size == fb.fs == path.stat().st_size
    assert (fb.pt_fs, fb.max_fs) == (-1, -1)
    assert sum(m.chunksize for _b, _c, m in parsed.containers()) < fb.ckpt_size


@pytest.mark.parametrize("sizes", [{"pt_fs": 7000}, {"max_fs": 9000}])
def test_fti11_l2_l3_files_recover(tmp_path, dirs, sizes):
    a = np.arange(500, dtype=np.float64)
    path = tmp_path / "Ckpt3-Rank1.fti"
    path.write_bytes(fti11_file({7: a.tobytes()}, [[(7, 0, 0, 0, a.nbytes)]], **sizes))
    ctx = ftidask.init(**dirs)
    x = np.zeros_like(a)
    ctx.protect(7, x)
    ctx.recover_file(path)
    assert x.tobytes() == a.tobytes()


@pytest.mark.parametrize("ckpt_size, ok", [(None, True), (4000 + 2400, True), (12345, False)])
def test_fti11_ckpt_size_checked(tmp_path, ckpt_size, ok):
    """A legacy ckptSize is the file size (what FTI writes) or the data size (what its documentation
    says); anything else is refused."""
    a = np.arange(1000, dtype=np.int32)
    b = np.linspace(0, 1, 300)
    path = tmp_path / "Ckpt1-Rank0.fti"
    path.write_bytes(fti11_file({1: a.tobytes(), 2: b.tobytes()}, [[(1, 0, 0, 0, 4000), (2, 1, 0, 0, 3200)]],
                                ckpt_size=ckpt_size))
    with open(path, "rb") as fh:
        if ok:
            verify_data(fh, parse_ftiff(fh, str(path)))
        else:
            with pytest.raises(ftidask.FormatError, match="ckptSize"):
                parse_ftiff(fh, str(path))


def test_ftidask_file_ckpt_size_must_be_the_data_size(dirs):
    """ftidask's own files keep the strict rule: ckptSize = the bytes the containers hold."""
    from ftidask.ftiff.structs import FileBlock

    path = _good(dirs)
    raw = bytearray(path.read_bytes())
    fb = FileBlock.unpack(bytes(raw[:96]))
    assert fb.ckpt_size == 800 and not fb.legacy
    import dataclasses

    bad = dataclasses.replace(fb, ckpt_size=fb.fs).sealed()
    path.write_bytes(bad.pack() + bytes(raw[96:]))
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="ckptSize"):
        parse_ftiff(fh, str(path))


def _good(dirs):
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(100.0))
    info = ctx.checkpoint(1, 1)
    (path,) = __import__("pathlib").Path(dirs["ckpt_dir"]).glob(f"node0/*/l1/ckpt1.s{info.seq}/*.fti")
    return path


def _refit_fb(raw: bytearray) -> bytes:
    """Recompute the FB hash so that only the targeted inconsistency remains."""
    from ftidask.ftiff.structs import FileBlock

    fb = FileBlock.unpack(bytes(raw[:96]))
    return bytes(FileBlock.pack(fb.sealed())) + bytes(raw[96:])


HOSTILE = {
    "wrong magic": lambda raw: b"NOTFTIFF" * 12 + raw[96:],
    "fs past end": lambda raw: _refit_fb(raw[:64] + struct.pack("<q", 1 << 50) + raw[72:]),
    "absurd numvars": lambda raw: _refit_fb(raw[:96] + struct.pack("<i", 2**31 - 1) + raw[100:]),
    "dbsize past end": lambda raw: _refit_fb(raw[:100] + struct.pack("<q", 1 << 60) + raw[108:]),
    "chunksize past end": lambda raw: raw[:108 + 32] + struct.pack("<q", 1 << 55) + raw[108 + 40:],
    "table length absurd": lambda raw: raw[:-16] + struct.pack("<Q", 1 << 62) + raw[-8:],
    "tiny": lambda raw: raw[:50],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_file_refused_without_large_allocation(dirs, kind):
    path = _good(dirs)
    path.write_bytes(bytes(HOSTILE[kind](bytearray(path.read_bytes()))))
    tracemalloc.start()
    with pytest.raises(ftidask.FormatError):
        with open(path, "rb") as fh:
            verify_data(fh, parse_ftiff(fh, str(path)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20


def test_hostile_table_refused(dirs):
    """A variable table that lies (object dtype, wrong sizes) is refused even with valid hashes."""
    from ftidask.ftiff.structs import FileBlock
    from ftidask.ftiff.trailer import pack_trailer

    path = _good(dirs)
    raw = bytearray(path.read_bytes())
    fb = FileBlock.unpack(bytes(raw[:96]))
    tail_len = struct.unpack("<Q", raw[-16:-8])[0]
    table = json.loads(raw[fb.fs:fb.fs + tail_len])
    for bad in ({"dtype": "|O"}, {"nbytes": 8}, {"shape": [-1]}, {"dtype": {"names": ["a"], "formats": ["|O"],
                                                                             "offsets": [0], "itemsize": 8}}):
        t = json.loads(json.dumps(table))
        t["vars"][0].update(bad)
        tail = pack_trailer(json.dumps(t).encode())
        meta = bytes(raw[96:96 + 12 + 64])
        new_fb = FileBlock.unpack(bytes(raw[:96]))
        new_fb = FileBlock(_hex(meta + tail), bytes(16), new_fb.ckpt_size,
                           new_fb.fs, new_fb.max_fs, new_fb.pt_fs, new_fb.timestamp).sealed()
        path.write_bytes(new_fb.pack() + bytes(raw[96:fb.fs]) + tail)
        with pytest.raises(ftidask.FormatError):
            with open(path, "rb") as fh:
                parse_ftiff(fh, str(path))


def _hex(data: bytes) -> str:
    from ftidask.ftiff import hashing

    h = hashing.new_hasher(2)
    h.update(data)
    return h.hexdigest()
