"""FTI 1.6 / master's FTI-FF layout, built from FTI's sources (tests/ftiff_builders.py: fti_master_file).

No file written by that FTI exists here: these files are packed from FTIFF_SerializeFileMeta /
SerializeDbMeta / SerializeDbVarMeta and FTIFF_GetHashMetaInfo as src/IO/ftiff.c at 52f4cbeb has them
(ftidask.ftiff.tailmeta's docstring), with the file metadata area 110 or 106 bytes long.
"""

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
from ftiff_builders import fti_master_file

import ftidask
from ftidask.errors import RecoveryError
from ftidask.ftiff import tailmeta
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import FormatError
from ftidask.tools.cli import main as cli_main

VARS = {
    0: np.arange(16, dtype="<i4").tobytes(),  # one container
    1: np.linspace(0, 1, 11).tobytes(),  # grew: 64 bytes in block 0, 24 more in an appended block
    2: b"shrunk to 24 bytes......",  # shrank: its container stays 40 bytes, 24 of them its
    3: np.arange(6, dtype="<i8").tobytes(),
    4: bytes(range(100, 132)),  # shrank back to its first container: the appended one is empty
}
BLOCKS = [[(0, 0, 0, 64), (1, 0, 0, 64), (2, 0, 0, 40), (3, 0, 0, 48), (4, 0, 0, 32)],
          [(1, 1, 64, 24), (4, 1, 32, 16)]]
DATA_SIZE = 64 + 64 + 40 + 48 + 32 + 24 + 16
AREAS = [110, 106]


def _file(tmp_path: Path, area: int = 110, flip: int | None = None, cut: int = 0) -> Path:
    raw = bytearray(fti_master_file(VARS, BLOCKS, area=area))
    if flip is not None:
        raw[flip] ^= 0x01
    path = tmp_path / "Ckpt3-Rank0.fti"
    path.write_bytes(bytes(raw[:len(raw) - cut]))
    return path


def _protect(ctx, fill: int) -> dict[int, np.ndarray]:
    arrays = {vid: np.frombuffer(bytearray([fill]) * len(b), np.uint8) for vid, b in VARS.items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    return arrays


@pytest.mark.parametrize("area", AREAS)
def test_inspect_verify_recover_bit_for_bit(tmp_path, dirs, capsys, area):
    path = _file(tmp_path, area)
    assert cli_main(["inspect", str(path)]) == 0
    assert "metadata at the end" in capsys.readouterr().out
    assert cli_main(["verify", str(path)]) == 0
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == VARS[vid], f"variable {vid}"


@pytest.mark.parametrize("area", AREAS)
def test_layout_and_variant(tmp_path, area):
    raw = fti_master_file(VARS, BLOCKS, area=area)
    variant = tailmeta._unpack_fb(raw[-tailmeta.TAIL_FB_SIZE:])[0]
    assert variant.size == area and "52f4cbeb" in variant.name
    with open(_file(tmp_path, area), "rb") as fh:
        parsed = parse_ftiff(fh, "built")
        verify_data(fh, parsed)
    assert parsed.tail and len(parsed.blocks) == 2 and parsed.fb.fs == len(raw) == DATA_SIZE + 12 * 2 + 58 * 7 + area
    grown = parsed.blocks[1][1][0]
    assert (grown.id, grown.containerid, grown.dptr, grown.fptr, grown.chunksize) == (1, 1, 64, 248, 24)
    shrunk = parsed.blocks[0][1][2]
    assert (shrunk.id, shrunk.chunksize, shrunk.containersize) == (2, 24, 40)
    empty = parsed.blocks[1][1][1]
    assert (empty.id, empty.hascontent, empty.chunksize) == (4, False, 0)
    assert empty.hash == hashlib.md5(b"stale container").digest()
    assert parsed.var_nbytes() == {vid: len(b) for vid, b in VARS.items()}
    every = hashlib.md5(b"".join(m.hash for _b, metas in parsed.blocks for m in metas)).hexdigest()
    assert parsed.fb.checksum == every and parsed.fb.timestamp == 0x9ABC_DEF0


def test_not_taken_for_the_older_records():
    """The 110-byte area of FTI 1.3-1.4 and the new one are told apart by their myHash recipes."""
    raw = fti_master_file(VARS, BLOCKS, area=110)
    tail = bytearray(raw[-110:])
    # the same bytes hashed the 196f77d2 way (timestamp as int64) do not match
    checksum, _my_hash, _id, *sizes, ts = struct.unpack_from("<33s16siqqqqqqI", tail)
    ckpt_size, meta_size, data_size, fs, max_fs, pt_fs = sizes
    old = hashlib.md5(checksum + struct.pack("<qqqqqqq", ts, ckpt_size, meta_size, data_size, fs, pt_fs, max_fs))
    assert old.digest() != bytes(tail[49:65])
    assert tailmeta._unpack_fb(bytes(tail[:-1])) is None  # shifted by one byte: nothing matches


@pytest.mark.parametrize("area", AREAS)
@pytest.mark.parametrize("offset", [5, 70, 250])  # the int array, the grown variable's two containers
def test_flipped_data_byte_is_refused_and_arrays_untouched(tmp_path, dirs, area, offset):
    path = _file(tmp_path, area, flip=offset)
    assert cli_main(["verify", str(path)]) == 1
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0x5A)
    with pytest.raises(RecoveryError, match="hash does not match"):
        ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == bytes([0x5A]) * array.nbytes, f"variable {vid} was touched"


# in the record: checksum, myHash, ckptSize, dataSize, fs, timestamp (ckptId, 49..52, is not in myHash: FTI's
# reader takes a changed one too); in the block area: numvars, a container's fptr, chunksize, hash
RECORD = [0, 20, 40, 55, 72, 90, 103]
BLOCK_AREA = [0, 12 + 10, 12 + 58 + 26, 12 + 58 * 2 + 45]


@pytest.mark.parametrize("area", AREAS)
@pytest.mark.parametrize("where", [("record", at) for at in RECORD] + [("blocks", at) for at in BLOCK_AREA])
def test_flipped_metadata_byte_is_a_clean_error(tmp_path, dirs, area, where):
    size = len(fti_master_file(VARS, BLOCKS, area=area))
    offset = size - area + where[1] if where[0] == "record" else DATA_SIZE + where[1]
    path = _file(tmp_path, area, flip=offset)
    with open(path, "rb") as fh, pytest.raises(FormatError):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0x5A)
    with pytest.raises((FormatError, RecoveryError)):
        ctx.recover_file(path)
    assert all(a.tobytes() == bytes([0x5A]) * a.nbytes for a in arrays.values())


@pytest.mark.parametrize("area", AREAS)
def test_bytes_fti_leaves_unwritten_are_not_read(tmp_path, dirs, area):
    path = _file(tmp_path, area, flip=len(fti_master_file(VARS, BLOCKS, area=area)) - 1)
    assert cli_main(["verify", str(path)]) == 0
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    ctx.recover_file(path)
    assert all(arrays[vid].tobytes() == b for vid, b in VARS.items())


@pytest.mark.parametrize("area", AREAS)
@pytest.mark.parametrize("cut", [1, 5, 60])
def test_truncated_file_is_a_clean_error(tmp_path, area, cut):
    path = _file(tmp_path, area, cut=cut)
    with open(path, "rb") as fh, pytest.raises(FormatError):
        parse_ftiff(fh, str(path))
    assert cli_main(["verify", str(path)]) == 1
