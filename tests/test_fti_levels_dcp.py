"""FTI-FF files of FTI's other levels and modes, built as FTI's sources write them (tests/ftiff_builders.py):
the differential file ``dCP/dCPFile-Rank{r}.fti`` rewritten in place, partner copies (``Pcof``, ``ptFs`` set),
level-3 rank files (``maxFs`` set) and their parity files (``RSed``, which ftidask checks but never decodes),
variables added after the first checkpoint or shrunk to nothing.

The files are packed from FTI's serializers, not written by FTI (no such file is pinned for these levels); the
parity bytes are arbitrary here (ftidask checks only their MD5, which FTI's record holds).
"""

import hashlib
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from ftiff_builders import RECORDS, fti_padded_rank_file, fti_rsed_file, fti_tail_file

import ftidask
from ftidask.errors import RecoveryError
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.model.errors import FormatError
from ftidask.tools.cli import main as cli_main

EXEC = "2020-02-02_02-02-02"
RECORD_NAMES = sorted(RECORDS)


def _protect(ctx, variables: dict[int, bytes], fill: int) -> dict[int, np.ndarray]:
    arrays = {vid: np.frombuffer(bytearray([fill]) * len(raw), np.uint8) for vid, raw in variables.items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    return arrays


def _recovered(dirs, path: Path, variables: dict[int, bytes]) -> None:
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, variables, 0x5A)
    ctx.recover_file(path)
    for vid, array in arrays.items():
        assert array.tobytes() == variables[vid], f"variable {vid}"
    ctx.finalize()


def _dcp_file(record: str) -> tuple[bytes, dict[int, bytes]]:
    """The bytes of ``dCPFile-Rank0.fti`` after three differential checkpoints, as FTI leaves them.

    FTI_InitFtiff opens the dCP file without truncating it ('e'); each checkpoint writes the changed blocks of
    every chunk at its container, the data of an appended block where the previous metadata was, then the new
    metadata at the new dataSize: bytes FTI does not write keep what an earlier checkpoint put there.
    """
    rng = np.random.default_rng(7)
    ckpts = [
        ({0: rng.bytes(3000), 1: rng.bytes(1000), 2: rng.bytes(700)},
         [[(0, 0, 0, 3000), (1, 0, 0, 1000), (2, 0, 0, 700)]]),
        ({0: rng.bytes(3000), 1: rng.bytes(2600), 2: rng.bytes(700), 3: rng.bytes(900)},  # 1 grew, 3 is new
         [[(0, 0, 0, 3000), (1, 0, 0, 1000), (2, 0, 0, 700)], [(1, 1, 1000, 1600), (3, 0, 0, 900)]]),
        ({0: rng.bytes(3000), 1: rng.bytes(400), 2: b"", 3: rng.bytes(900)},  # 1 shrank, 2 shrank to nothing
         [[(0, 0, 0, 3000), (1, 0, 0, 1000), (2, 0, 0, 700)], [(1, 1, 1000, 1600), (3, 0, 0, 900)]]),
    ]
    disk = bytearray()
    for variables, blocks in ckpts:
        new = fti_tail_file(variables, blocks, record=record)
        disk += bytes(max(0, len(new) - len(disk)))
        fptr = 0
        for block in blocks:  # only each chunk's bytes are written: the rest of a container keeps older bytes
            for vid, _cid, dptr, csize in block:
                chunk = variables[vid][dptr:dptr + csize]
                disk[fptr:fptr + len(chunk)] = chunk
                fptr += csize
        disk[fptr:] = new[fptr:]  # the metadata
    return bytes(disk), ckpts[-1][0]


@pytest.mark.parametrize("record", RECORD_NAMES)
def test_dcp_ftiff_file_rewritten_in_place_is_read_bit_for_bit(tmp_path, dirs, capsys, record):
    raw, variables = _dcp_file(record)
    path = tmp_path / "Global" / EXEC / "dCP" / "dCPFile-Rank0.fti"
    path.parent.mkdir(parents=True)
    path.write_bytes(raw)
    assert raw[3000 + 400:3000 + 1000] != b"\xee" * 600  # the shrunk container keeps older bytes past its chunk
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    assert parsed.tail and [m.hascontent for _b, ms in parsed.blocks for m in ms] == [True, True, True, False, True]
    _recovered(dirs, path, variables)
    assert cli_main(["verify", str(tmp_path / "Global")]) == 0
    assert "1 sound, 0 damaged" in capsys.readouterr().out


@pytest.mark.parametrize("record", RECORD_NAMES)
def test_partner_copy_and_level3_rank_file_are_read(tmp_path, dirs, record):
    """FTIFF_CreateMetadata sets ptFs (L2: the partner's file size) or maxFs (L3: the group's largest + 8) in the
    hashed record; the Pcof file is a byte copy of the partner's rank file."""
    variables = {4: bytes(range(256)) * 3, 9: b"partner"}
    blocks = [[(4, 0, 0, 768), (9, 0, 0, 7)]]
    own = fti_tail_file(variables, blocks, record=record, pt_fs=4321)
    (tmp_path / "Ckpt2-Pcof1.fti").write_bytes(own)
    _recovered(dirs, tmp_path / "Ckpt2-Pcof1.fti", variables)
    l3 = fti_tail_file(variables, blocks, record=record, max_fs=len(own) + 100 + 8)
    (tmp_path / "Ckpt3-Rank0.fti").write_bytes(l3)
    _recovered(dirs, tmp_path / "Ckpt3-Rank0.fti", variables)


def test_a_variable_shrunk_to_nothing_keeps_an_empty_chunk_with_content(tmp_path, dirs):
    """FTI's overflow walk gives the first container of a variable of 0 bytes hascontent true and a chunk of 0
    bytes (hash: the MD5 of nothing); the array of 0 bytes recovers, the others bit for bit."""
    variables = {0: b"", 1: bytes(range(50)), 2: b""}
    raw = fti_tail_file(variables, [[(0, 0, 0, 64), (1, 0, 0, 50), (2, 0, 0, 8)], [(2, 1, 8, 16)]])
    path = tmp_path / "Ckpt5-Rank0.fti"
    path.write_bytes(raw)
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    flags = [(m.id, m.hascontent, m.chunksize) for _b, ms in parsed.blocks for m in ms]
    assert flags == [(0, True, 0), (1, True, 50), (2, True, 0), (2, False, 0)]
    assert parsed.blocks[0][1][0].hash == hashlib.md5(b"").digest()
    _recovered(dirs, path, variables)


def _l3_dir(tmp_path: Path, record: str) -> tuple[Path, bytes]:
    """FTI's l3 directory of one rank: its rank file and its parity file."""
    variables = {1: os.urandom(1000), 2: b"x" * 24}
    rank = fti_tail_file(variables, [[(1, 0, 0, 1000), (2, 0, 0, 24)]],
                         record="196f77d2" if record == "1.1" else record, max_fs=1400)
    folder = tmp_path / "Local" / "node0" / EXEC / "l3"
    folder.mkdir(parents=True)
    (folder / "Ckpt7-Rank0.fti").write_bytes(rank)
    parity = fti_rsed_file(np.random.default_rng(3).bytes(1400), len(rank), record=record)
    (folder / "Ckpt7-RSed0.fti").write_bytes(parity)
    return folder, parity


@pytest.mark.parametrize("record", ["1.1", "196f77d2", "master"])
def test_ftis_parity_file_is_refused_as_what_it_is(tmp_path, dirs, capsys, record):
    folder, _parity = _l3_dir(tmp_path, record)
    ctx = ftidask.init(**dirs)
    array = np.full(1000, 3, np.uint8)
    ctx.protect(1, array)
    with pytest.raises(RecoveryError, match=r"FTI's level-3 Reed-Solomon parity file .*1400 parity bytes.* "
                                            r"does not decode FTI's parity"):
        ctx.recover_file(folder / "Ckpt7-RSed0.fti")
    assert (array == 3).all()
    assert cli_main(["inspect", str(folder / "Ckpt7-RSed0.fti")]) == 2  # an error, as for any file not read
    assert "Reed-Solomon parity file" in capsys.readouterr().err


@pytest.mark.parametrize("record", ["1.1", "196f77d2", "master"])
def test_cli_verify_checks_ftis_parity_file_by_its_md5(tmp_path, capsys, record):
    """FTI's parity file has no .hash record of ftidask's: its own record's MD5 is checked instead, as FTI's L3
    recovery does; a flipped parity byte is damage."""
    folder, parity = _l3_dir(tmp_path, record)
    assert cli_main(["verify", str(folder)]) == 0
    assert "2 sound, 0 damaged" in capsys.readouterr().out
    flipped = bytearray(parity)
    flipped[700] ^= 0x10
    (folder / "Ckpt7-RSed0.fti").write_bytes(bytes(flipped))
    assert cli_main(["verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "1 sound, 1 damaged" in out and "MD5 of its parity bytes does not match" in out


def test_a_parity_record_that_lies_is_not_taken_for_one(tmp_path):
    """The record must describe the file (fs = maxFs = the bytes before it, ptFs -1): a record of a parity file
    left on a longer or shorter file is no parity file, and not an FTI-FF file either."""
    folder, parity = _l3_dir(tmp_path, "196f77d2")
    for raw in (b"\0" + parity, parity[1:]):
        path = folder / "Ckpt7-RSed0.fti"
        path.write_bytes(raw)
        with open(path, "rb") as fh, pytest.raises(FormatError) as err:
            parse_ftiff(fh, str(path))
        assert "Reed-Solomon" not in str(err.value)


def test_damaged_dcp_file_is_refused_and_arrays_untouched(tmp_path, dirs):
    raw, variables = _dcp_file("master")
    flipped = bytearray(raw)
    flipped[3000 + 1000 + 700 + 1600 + 10] ^= 1  # the variable added in the appended block
    path = tmp_path / "dCPFile-Rank0.fti"
    path.write_bytes(bytes(flipped))
    with open(path, "rb") as fh, pytest.raises(FormatError, match="hash does not match"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, variables, 0x33)
    with pytest.raises(RecoveryError):
        ctx.recover_file(path)
    assert all(a.tobytes() == bytes([0x33]) * a.nbytes for a in arrays.values())


@pytest.mark.parametrize(("name", "head", "mode"), [("Ckpt4-sionlib.fti", b"\1\2\3", "SIONlib (ckpt_io = 4)"),
                                                    ("Ckpt4-Rank0.h5", b"\x89HDF\r\n\x1a\n", "HDF5 (ckpt_io = 5)")])
def test_files_of_ftis_other_io_modes_are_refused_by_name(tmp_path, dirs, name, head, mode):
    """FTI's SIONlib and HDF5 files are not read: said so, not "not an FTI-FF file" then, with the meta file, "no
    section names it". (FTI's MPI-IO file, every rank's bytes in one Ckpt{id}-mpiio.fti, is read a rank at a time
    with its meta files: tests/test_fti_mpiio.py.)"""
    path = tmp_path / name
    path.write_bytes(head + bytes(2000))
    meta = tmp_path / "sector0-group0.fti"
    meta.write_text("[0]\nckpt_file_name = Ckpt4-Rank0.fti\nckpt_file_size = 8\n"
                    "ckpt_checksum = 0123456789abcdef0123456789abcdef\nvar0_id = 0\nvar0_size = 8\n")
    ctx = ftidask.init(**dirs)
    array = np.zeros(8, np.uint8)
    ctx.protect(0, array)
    for kwargs in ({}, {"meta": meta}):
        with pytest.raises(RecoveryError, match=f"FTI's {re.escape(mode)} .*not read by ftidask"):
            ctx.recover_file(path, **kwargs)
    ctx.finalize()


@pytest.mark.parametrize("record", RECORD_NAMES)
def test_level3_rank_file_left_padded_by_an_interrupted_recovery_is_read(tmp_path, dirs, capsys, record):
    """FTI_RSdec pads a present rank file to maxFs, writes its size at the end, decodes, then truncates it back: a
    crash in between leaves the padded file in the l3 directory. Its first bytes are the file, every one of them
    hash-checked: it is read as that file (the padding never is)."""
    variables = {1: os.urandom(700), 2: b"x" * 24}
    rank = fti_tail_file(variables, [[(1, 0, 0, 700), (2, 0, 0, 24)]], record=record, max_fs=2000)
    for max_fs in (2000, len(rank) + 8):  # a smaller file of the group; the largest
        path = tmp_path / "Ckpt7-Rank0.fti"
        path.write_bytes(fti_padded_rank_file(rank, max_fs))
        _recovered(dirs, path, variables)
        assert cli_main(["verify", str(path)]) == 0
        assert cli_main(["inspect", str(path)]) == 0
        assert f"{max_fs - len(rank)} bytes of padding after its {len(rank)}" in capsys.readouterr().out
    raw = bytearray(fti_padded_rank_file(rank, 2000))
    raw[100] ^= 1  # a data byte: refused as for the file itself
    path.write_bytes(bytes(raw))
    with open(path, "rb") as fh, pytest.raises(FormatError, match="hash does not match"):
        verify_data(fh, parse_ftiff(fh, str(path)))
    for size in (len(rank) - 1, len(rank) + 1, 2**62, -1):  # a size that is not the file's: not an FTI file
        path.write_bytes(bytes(raw[:-8]) + struct.pack("<q", size))
        with open(path, "rb") as fh, pytest.raises(FormatError):
            parse_ftiff(fh, str(path))
