"""Files of FTI's POSIX I/O (ckpt_io = 1, FTI's default) read with FTI's meta file: ``recover_file(path, meta=...)``.

The files are built here as FTI writes them (no POSIX file written by FTI is pinned in tests/data): the checkpoint
file is the protected variables' bytes in protection order (FTI_WritePosixData); the meta file is
FTI_WriteMetadata's (src/meta.c) dictionary dumped by iniparser_dump_ini: one section per process of the group,
keys lower case, ``%-30s = %s``, Ckpt_checksum the MD5 of the variables' bytes (FTI_Checksum).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import RecoveryError
from ftidask.ftiff.posix import read_posix
from ftidask.model.errors import FormatError

PAIR = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [0, 8], "itemsize": 16})


def _variables(rank: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(rank)
    pairs = np.zeros(4, PAIR)
    pairs["a"], pairs["b"] = np.arange(4) + rank, np.linspace(0, 1, 4)
    return {0: np.arange(16, dtype="<i4") * (rank + 1),  # FTI_INTG
            7: rng.random((3, 5)),  # FTI_DBLE, ids need not follow each other
            2: np.asfortranarray(rng.integers(-9, 9, (4, 3), dtype="<i8")),  # memory as FTI copies it: F order
            3: pairs,  # FTI_InitType(16)
            4: np.zeros(0, "<f4")}  # empty


def _raw(array: np.ndarray) -> bytes:
    return array.tobytes(order="F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C")


def _write_fti_posix(root: Path, ckpt: int, nranks: int, *, version: str = "1.1",
                     extra: str = "") -> tuple[Path, Path]:
    """FTI's L4 directories of one group: ``Global/<exec>/l4/Ckpt{ckpt}-Rank{r}.fti`` and
    ``Meta/<exec>/l4/sector0-group0.fti``, the meta file as ``version`` writes it: "1.0" an early FTI_Checksum's 15
    characters (each byte's hex digits printed at offset i, not 2 * i), "1.1" the MD5, "1.4" (src/meta.c with
    FTIT_keymap) adds a [ckpt_info] section, var{j}_pos and var{j}_name."""
    data_dir, meta_dir = root / "Global/2018-08-01_10-00-00/l4", root / "Meta/2018-08-01_10-00-00/l4"
    data_dir.mkdir(parents=True)
    meta_dir.mkdir(parents=True)
    sizes = [sum(len(_raw(a)) for a in _variables(r).values()) for r in range(nranks)]
    lines = [f"\n[ckpt_info]\n{'ckpt_type':<30} = full\n{'ckpt_id':<30} = {ckpt}\n"] if version == "1.4" else []
    for rank in range(nranks):
        raw = b"".join(_raw(a) for a in _variables(rank).values())
        (data_dir / f"Ckpt{ckpt}-Rank{rank}.fti").write_bytes(raw)
        digest = hashlib.md5(raw).hexdigest()
        entries = [("ckpt_file_name", f"Ckpt{ckpt}-Rank{rank}.fti"), ("ckpt_file_size", str(len(raw))),
                   ("ckpt_file_maxs", str(max(sizes))),
                   ("ckpt_checksum", digest[0:30:2] if version == "1.0" else digest)]
        pos = 0
        for j, (vid, array) in enumerate(_variables(rank).items()):
            entries += [(f"var{j}_id", str(vid)), (f"var{j}_size", str(array.nbytes))]
            if version == "1.4":
                entries += [(f"var{j}_pos", str(pos)), (f"var{j}_name", "" if j % 2 else f"v{vid}")]
            pos += array.nbytes
        entries += [("rsed_checksum", "")] if version == "1.4" else []
        lines.append(f"\n[{rank}]\n" + "".join(f"{k:<30} = {v}\n" for k, v in entries) + extra)
    meta = meta_dir / "sector0-group0.fti"
    meta.write_text("".join(lines) + "\n")
    return data_dir, meta


def _protect(ctx, rank: int, fill: int = 0) -> dict[int, np.ndarray]:
    arrays = {}
    for vid, like in _variables(rank).items():
        arrays[vid] = np.frombuffer(bytearray([fill]) * like.nbytes, like.dtype).reshape(like.shape)
        if like.flags.f_contiguous and not like.flags.c_contiguous:
            arrays[vid] = np.asfortranarray(arrays[vid])
        ctx.protect(vid, arrays[vid])
    return arrays


@pytest.mark.parametrize("version", ["1.0", "1.1", "1.4"])
@pytest.mark.parametrize("meta_as", ["file", "directory"])
def test_posix_file_is_read_bit_for_bit(tmp_path, dirs, version, meta_as):
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 5, 2, version=version)
    ctx = ftidask.init(**dirs)
    for rank in range(2):
        arrays = _protect(ctx, rank, fill=0x5A)
        got = ctx.recover_file(data_dir / f"Ckpt5-Rank{rank}.fti", meta=meta if meta_as == "file" else meta.parent)
        assert set(got) == set(arrays)
        for vid, want in _variables(rank).items():
            assert arrays[vid].tobytes() == want.tobytes() and arrays[vid].flags.f_contiguous == want.flags.f_contiguous
    ctx.finalize()


def _refused(ctx, arrays: dict[int, np.ndarray], path: Path, meta: Path, match: str) -> None:
    before = {vid: a.tobytes() for vid, a in arrays.items()}
    with pytest.raises(RecoveryError, match=match):
        ctx.recover_file(path, meta=meta)
    assert {vid: a.tobytes() for vid, a in arrays.items()} == before  # nothing touched


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_damaged_or_cut_file_is_refused_and_arrays_untouched(tmp_path, dirs, version):
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 1, 1, version=version)
    path = data_dir / "Ckpt1-Rank0.fti"
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, fill=0x11)
    raw = path.read_bytes()
    path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    _refused(ctx, arrays, path, meta, "MD5 does not match")
    path.write_bytes(raw[:-8])
    _refused(ctx, arrays, path, meta, "has 336 bytes, its meta file says 344")
    path.write_bytes(raw)
    ctx.recover_file(path, meta=meta)
    assert arrays[0].tobytes() == _variables(0)[0].tobytes()
    ctx.finalize()


def test_protected_variables_must_match_the_file(tmp_path, dirs):
    """Every protected variable must be in the file with its size (FTI stores bytes: no dtype, no shape); a
    variable of the file that is not protected is left out, as FTI_Recover does."""
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 1, 1)
    path = data_dir / "Ckpt1-Rank0.fti"
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    ctx.protect(9, np.zeros(3))
    _refused(ctx, arrays, path, meta, "variable 9 is protected but not in checkpoint file")
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    ctx.protect(7, np.zeros(14))
    _refused(ctx, arrays, path, meta, "variable 7: checkpoint holds 120 bytes, the protected array has 112")
    ctx = ftidask.init(**dirs)
    only = np.zeros(16, "<i4")
    ctx.protect(0, only)
    assert set(ctx.recover_file(path, meta=meta)) == {0}
    assert only.tobytes() == _variables(0)[0].tobytes()
    ctx.protect(5, ftidask.State({}))
    with pytest.raises(RecoveryError):
        ctx.recover_file(path, meta=meta)
    ctx.finalize()


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace("Ckpt1-Rank0.fti", "Ckpt1-Rank9.fti"), "no section .* names Ckpt1-Rank0.fti"),
    (lambda t: "\n".join(x for x in t.splitlines() if not x.startswith("ckpt_checksum")), "no MD5 to verify"),
    (lambda t: t.replace("var1_size                      = 120", "var1_size = 99999999999"), "outside the file"),
    (lambda t: t.replace("var1_size                      = 120", "var1_size = -8"), "not a byte count"),
    (lambda t: t.replace("var1_id                        = 7", "var1_id = 0"), "listed twice"),
    (lambda t: t.replace("var0_id", "nothing_id"), "lists no variable"),
    (lambda t: t + "dcp_layer0_size = 10\n", "differential"),
    (lambda t: "[ckpt_info]\nckpt_type = dcp\n" + t, "differential"),
    (lambda t: "garbage without a section\n" + t, "not a readable FTI meta file"),
    (lambda t: "\0\xff", "not a readable FTI meta file"),
])
def test_hostile_or_unsupported_meta_file_is_a_clean_error(tmp_path, dirs, edit, match):
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 1, 1)
    meta.write_text(edit(meta.read_text()), errors="surrogateescape")
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0, fill=3)
    _refused(ctx, arrays, data_dir / "Ckpt1-Rank0.fti", meta, match)
    ctx.finalize()


def test_missing_meta_is_a_clean_error(tmp_path, dirs):
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 1, 1)
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 0)
    with pytest.raises(RecoveryError, match=r"not an FTI-FF file.*read with its meta file: recover_file\(path, meta="):
        ctx.recover_file(data_dir / "Ckpt1-Rank0.fti")
    _refused(ctx, arrays, data_dir / "Ckpt1-Rank0.fti", tmp_path / "nowhere.fti", "no such FTI meta file")
    _refused(ctx, arrays, data_dir / "Ckpt1-Rank0.fti", data_dir, r"no FTI meta file \(sector")
    ctx.finalize()


def test_cli_verify_with_meta(tmp_path, capsys):
    from ftidask.tools.cli import main as cli_main

    data_dir, meta = _write_fti_posix(tmp_path / "fti", 2, 3)
    assert cli_main(["verify", str(data_dir), "--meta", str(meta.parent)]) == 0
    assert "3 sound, 0 damaged" in capsys.readouterr().out
    path = data_dir / "Ckpt2-Rank1.fti"
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0x40
    path.write_bytes(bytes(raw))
    assert cli_main(["verify", str(path), "--meta", str(meta)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "MD5 does not match" in out and "0 sound, 1 damaged" in out


def test_a_fifo_in_place_of_the_file_or_its_meta_file_is_an_error_not_a_hang(tmp_path):
    """A FIFO planted where FTI's POSIX file or its meta file should be is refused at once (an open would block)."""
    fifo = tmp_path / "Ckpt1-Rank0.fti"
    os.mkfifo(fifo)
    meta = tmp_path / "sector0-group0.fti"
    meta.write_text("[0]\nckpt_file_name = Ckpt1-Rank0.fti\nckpt_file_size = 8\n"
                    "ckpt_checksum = 0123456789abcdef0123456789abcdef\nvar0_id = 0\nvar0_size = 8\n")
    with pytest.raises(FormatError, match="not a regular file"):
        read_posix(fifo, meta)
    os.unlink(meta)
    os.mkfifo(meta)
    with pytest.raises(FormatError):
        read_posix(fifo, meta)


def test_cli_verify_without_meta_says_how_to_check_a_posix_file(tmp_path, capsys):
    """Without --meta a POSIX file cannot be checked (no metadata of its own): the line says so and how, rather
    than only 'damaged file block'."""
    from ftidask.tools.cli import main as cli_main

    data_dir, meta = _write_fti_posix(tmp_path / "fti", 2, 1)
    assert cli_main(["verify", str(data_dir)]) == 1
    out = capsys.readouterr().out
    assert "0 sound, 1 damaged" in out and "verify PATH --meta" in out


def test_a_meta_file_of_very_many_variables_is_read_in_linear_time(tmp_path, dirs):
    """A hostile meta file well under its 16 MiB limit can list half a million variables: the check that no id is
    listed twice must not compare each with all before it (20 000 took half a minute that way; now well under a
    second), and the file is still read, or refused, exactly."""
    import time

    raw = bytes(range(256)) * 4
    (tmp_path / "Ckpt1-Rank0.fti").write_bytes(raw)
    n = 20_000
    lines = ["[0]", "ckpt_file_name = Ckpt1-Rank0.fti", f"ckpt_file_size = {len(raw)}",
             f"ckpt_checksum = {hashlib.md5(raw).hexdigest()}", f"var0_id = 0\nvar0_size = {len(raw)}"]
    lines += [f"var{j}_id = {j}\nvar{j}_size = 0" for j in range(1, n)]
    meta = tmp_path / "sector0-group0.fti"
    meta.write_text("\n".join(lines) + "\n")
    # CPU time of this thread (the read runs here), not the wall clock: on a loaded 2-core machine (CI, another test
    # run) the wall clock measures the other processes too; a quadratic check costs the CPU time all the same.
    start = time.thread_time()
    found = read_posix(tmp_path / "Ckpt1-Rank0.fti", meta)
    assert time.thread_time() - start < 10
    assert len(found.data) == n and bytes(found.data[0]) == raw and all(len(found.data[j]) == 0 for j in range(1, n))
    meta.write_text("\n".join(lines) + f"\nvar{n}_id = 17\nvar{n}_size = 0\n")  # the last id repeats one
    start = time.thread_time()
    with pytest.raises(FormatError, match="variable id 17 is listed twice"):
        read_posix(tmp_path / "Ckpt1-Rank0.fti", meta)
    assert time.thread_time() - start < 10


def test_verify_of_a_directory_parses_its_meta_file_once(tmp_path, capsys, monkeypatch):
    """Found by the hostile-file campaign: `verify DIR --meta` parsed the group's meta file once per rank file (a
    16 MiB meta file takes about 10 s to parse: N files, N times that). The parse is kept by the meta file's bytes:
    once for the directory, and again once the file changed (the same size, rewritten in place)."""
    from ftidask.ftiff import posix
    from ftidask.tools.cli import main as cli_main

    parses = []
    real = posix._parse_meta
    monkeypatch.setattr(posix, "_parse_meta", lambda text, source: parses.append(source) or real(text, source))
    posix._PARSED.clear()
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 2, 3)
    assert cli_main(["verify", str(data_dir), "--meta", str(meta.parent)]) == 0
    assert "3 sound, 0 damaged" in capsys.readouterr().out
    assert len(parses) == 1, parses
    text = meta.read_text()
    digest = hashlib.md5((data_dir / "Ckpt2-Rank1.fti").read_bytes()).hexdigest()
    meta.write_text(text.replace(digest, digest[::-1]))  # rank 1's checksum changed, same size, same inode
    assert cli_main(["verify", str(data_dir), "--meta", str(meta.parent)]) == 1
    assert "2 sound, 1 damaged" in capsys.readouterr().out
    assert len(parses) == 2, parses


def test_verify_of_a_run_of_many_groups_parses_each_meta_file_once(tmp_path, capsys, monkeypatch):
    """A run of many groups has a meta file each, and each rank file's lookup goes through them in order: a cache of
    the last two parses was evicted in turn and every meta file parsed again for every rank file."""
    from ftidask.ftiff import posix
    from ftidask.tools.cli import main as cli_main

    parses = []
    real = posix._parse_meta
    monkeypatch.setattr(posix, "_parse_meta", lambda text, source: parses.append(source) or real(text, source))
    posix._PARSED.clear()
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 2, 3)
    text = meta.read_text()
    meta.rename(meta.with_name("sector0-group9.fti"))  # looked up last
    for group in (1, 2, 3):  # other groups' meta files, of other checkpoint ids: looked up first
        meta.with_name(f"sector0-group{group}.fti").write_text(text.replace("Ckpt2-", f"Ckpt{20 + group}-"))
    assert cli_main(["verify", str(data_dir), "--meta", str(meta.parent)]) == 0
    assert "3 sound, 0 damaged" in capsys.readouterr().out
    assert len(parses) == 4, parses


def test_stored_size_and_realloc_describe_the_posix_file_just_recovered(tmp_path, dirs):
    """After recover_file of FTI's POSIX file, stored_size and realloc described the run's own checkpoint (or none):
    0 and NoCheckpointError on a fresh run; after a checkpoint of 10 ints, 40 bytes, and realloc put an array of 10
    uninitialised ints in place of the 16 just read (the FTI data lost, the next checkpoint saving garbage). They
    describe the file recovered now, as after an FTI-FF file."""
    fti = np.arange(16, dtype="<i4") * 3
    (tmp_path / "fti").mkdir()
    (tmp_path / "fti/Ckpt5-Rank0.fti").write_bytes(fti.tobytes())
    meta = tmp_path / "fti/sector0-group0.fti"
    meta.write_text(f"\n[0]\nckpt_file_name = Ckpt5-Rank0.fti\nckpt_file_size = 64\nckpt_file_maxs = 64\n"
                    f"ckpt_checksum = {hashlib.md5(fti.tobytes()).hexdigest()}\nvar0_id = 0\nvar0_size = 64\n\n")
    for earlier in (False, True):
        ctx = ftidask.init(**dirs)
        if earlier:  # the run checkpointed a smaller variable 0 before reading FTI's file
            ctx.protect(0, np.ones(10, "<i4"))
            ctx.checkpoint(1, 1)
        a = np.zeros(16, "<i4")
        ctx.protect(0, a)
        ctx.recover_file(tmp_path / "fti/Ckpt5-Rank0.fti", meta=meta)
        assert ctx.stored_size(0) == 64
        assert ctx.realloc(0) is a and a.tobytes() == fti.tobytes()  # the recovered array itself, its values kept
        ctx.checkpoint(2, 1)
        ctx._close()
        again = ftidask.init(**dirs)
        b = np.zeros(16, "<i4")
        again.protect(0, b)
        again.recover()
        assert b.tobytes() == fti.tobytes()
        again.finalize()
    ctx = ftidask.init(**dirs)  # an array of another shape but its dtype and byte size: FTI stores no shape
    square = np.zeros((4, 4), "<i4")
    ctx.protect(0, square)
    ctx.recover_file(tmp_path / "fti/Ckpt5-Rank0.fti", meta=meta)
    assert ctx.realloc(0) is square and square.tobytes() == fti.tobytes()  # was a (16,) array of garbage
    ctx.finalize()
