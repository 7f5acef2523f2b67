"""FTI's MPI-IO level-4 checkpoint (ckpt_io = 2): one shared file ``Ckpt{id}-mpiio.fti`` of every rank's bytes, read
for one rank with the meta files: ``recover_file(path, meta=..., rank=...)``, ftidask.ftiff.fti_mpiio.read_mpiio.

The run is built here in plain Python as FTI lays it out (no file written by FTI is pinned): FTI_InitMPIO
(src/IO/mpio.c) opens ``{glbl_dir}/{exec_id}/l4/Ckpt{id}-mpiio.fti`` (written in the global temp directory, then
renamed) on FTI_COMM_WORLD, the application processes (heads excluded, ordered by their global rank), gathers every
process's checkpoint size and starts its part at the sum of the sizes of the processes before it
(``splitRank``); FTI_WriteMPIOData writes the protected variables back to back in protection order, no padding.
FTI_RecoverL4Mpi reads a part back with the same prefix sum of the meta files' ``ckpt_file_size``. The meta files
(src/meta.c FTI_WriteMetadata, ``{meta_dir}/{exec_id}/l4/sector{s}-group{g}.fti``) name each process's
``Ckpt{id}-Rank{r}.fti`` (``r`` its global rank), its size and FTI_Checksum's MD5 of its variables, i.e. of its part.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi
from mpi_util import run as mpi_run

import ftidask
from ftidask.errors import NoCheckpointError, RecoveryError
from ftidask.ftiff.fti_mpiio import read_mpiio
from ftidask.ftiff.posix import read_posix
from ftidask.model.errors import FormatError
from ftidask.tools.fti_run import fti_run_files, recover_fti_run

EXEC = "2021-03-04_05-06-07"
MPI_MARKS = need_mpi()


def _variables(rank: int) -> dict[int, np.ndarray]:
    """Rank ``rank``'s protected variables; sizes differ between ranks, so the offsets are a real prefix sum."""
    rng = np.random.default_rng(rank)
    return {0: np.arange(4 + rank, dtype="<i4") * (rank + 1),
            5: rng.random((2, 3 + rank)),
            2: rng.integers(0, 255, 7 * rank + 1, dtype="u1"),
            3: np.zeros(0, "<f4")}  # empty


def _write_fti_mpiio(root: Path, ckpt: int, ranks: list[int], group_size: int = 2) -> tuple[Path, Path]:
    """FTI's level-4 MPI-IO files of the application ranks ``ranks`` (global ranks, ascending: heads left out):
    ``Global/<exec>/l4/Ckpt{ckpt}-mpiio.fti`` and ``Meta/<exec>/l4/sector0-group{g}.fti``, one per group of
    ``group_size`` processes."""
    data_dir, meta_dir = root / f"Global/{EXEC}/l4", root / f"Meta/{EXEC}/l4"
    data_dir.mkdir(parents=True)
    meta_dir.mkdir(parents=True)
    parts = {r: b"".join(a.tobytes() for a in _variables(r).values()) for r in ranks}
    (data_dir / f"Ckpt{ckpt}-mpiio.fti").write_bytes(b"".join(parts[r] for r in sorted(ranks)))
    for g in range(0, len(ranks), group_size):
        members = ranks[g:g + group_size]
        text = ""
        for i, rank in enumerate(members):
            entries = [("ckpt_file_name", f"Ckpt{ckpt}-Rank{rank}.fti"), ("ckpt_file_size", len(parts[rank])),
                       ("ckpt_file_maxs", max(len(parts[r]) for r in members)),
                       ("ckpt_checksum", hashlib.md5(parts[rank]).hexdigest())]
            for j, (vid, array) in enumerate(_variables(rank).items()):
                entries += [(f"var{j}_id", vid), (f"var{j}_size", array.nbytes)]
            text += f"\n[{i}]\n" + "".join(f"{k:<30} = {v}\n" for k, v in entries)
        (meta_dir / f"sector0-group{g // group_size}.fti").write_text(text + "\n")
    return data_dir / f"Ckpt{ckpt}-mpiio.fti", meta_dir


def _protect(ctx, rank: int, fill: int) -> dict[int, np.ndarray]:
    arrays = {}
    for vid, like in _variables(rank).items():
        arrays[vid] = np.frombuffer(bytearray([fill]) * like.nbytes, like.dtype).reshape(like.shape)
        ctx.protect(vid, arrays[vid])
    return arrays


def _same(arrays: dict[int, np.ndarray], rank: int) -> bool:
    return all(arrays[vid].tobytes() == want.tobytes() for vid, want in _variables(rank).items())


def _refused(ctx, arrays, match: str, *args, **kwargs) -> None:
    before = {vid: a.tobytes() for vid, a in arrays.items()}
    with pytest.raises(RecoveryError, match=match):
        ctx.recover_file(*args, **kwargs)
    assert {vid: a.tobytes() for vid, a in arrays.items()} == before  # nothing touched


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [1, 2, 3, 5, 6, 7]], ids=["no-heads", "heads-0-and-4"])
def test_every_ranks_variables_recover_bit_for_bit(tmp_path, dirs, ranks):
    """With heads (node_size 4, head 1: global ranks 0 and 4 are heads) the parts follow the application ranks."""
    path, meta = _write_fti_mpiio(tmp_path / "fti", 6, ranks, group_size=3 if len(ranks) == 6 else 2)
    for rank in ranks:
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, rank, 0x5A)
        assert set(ctx.recover_file(path, meta=meta, rank=rank)) == set(arrays)
        assert _same(arrays, rank)
        ctx.finalize()
        part = read_mpiio(path, meta, rank)
        assert {vid: bytes(b) for vid, b in part.data.items()} == {v: a.tobytes() for v, a in _variables(rank).items()}


def test_the_rank_defaults_to_the_contexts_own(tmp_path, dirs):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 2, [0, 1])
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, 1)
    ctx.recover_file(path, meta=meta)  # this context is rank 0
    assert _same(arrays, 0)
    ctx.finalize()


def test_a_flipped_byte_refuses_that_rank_only(tmp_path, dirs):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 3, [0, 1, 2, 3])
    start = sum(len(b"".join(a.tobytes() for a in _variables(r).values())) for r in range(2))
    raw = bytearray(path.read_bytes())
    raw[start + 5] ^= 0x10  # in rank 2's part
    path.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 2, 0x22)
    _refused(ctx, arrays, "MD5 does not match", path, meta=meta, rank=2)
    ctx.finalize()
    for rank in (0, 1, 3):
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, rank, 0)
        ctx.recover_file(path, meta=meta, rank=rank)
        assert _same(arrays, rank)
        ctx.finalize()


def _drop_rank_1(meta: Path) -> None:
    """Rank 1's section out of group 0's meta file (group 0 keeps its rank 0 alone)."""
    text = (meta / "sector0-group0.fti").read_text()
    (meta / "sector0-group0.fti").write_text(text[:text.index("\n[1]")] + "\n")


@pytest.mark.parametrize(("edit", "match"), [
    ("drop-rank-1", "sum to .* the file has"),
    ("drop-group-1", "sum to .* the file has"),
    ("size-past-end", "past the end|sum to"),
    ("size-huge", "not a byte count"),  # 31 digits
    ("size-negative", "not a byte count"),
    ("size-text", "not a byte count"),
    ("size-missing", "not a byte count"),
    ("name-twice", "twice"),
    ("other-ckpt", "checkpoint 9"),
    ("var-past-part", "outside"),
    ("no-checksum", "no MD5"),
    ("file-cut", "past the end of the file"),
    ("garbage-meta", "not a readable FTI meta file"),
])
def test_hostile_meta_files_or_a_cut_file_are_a_clean_error(tmp_path, dirs, edit, match):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 4, [0, 1, 2, 3])
    group0, group1 = meta / "sector0-group0.fti", meta / "sector0-group1.fti"
    text = group1.read_text()
    size3 = len(b"".join(a.tobytes() for a in _variables(3).values()))
    if edit == "drop-rank-1":
        _drop_rank_1(meta)
    elif edit == "drop-group-1":
        group1.unlink()
    elif edit.startswith("size-"):
        value = {"size-past-end": size3 + 1, "size-huge": 10**30, "size-negative": -8, "size-text": "12abc",
                 "size-missing": None}[edit]
        line = f"{'ckpt_file_size':<30} = {size3}\n"
        group1.write_text(text.replace(line, "" if value is None else f"ckpt_file_size = {value}\n"))
    elif edit == "name-twice":
        group1.write_text(text.replace("Ckpt4-Rank3.fti", "Ckpt4-Rank2.fti"))
    elif edit == "other-ckpt":
        group1.write_text(text.replace("Ckpt4-Rank3.fti", "Ckpt9-Rank3.fti"))
    elif edit == "var-past-part":
        group0.write_text(group0.read_text().replace(f"{'var2_size':<30} = 1\n", "var2_size = 1000\n"))
    elif edit == "no-checksum":
        group0.write_text("\n".join(x for x in group0.read_text().splitlines() if not x.startswith("ckpt_checksum")))
    elif edit == "file-cut":
        path.write_bytes(path.read_bytes()[:-3])
    elif edit == "garbage-meta":
        group1.write_bytes(b"\0\xff garbage")
    with pytest.raises(FormatError, match=match):
        read_mpiio(path, meta, 0)
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, 0x44)
    _refused(ctx, arrays, match, path, meta=meta, rank=0)
    ctx.finalize()


@pytest.mark.parametrize(("rank", "match"), [(7, "no section .* names Ckpt4-Rank7.fti"), (-1, "non-negative int"),
                                             ("1", "non-negative int"), (True, "non-negative int"),
                                             (1.0, "non-negative int")])
def test_a_rank_not_in_the_run_or_not_a_rank_is_refused(tmp_path, dirs, rank, match):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 4, [0, 1, 2, 3])
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, 9)
    _refused(ctx, arrays, match, path, meta=meta, rank=rank)
    ctx.finalize()


def test_without_meta_files_or_with_a_rank_for_another_file_it_says_how(tmp_path, dirs):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 4, [0, 1])
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, 9)
    _refused(ctx, arrays, r"MPI-IO .*recover_file\(path, meta=.*rank=", path)
    _refused(ctx, arrays, r"rank=.*MPI-IO", tmp_path / "Ckpt4-Rank0.fti", meta=meta, rank=0)
    ctx.finalize()
    with pytest.raises(FormatError, match=r"MPI-IO .*rank"):
        read_posix(path, meta)


def _config(root: Path, **keys) -> Path:
    values = {"ckpt_dir": root / "Local", "glbl_dir": root / "Global", "meta_dir": root / "Meta", "node_size": 1,
              "group_size": 2, "ckpt_io": 2, "failure": 1, "exec_id": EXEC} | keys
    text = "[basic]\n" + "".join(f"{k} = {v}\n" for k, v in values.items() if k not in ("failure", "exec_id"))
    text += f"[restart]\nfailure = {values['failure']}\nexec_id = {values['exec_id']}\n[advanced]\nlocal_test = 1\n"
    (root / "config.fti").write_text(text)
    return root / "config.fti"


def test_recover_fti_run_reads_level_4_of_an_mpiio_run(tmp_path, dirs):
    path, meta = _write_fti_mpiio(tmp_path / "fti", 8, [0, 1, 2, 3])
    config = _config(tmp_path / "fti")
    for rank in range(4):
        listed = fti_run_files(config, rank)
        assert [(f.level, f.ckpt_id, f.path, f.meta) for f in listed] == [(4, 8, path, meta)]
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, rank, 0x77)
        found = recover_fti_run(ctx, config, rank)
        assert (found.level, found.path) == (4, path) and _same(arrays, rank)
        ctx.finalize()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # rank 3's last byte
    path.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 3, 0x77)
    with pytest.raises(NoCheckpointError, match="MD5 does not match"):
        recover_fti_run(ctx, config, 3)
    assert all(a.tobytes() == bytes([0x77]) * a.nbytes for a in arrays.values())
    ctx.finalize()


def test_cli_verify_with_meta_checks_every_ranks_part(tmp_path, capsys):
    from ftidask.tools.cli import main as cli_main

    path, meta = _write_fti_mpiio(tmp_path / "fti", 2, [0, 1, 2])
    assert cli_main(["verify", str(path)]) == 1  # no metadata of its own: says how to check it
    assert "MPI-IO file (ckpt_io = 2) is checked with its meta file: verify PATH --meta" in capsys.readouterr().out
    assert cli_main(["verify", str(path), "--meta", str(meta)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "3 ranks" in out and "1 sound, 0 damaged" in out
    assert cli_main(["verify", str(path.parent), "--meta", str(meta)]) == 0
    raw = bytearray(path.read_bytes())
    raw[2] ^= 1  # rank 0's part
    path.write_bytes(bytes(raw))
    assert cli_main(["verify", str(path), "--meta", str(meta)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "rank 0" in out and "MD5" in out and "0 sound, 1 damaged" in out


def test_an_mpiio_runs_levels_1_to_3_are_posix_files_read_first(tmp_path, dirs):
    """With ckpt_io = 2 FTI writes levels 1-3 with its POSIX writer (FTI_InitCheckpointWriters: LOCAL is
    FTI_InitPosix), described by the meta files of their level: level 1 is tried first, level 4's part after."""
    root = tmp_path / "fti"
    path, _meta = _write_fti_mpiio(root, 8, [0, 1])
    raw = b"".join(a.tobytes() for a in _variables(0).values())
    l1 = root / f"Local/node0/{EXEC}/l1/Ckpt9-Rank0.fti"
    l1.parent.mkdir(parents=True)
    l1.write_bytes(raw)
    (root / f"Meta/{EXEC}/l1").mkdir(parents=True)
    (root / f"Meta/{EXEC}/l1/sector0-group0.fti").write_text(
        f"[0]\nckpt_file_name = Ckpt9-Rank0.fti\nckpt_file_size = {len(raw)}\nckpt_checksum = "
        f"{hashlib.md5(raw).hexdigest()}\n" + "".join(f"var{j}_id = {vid}\nvar{j}_size = {a.nbytes}\n"
                                                    for j, (vid, a) in enumerate(_variables(0).items())))
    config = _config(root)
    assert [(f.level, f.path, f.rank) for f in fti_run_files(config, 0)] == [(1, l1, None), (4, path, 0)]
    for damaged, level in ((False, 1), (True, 4)):
        if damaged:
            l1.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
        ctx = ftidask.init(**dirs)
        arrays = _protect(ctx, 0, 0x31)
        assert recover_fti_run(ctx, config, 0).level == level and _same(arrays, 0)
        ctx.finalize()


@MPI_MARKS[0]
@MPI_MARKS[1]
def test_a_file_written_with_mpi_io_as_fti_does_is_read_by_each_rank(tmp_path):
    """4 ranks write the shared file with MPI-IO at FTI_InitMPIO's offsets (tests/mpi_scripts/fti_mpiio_job.py);
    each rank's context recovers its own part (the rank defaulting to its own) and reads its neighbour's."""
    proc = mpi_run(4, "fti_mpiio_job.py", str(tmp_path))
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results == [{"rank": r, "exact": True, "neighbour": True} for r in range(4)]
