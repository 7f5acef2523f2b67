"""FTI's POSIX files (``ckpt_io = 1``) of levels 2 and 3, read with the meta file FTI writes for their group.

FTI names a partner copy after the process that *keeps* it: ``FTI_RecvPtner`` (src/postckpt.c) writes the left
neighbour's file as ``Ckpt{id}-Pcof{r}.fti``, ``r`` the receiver's own rank, and the meta file has no section naming
it: ``FTI_GetChecksums`` (src/meta.c) and ``FTI_LoadMeta`` take its size and checksum from the section of the left
partner, ``(groupRank + groupSize - 1) % groupSize``. ``FTI_RSenc`` writes the parity ``Ckpt{id}-RSed{r}.fti``
(``ckpt_file_maxs`` bytes) and ``FTI_WriteRSedChecksum`` its MD5 as ``RSed_checksum`` in the owner's section. The
files are built here as those functions write them (no POSIX run of FTI's is pinned in tests/data).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import RecoveryError
from ftidask.ftiff.posix import read_posix
from ftidask.model.errors import FormatError
from ftidask.tools.cli import main as cli_main

GROUP = 4  # FTI refuses L2 and L3 with groups of 2 or less (FTI_TestConfig)


def _raw(rank: int) -> dict[int, bytes]:
    """Each rank's variables, of sizes of its own (so a copy read with the wrong section fails its size)."""
    return {0: (np.arange(8 + rank, dtype="<i4") * (rank + 3)).tobytes(), 5: np.full(rank + 1, rank, "<f8").tobytes()}


def _section(index: int, ckpt: int, maxs: int, extra: dict[str, str]) -> str:
    raw = b"".join(_raw(index).values())
    entries = {"ckpt_file_name": f"Ckpt{ckpt}-Rank{index}.fti", "ckpt_file_size": str(len(raw)),
               "ckpt_file_maxs": str(maxs), "ckpt_checksum": hashlib.md5(raw).hexdigest()}
    for j, (vid, data) in enumerate(_raw(index).items()):
        entries |= {f"var{j}_id": str(vid), f"var{j}_size": str(len(data))}
    return f"\n[{index}]\n" + "".join(f"{k:<30} = {v}\n" for k, v in (entries | extra).items())


def _write_level(root: Path, level: int, ckpt: int = 3) -> tuple[Path, Path]:
    """One group of GROUP nodes of one process (local_test: ``Local/node{n}/...``), its meta file."""
    maxs = max(len(b"".join(_raw(r).values())) for r in range(GROUP))
    meta = root / f"Meta/2019-01-01_00-00-00/l{level}/sector0-group0.fti"
    meta.parent.mkdir(parents=True)
    sections = []
    for rank in range(GROUP):
        node = root / f"Local/node{rank}/2019-01-01_00-00-00/l{level}"
        node.mkdir(parents=True)
        (node / f"Ckpt{ckpt}-Rank{rank}.fti").write_bytes(b"".join(_raw(rank).values()))
        extra = {}
        if level == 2:  # the left neighbour's file, kept here under this rank's number
            (node / f"Ckpt{ckpt}-Pcof{rank}.fti").write_bytes(b"".join(_raw((rank - 1) % GROUP).values()))
        if level == 3:  # parity bytes: what they are does not matter here, their MD5 does
            parity = bytes((rank * 7 + i) % 251 for i in range(maxs))
            (node / f"Ckpt{ckpt}-RSed{rank}.fti").write_bytes(parity)
            extra = {"rsed_checksum": hashlib.md5(parity).hexdigest()}
        sections.append(_section(rank, ckpt, maxs, extra))
    meta.write_text("".join(sections) + "\n")
    return root / "Local", meta


def _protect(ctx, rank: int) -> dict[int, np.ndarray]:
    arrays = {vid: np.zeros(len(data), "u1") for vid, data in _raw(rank).items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    return arrays


@pytest.mark.parametrize("meta_as", ["file", "directory"])
def test_a_partner_copy_is_read_with_its_left_partners_section(tmp_path, dirs, meta_as):
    """A node whose own file is lost still holds its left neighbour's data: recover_file reads it from Pcof."""
    local, meta = _write_level(tmp_path / "fti", 2)
    for keeper in range(GROUP):
        owner = (keeper - 1) % GROUP
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, owner)
        pcof = local / f"node{keeper}/2019-01-01_00-00-00/l2/Ckpt3-Pcof{keeper}.fti"
        assert set(ctx.recover_file(pcof, meta=meta if meta_as == "file" else meta.parent)) == {0, 5}
        assert {vid: a.tobytes() for vid, a in arrays.items()} == _raw(owner)
        ctx.finalize()


def test_a_damaged_partner_copy_is_refused(tmp_path, dirs):
    local, meta = _write_level(tmp_path / "fti", 2)
    pcof = local / "node2/2019-01-01_00-00-00/l2/Ckpt3-Pcof2.fti"
    raw = bytearray(pcof.read_bytes())
    raw[3] ^= 1
    pcof.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 1)
    with pytest.raises(RecoveryError, match="MD5 does not match"):
        ctx.recover_file(pcof, meta=meta)
    assert all(not a.any() for a in arrays.values())
    ctx.finalize()


def test_a_partner_copy_whose_owner_section_is_missing_is_a_clean_error(tmp_path):
    local, meta = _write_level(tmp_path / "fti", 2)
    meta.write_text(meta.read_text().replace("Ckpt3-Rank2.fti", "Ckpt3-Rank9.fti"))
    with pytest.raises(FormatError, match="Ckpt3-Rank2.fti"):
        read_posix(local / "node2/2019-01-01_00-00-00/l2/Ckpt3-Pcof2.fti", meta)


def test_a_parity_file_is_refused_as_parity_and_verified_by_the_cli(tmp_path, dirs, capsys):
    local, meta = _write_level(tmp_path / "fti", 3)
    rsed = local / "node1/2019-01-01_00-00-00/l3/Ckpt3-RSed1.fti"
    ctx = ftidask.init(**dirs)
    _protect(ctx, 1)
    with pytest.raises(RecoveryError, match="Reed-Solomon parity"):
        ctx.recover_file(rsed, meta=meta)
    ctx.finalize()
    assert cli_main(["verify", str(rsed.parent), "--meta", str(meta.parent)]) == 0
    assert "2 sound, 0 damaged" in capsys.readouterr().out
    raw = bytearray(rsed.read_bytes())
    raw[0] ^= 1
    rsed.write_bytes(bytes(raw))
    assert cli_main(["verify", str(rsed.parent), "--meta", str(meta)]) == 1
    out = capsys.readouterr().out
    assert "RSed_checksum" in out and "1 sound, 1 damaged" in out


def test_cli_verifies_the_partner_copies_of_a_level_2_directory(tmp_path, capsys):
    local, meta = _write_level(tmp_path / "fti", 2)
    assert cli_main(["verify", str(local / "node0/2019-01-01_00-00-00/l2"), "--meta", str(meta.parent)]) == 0
    assert "2 sound, 0 damaged" in capsys.readouterr().out


def test_a_parity_file_without_rsed_checksum_is_checked_by_its_size(tmp_path, capsys):
    """FTI versions without FTI_WriteRSedChecksum record no parity MD5: FTI_CheckFile then checks the size alone."""
    local, meta = _write_level(tmp_path / "fti", 3)
    meta.write_text("\n".join(x for x in meta.read_text().splitlines() if not x.startswith("rsed_checksum")))
    rsed = local / "node2/2019-01-01_00-00-00/l3/Ckpt3-RSed2.fti"
    assert cli_main(["verify", str(rsed), "--meta", str(meta)]) == 0
    assert "size only" in capsys.readouterr().out
    rsed.write_bytes(rsed.read_bytes()[:-1])
    assert cli_main(["verify", str(rsed), "--meta", str(meta)]) == 1
    assert "its meta file says" in capsys.readouterr().out


def test_a_rank_file_left_padded_by_an_interrupted_fti_decode_is_read(tmp_path, dirs):
    """FTI_Decode pads every surviving rank file of the group to ckpt_file_maxs before decoding and cuts it back
    after: a file left padded holds its checkpoint in its first ckpt_file_size bytes."""
    local, meta = _write_level(tmp_path / "fti", 3)
    path = local / "node0/2019-01-01_00-00-00/l3/Ckpt3-Rank0.fti"  # rank 0's file is the group's smallest
    maxs = max(len(b"".join(_raw(r).values())) for r in range(GROUP))
    with open(path, "r+b") as fh:
        fh.truncate(maxs)
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    ctx.recover_file(path, meta=meta)
    assert {vid: a.tobytes() for vid, a in arrays.items()} == _raw(0)
    with open(path, "r+b") as fh:  # any other size is still refused
        fh.truncate(maxs - 1)
    with pytest.raises(RecoveryError, match="its meta file says"):
        ctx.recover_file(path, meta=meta)
    ctx.finalize()
