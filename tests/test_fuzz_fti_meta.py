"""Seeded mutation fuzz of FTI's meta files (INI) and the files they describe, read by ftidask's FTI readers.

FTI's POSIX files (:mod:`ftidask.ftiff.posix`), its MPI-IO shared file (:mod:`ftidask.ftiff.fti_mpiio`) and a
level-3 group rebuilt from FTI's parity (:func:`ftidask.tools.fti_run.recover_fti_run`) take their sizes, ids and
names from the meta files: here those files, the FTI config and the data files are damaged the way a hostile
checker damages them (values 0, -1, 2**31, 2**63 - 1, 2**64 - 1, not numbers, names with ``..`` and ``/``,
sections and keys duplicated or dropped, continuation lines, non-UTF-8 bytes, bit flips and cuts). Each read gives
an ftidask error or bytes the file holds, verified; an array is never touched by a refusal; the command line
prints no traceback. A few hundred cases by default (seeded: the same every run), many more with ``-m slow``.
The campaign that found the bugs fixed with this file ran the same mutators over 20 000 cases.
"""

from __future__ import annotations

import contextlib
import io
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_fti_l3_decode import EXEC as L3_EXEC
from test_fti_l3_decode import _expected as l3_expected
from test_fti_l3_decode import _l3
from test_fti_l3_decode import _write_run as write_l3_run
from test_fti_mpiio import _write_fti_mpiio
from test_fti_posix import _write_fti_posix

import ftidask
from ftidask.ftiff.fti_mpiio import read_mpiio, verify_mpiio
from ftidask.ftiff.posix import read_posix, verify_posix
from ftidask.model.errors import FormatError, FTIError
from ftidask.tools.cli import main as cli_main
from ftidask.tools.fti_run import recover_fti_run

NUMBERS = [0, -1, 1, 7, 2**31 - 1, 2**31, -2**31, 2**32, 2**40, 2**60, 2**63 - 1, -2**63, 2**64 - 1, 10**30]
WORDS = ["", "abc", "1e3", "0x10", " 12 34", "\u0663", "\uff11", "../../etc/x", "a/b", "/etc/passwd", "..",
         "Ckpt1-Rank0.fti", "Ckpt1-Rank1.fti", "Ckpt3-Rank4.fti", "dcp", "full", "0" * 32, "d41d8cd98f00b20",
         "x" * 3000, "%(x)s", "1 ; comment"]
LINES = ["=", "[", "key", "[DEFAULT]", "var9_id = 3", "ckpt_type = dcp", "dcp_layer0_size = 5", "[99]", "[-1]",
         "[ckpt_info]", "[0]", "  continued"]


def mutate_ini(rng: random.Random, text: str) -> bytes:
    """``text`` (an INI file) with one to three structural or value mutations."""
    lines = text.split("\n")
    for _ in range(rng.randint(1, 3)):
        op, at = rng.randrange(9), rng.randrange(len(lines) + 1)
        keyed = [j for j, line in enumerate(lines) if "=" in line]
        if op <= 2 and keyed:  # a value replaced
            j = rng.choice(keyed)
            value = rng.choice(WORDS) if rng.random() < 0.5 else str(rng.choice(NUMBERS) + rng.randint(-1, 1))
            lines[j] = lines[j].split("=", 1)[0] + "= " + value
        elif op == 3 and lines:  # a line dropped or repeated
            j = rng.randrange(len(lines))
            lines[j:j + 1] = [] if rng.random() < 0.5 else [lines[j]] * 2
        elif op == 4:  # a section repeated elsewhere
            heads = [j for j, line in enumerate(lines) if line.startswith("[")] or [0]
            h = rng.choice(heads)
            end = next((j for j in heads if j > h), len(lines))
            lines[at:at] = lines[h:end]
        elif op == 5:
            lines.insert(at, rng.choice(LINES))
        elif op == 6 and keyed:  # a key renamed
            j = rng.choice(keyed)
            lines[j] = rng.choice(["var0_id", "var1_size", "var0_pos", "ckpt_file_size", "ckpt_file_maxs",
                                   "ckpt_checksum", "rsed_checksum", "ckpt_file_name", "var5_id"]) + " =" + \
                lines[j].split("=", 1)[1]
        elif op == 7:  # many variables
            lines.insert(at, "\n".join(f"var{j}_id = {j}\nvar{j}_size = 0" for j in range(rng.choice([20, 300]))))
        else:  # bytes of the text damaged
            return mutate_bytes(rng, "\n".join(lines).encode("utf-8", "surrogateescape"))
    return "\n".join(lines).encode("utf-8", "surrogateescape")


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    """``raw`` with one to three bit flips, byte runs, cuts or insertions."""
    out = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        op, at = rng.randrange(4), rng.randrange(len(out) + 1)
        if op == 0 and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[at:at + 8] = bytes([rng.choice([0, 0xFF, rng.randrange(256)])]) * 8
        elif op == 2:
            del out[at:]
        else:
            out[at:at] = rng.randbytes(rng.randint(1, 8))
    return bytes(out)


def _cli_clean(argv: list[str]) -> None:
    """The command line on ``argv``: an exit status of 0-2 and no traceback."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    assert code in (0, 1, 2) and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]


def _recover_untouched(ctx, arrays: dict[int, np.ndarray], **kwargs) -> None:
    """``recover_file``: done, or an ftidask error with every array as it was."""
    for array in arrays.values():
        array.fill(0x5A)
    try:
        ctx.recover_file(**kwargs)
    except FTIError:
        assert all((a.view(np.uint8) == 0x5A).all() for a in arrays.values()), "a refusal touched an array"


def _held(found, raw: bytes) -> None:
    """Every buffer an accepted read returns is bytes of the file."""
    for buf in found.data.values():
        assert bytes(buf) in raw


def _posix_cases(tmp_path: Path, seed: int, count: int) -> None:
    data_dir, meta = _write_fti_posix(tmp_path / "fti", 1, 3, version="1.4")
    texts = meta.read_text()
    rank_files = {r: (data_dir / f"Ckpt1-Rank{r}.fti").read_bytes() for r in range(3)}
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4)
    arrays = {vid: np.zeros(n, "u1") for vid, n in ((0, 64), (7, 120), (2, 96), (3, 64), (4, 0))}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    for case in range(seed * count, (seed + 1) * count):
        rng = random.Random(case)
        meta.write_bytes(mutate_ini(rng, texts) if rng.random() < 0.8 else texts.encode())
        rank = rng.randrange(3)
        path = data_dir / f"Ckpt1-Rank{rank}.fti"
        for r, raw in rank_files.items():
            (data_dir / f"Ckpt1-Rank{r}.fti").write_bytes(mutate_bytes(rng, raw) if r == rank and
                                                         rng.random() < 0.3 else raw)
        where = meta if rng.random() < 0.5 else meta.parent
        how = case % 10
        try:
            if how < 6:
                _held(read_posix(path, where), path.read_bytes())
            elif how < 8:
                verify_posix(path, where)
        except FormatError:
            pass
        if how == 8:
            _cli_clean(["verify", str(path if rng.random() < 0.5 else data_dir), "--meta", str(where)])
        elif how == 9:
            _recover_untouched(ctx, arrays, path=path, meta=where)
    ctx.finalize()


def _mpiio_cases(tmp_path: Path, seed: int, count: int) -> None:
    path, meta = _write_fti_mpiio(tmp_path / "fti", 3, [0, 1, 2, 4, 5], group_size=2)
    metas = sorted(meta.iterdir())
    texts = {m: m.read_text() for m in metas}
    raw = path.read_bytes()
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4)
    arrays = {vid: np.zeros(n, "u1") for vid, n in ((0, 20), (5, 64), (2, 8), (3, 0))}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    for case in range(seed * count, (seed + 1) * count):
        rng = random.Random(case)
        damaged = rng.choice(metas)
        for m, text in texts.items():
            m.write_bytes(mutate_ini(rng, text) if m == damaged and rng.random() < 0.85 else text.encode())
        path.write_bytes(mutate_bytes(rng, raw) if rng.random() < 0.25 else raw)
        where = meta if rng.random() < 0.7 else damaged
        rank = rng.choice([0, 1, 2, 4, 5, 3])
        how = case % 10
        try:
            if how < 6:
                _held(read_mpiio(path, where, rank), path.read_bytes())
            elif how < 8:
                verify_mpiio(path, where)
        except FormatError:
            pass
        if how == 8:
            _cli_clean(["verify", str(path), "--meta", str(where)])
        elif how == 9:
            _recover_untouched(ctx, arrays, path=path, meta=where, rank=1)
    ctx.finalize()


def test_posix_meta_and_file_damage_gives_format_errors_or_verified_bytes(tmp_path):
    _posix_cases(tmp_path, 0, 150)


def test_mpiio_meta_and_file_damage_gives_format_errors_or_verified_bytes(tmp_path):
    _mpiio_cases(tmp_path, 0, 150)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 11))
def test_posix_and_mpiio_damage_many_cases(tmp_path, seed):
    _posix_cases(tmp_path / "posix", seed, 500)
    _mpiio_cases(tmp_path / "mpiio", seed, 500)


def _l3_cases(tmp_path: Path, seed: int, count: int) -> None:
    """recover_fti_run of rank g of an FTI group of 4 (POSIX and FTI-FF) whose level-3 files, meta file or config
    are damaged, rank g's own file deleted most often (then rebuilt from FTI's parity): its arrays get its bytes
    exactly, or a NoCheckpointError/ConfigError leaves them untouched."""
    protos = {kind: tmp_path / f"proto-{kind}" for kind in ("posix", "ftiff")}
    for kind, proto in protos.items():
        write_l3_run(proto, kind)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4)
    for case in range(seed * count, (seed + 1) * count):
        rng = random.Random(case)
        kind, g = rng.choice(sorted(protos)), rng.randrange(4)
        root = tmp_path / "case"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(protos[kind], root)
        config = root / "config.fti"
        config.write_text(config.read_text().replace(str(protos[kind]), str(root)))
        if rng.random() < 0.7:
            (_l3(root, g) / f"Ckpt1-Rank{g}.fti").unlink()
        meta = root / f"Meta/{L3_EXEC}/l3/sector0-group0.fti"
        what = rng.random()
        if what < 0.25:
            config.write_bytes(mutate_ini(rng, config.read_text()))
        elif what < 0.55 and meta.exists():
            meta.write_bytes(mutate_ini(rng, meta.read_text()))
        else:
            i = rng.randrange(4)
            target = _l3(root, i) / rng.choice([f"Ckpt1-Rank{i}.fti", f"Ckpt1-RSed{i}.fti"])
            if target.exists():
                target.write_bytes(mutate_bytes(rng, target.read_bytes()))
        want = l3_expected(kind, g)
        arrays = {vid: np.full(len(raw), 0x5A, "u1") for vid, raw in want.items()}
        for vid, array in arrays.items():
            ctx.protect(vid, array)
        try:
            recover_fti_run(ctx, config, g)
        except FTIError:
            assert all((a == 0x5A).all() for a in arrays.values()), "a refusal touched an array"
        else:  # a damaged meta file may list the variables otherwise: what is read is still the verified file's
            assert b"".join(a.tobytes() for a in arrays.values()) == b"".join(want.values()) or kind == "posix"
        assert not [p for p in root.rglob("*.tmp*")], "a temporary file of a rebuild was left"
    ctx.finalize()


def test_fti_level_3_damage_gives_the_rank_exactly_or_a_clean_error(tmp_path):
    _l3_cases(tmp_path, 0, 15)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 11))
def test_fti_level_3_damage_many_cases(tmp_path, seed):
    _l3_cases(tmp_path, seed, 200)


def test_the_mutators_are_seeded():
    """The same seed gives the same mutation: a failing case is found again by its number."""
    text = "[0]\nckpt_file_size = 12\nvar0_id = 0\n"
    assert mutate_ini(random.Random(7), text) == mutate_ini(random.Random(7), text)
    assert mutate_bytes(random.Random(7), b"abcdef" * 9) == mutate_bytes(random.Random(7), b"abcdef" * 9)
