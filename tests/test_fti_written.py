"""Files written by FTI's own FTI-FF writer (tests/data/fti_written, see its README.md) are read bit for bit.

FTI since 1.2 keeps all metadata at the end of the file (:mod:`ftidask.ftiff.tailmeta`).
"""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import RecoveryError
from ftidask.ftiff.filekind import is_config_file
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import FormatError
from ftidask.tools.cli import main as cli_main

DATA = Path(__file__).parent / "data" / "fti_written"
PAIR = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [0, 8], "itemsize": 16})
DTYPES = {0: np.dtype("<i4"), 1: np.dtype("<f8"), 2: np.dtype("S1"), 3: np.dtype("<i8"), 4: PAIR}
FILES = [(run, ckpt, rank) for run, nranks in (("r1", 1), ("r2", 2)) for ckpt in (1, 2, 3) for rank in range(nranks)]


def _path(run: str, ckpt: int, rank: int) -> Path:
    return DATA / run / f"Ckpt{ckpt}-Rank{rank}.fti"


def _expected(run: str, ckpt: int, rank: int) -> dict[int, bytes]:
    folder = DATA / "expected" / run / f"ckpt{ckpt}" / f"rank{rank}"
    return {vid: (folder / f"var{vid}.bin").read_bytes() for vid in DTYPES}


def _protect_all(ctx, expected: dict[int, bytes], fill: int = 0) -> dict[int, np.ndarray]:
    arrays = {}
    for vid, dtype in DTYPES.items():
        # over a bytearray: numpy's copy() of a structured array does not keep its padding bytes
        arrays[vid] = np.frombuffer(bytearray([fill]) * len(expected[vid]), dtype)
        ctx.protect(vid, arrays[vid])
    return arrays


@pytest.mark.parametrize("run,ckpt,rank", FILES)
def test_inspect_verify_recover(run, ckpt, rank, dirs, capsys):
    _read_bit_for_bit(_path(run, ckpt, rank), _expected(run, ckpt, rank), dirs, capsys)


def _read_bit_for_bit(path: Path, expected: dict[int, bytes], dirs, capsys) -> None:
    """inspect and verify accept the file, and recover_file gives ``expected`` back bit for bit."""
    assert cli_main(["inspect", str(path)]) == 0
    assert "metadata at the end" in capsys.readouterr().out
    assert cli_main(["verify", str(path)]) == 0
    assert not is_config_file(path)
    ctx = ftidask.init(**dirs)
    arrays = _protect_all(ctx, expected)
    ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == expected[vid], f"variable {vid}"


def test_layouts_are_ftis():
    """The container layouts FTI made: a grown variable gets a container in an appended block, a
    shrunk one keeps its containers (the appended one left empty, with the stale hash FTI keeps)."""
    with open(_path("r1", 1, 0), "rb") as fh:
        one = parse_ftiff(fh, "one")
    assert one.tail and len(one.blocks) == 1 and [m.fptr for m in one.blocks[0][1]] == [0, 64, 128, 168, 216]
    with open(_path("r1", 2, 0), "rb") as fh:
        two = parse_ftiff(fh, "two")
    grown = two.blocks[1][1][0]
    assert (grown.id, grown.containerid, grown.dptr, grown.fptr, grown.chunksize) == (1, 1, 64, 280, 48)
    shrunk = two.blocks[0][1][2]
    assert (shrunk.id, shrunk.chunksize, shrunk.containersize) == (2, 24, 40)
    with open(_path("r1", 3, 0), "rb") as fh:
        three = parse_ftiff(fh, "three")
        verify_data(fh, three)
    empty = three.blocks[1][1][0]
    assert (empty.id, empty.hascontent, empty.chunksize) == (1, False, 0) and empty.hash != bytes(16)
    assert len(three.blocks) == 3 and three.var_nbytes() == {0: 64, 1: 40, 2: 50, 3: 48, 4: 64}
    # FTI's writer hashed every container's hash into the checksum, the stale one included.
    every = hashlib.md5(b"".join(m.hash for _b, metas in three.blocks for m in metas)).hexdigest()
    assert three.fb.checksum == every


def _damaged(tmp_path: Path, offset_from_end: int | None = None, offset: int | None = None,
             source: Path | None = None) -> Path:
    """A copy of ``source`` (default: r1's checkpoint 2) with one bit flipped."""
    source = source or _path("r1", 2, 0)
    path = tmp_path / source.name
    shutil.copy(source, path)
    raw = bytearray(path.read_bytes())
    where = offset if offset is not None else len(raw) - offset_from_end
    raw[where] ^= 0x01
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("offset", [5, 70, 300])  # int array, double array, the appended container
def test_flipped_data_byte_is_refused_and_arrays_untouched(tmp_path, dirs, offset):
    _refused_untouched(_damaged(tmp_path, offset=offset), _expected("r1", 2, 0), dirs)


def _refused_untouched(path: Path, expected: dict[int, bytes], dirs) -> None:
    """verify says the file is damaged, and recover_file refuses it with every array as it was."""
    assert cli_main(["verify", str(path)]) == 1
    ctx = ftidask.init(**dirs)
    arrays = _protect_all(ctx, expected, fill=0x5A)
    with pytest.raises(RecoveryError, match="hash does not match"):
        ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == bytes([0x5A]) * array.nbytes, f"variable {vid} was touched"


# checksum, myHash, sizes, a container record (not ckptID, at from_end 61..58: FTI's myHash leaves it out)
@pytest.mark.parametrize("from_end", [110, 70, 20, 150])
def test_flipped_metadata_byte_is_a_clean_error(tmp_path, from_end):
    path = _damaged(tmp_path, offset_from_end=from_end)
    with open(path, "rb") as fh, pytest.raises(FormatError):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1


def test_a_variable_id_changed_in_its_record_is_refused_when_recovered(tmp_path, dirs):
    """FTI's container records carry no hash: a changed id (4 -> 5) cannot be seen in the file (FTI's reader
    takes it too), but recovering it finds the protected variable 4 missing and touches no array."""
    source = _path("r1", 1, 0)
    with open(source, "rb") as fh:
        parsed = parse_ftiff(fh, str(source))
    data_size = max(m.fptr + m.containersize for _b, metas in parsed.blocks for m in metas)
    at = data_size + 12 + 4 * 62  # the one block's record, then the fifth container's: its id first
    raw = bytearray(source.read_bytes())
    assert raw[at:at + 4] == (4).to_bytes(4, "little")
    raw[at] = 5
    path = tmp_path / source.name
    path.write_bytes(bytes(raw))
    assert cli_main(["verify", str(path)]) == 0  # nothing in the file tells
    ctx = ftidask.init(**dirs)
    arrays = _protect_all(ctx, _expected("r1", 1, 0), fill=0x5A)
    with pytest.raises(RecoveryError, match="variable 4 is protected but not in checkpoint file"):
        ctx.recover_file(path)
    assert all(a.tobytes() == bytes([0x5A]) * a.nbytes for a in arrays.values())


def test_truncated_file_is_a_clean_error(tmp_path):
    path = tmp_path / "Ckpt3-Rank0.fti"
    path.write_bytes(_path("r1", 3, 0).read_bytes()[:-1])
    with open(path, "rb") as fh, pytest.raises(FormatError):
        parse_ftiff(fh, str(path))


# --- FTI's src/ftiff.c at commit 8e2e72fc (the tail layout with a 106-byte file metadata record) ---

DEV = DATA / "c8e2e72f"
DEV_SOUND = [("r1", 0), ("r2", 0), ("r2", 1)]  # checkpoint 1: every container full


def _dev_path(run: str, ckpt: int, rank: int) -> Path:
    return DEV / run / f"Ckpt{ckpt}-Rank{rank}.fti"


@pytest.mark.parametrize("run,rank", DEV_SOUND)
def test_dev_8e2e72fc_read_bit_for_bit(run, rank, dirs, capsys):
    # make_files.c wrote the very same values in both runs
    _read_bit_for_bit(_dev_path(run, 1, rank), _expected(run, 1, rank), dirs, capsys)


def test_dev_8e2e72fc_record_is_told_by_its_hash():
    from ftidask.ftiff import tailmeta

    dev = _dev_path("r1", 1, 0).read_bytes()
    new = _path("r1", 1, 0).read_bytes()
    assert tailmeta._unpack_fb(dev[-tailmeta.TAIL_FB_SIZE:])[0].size == 106
    assert tailmeta._unpack_fb(new[-tailmeta.TAIL_FB_SIZE:])[0].size == 110
    assert tailmeta._unpack_fb(dev[-tailmeta.TAIL_FB_SIZE - 1:-1]) is None
    with open(_dev_path("r1", 1, 0), "rb") as fh:
        one = parse_ftiff(fh, "one")
    assert one.tail and [m.fptr for m in one.blocks[0][1]] == [0, 64, 128, 168, 216]
    assert one.fb.fs == len(dev) == 280 + 106 + 12 + 5 * 62


@pytest.mark.parametrize("run,ckpt,rank", [("r1", 2, 0), ("r1", 3, 0), ("r2", 2, 1), ("r2", 3, 0)])
def test_dev_8e2e72fc_overwrites_its_own_data(run, ckpt, rank, dirs):
    """That writer sets dataSize to the sum of the chunk sizes, not of the container sizes, and
    writes the metadata there: once a container is partly filled or empty, the metadata lands on
    data (FTI's own reader then fails the container's MD5). ftidask refuses the file cleanly."""
    path = _dev_path(run, ckpt, rank)
    with open(path, "rb") as fh, pytest.raises(FormatError, match="break the data layout"):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
    ctx = ftidask.init(**dirs)
    arrays = _protect_all(ctx, _expected(run, ckpt, rank), fill=0x5A)
    with pytest.raises((FormatError, RecoveryError)):
        ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == bytes([0x5A]) * array.nbytes, f"variable {vid} was touched"


@pytest.mark.parametrize("offset", [5, 130, 250])
def test_dev_8e2e72fc_flipped_data_byte(tmp_path, dirs, offset):
    _refused_untouched(_damaged(tmp_path, offset=offset, source=_dev_path("r1", 1, 0)), _expected("r1", 1, 0), dirs)


@pytest.mark.parametrize("from_end", [106, 60, 20, 150, 400])
def test_dev_8e2e72fc_flipped_metadata_byte(tmp_path, from_end):
    path = _damaged(tmp_path, offset_from_end=from_end, source=_dev_path("r1", 1, 0))
    with open(path, "rb") as fh, pytest.raises(FormatError):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1


def test_forged_metadata_size_is_refused_before_it_is_read(tmp_path):
    """A tail record whose myHash matches (anyone can compute it) but whose metaSize is 1 GiB: the metadata
    area was read whole, a 1 GiB allocation; it is refused before."""
    import struct
    import tracemalloc

    size = (1 << 30) + 110
    checksum = b"0" * 32 + b"\0"
    my_hash = hashlib.md5(checksum + struct.pack("<qqqqqqq", 0, size, size, 0, size, 0, 0)).digest()
    record = struct.pack("<33s16siqqqqqqq", checksum, my_hash, 1, size, size, 0, size, 0, 0, 0) + b"\0"
    path = tmp_path / "Ckpt1-Rank0.fti"
    with open(path, "wb") as fh:  # sparse: no disk used
        fh.truncate(size - len(record))
        fh.seek(size - len(record))
        fh.write(record)
    tracemalloc.start()
    try:
        with open(path, "rb") as fh, pytest.raises(FormatError, match="metaSize"):
            parse_ftiff(fh, str(path))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
