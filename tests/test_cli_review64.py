"""The command line, review 64: a level-4 Zarr store that lost its manifest, an export store of any name, a damaged
dCP spare in `list`, names with terminal control characters, export's rebuild warning, import's message."""

import logging
import shutil
from pathlib import Path

import numpy as np

import ftidask
from ftidask.tools.cli import main


def _dirs(base: Path, **kw) -> dict:
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"), **kw}


def _config(base: Path, advanced: dict | None = None, **kw) -> Path:
    """An INI config naming ``base``'s directories (absolute: the tests' working directory is elsewhere), with
    ``kw`` in [basic] and ``advanced`` in [advanced] (FTI reads each key from its own section)."""
    path = base / "config.fti"
    path.write_text("[basic]\n" + "".join(f"{k} = {v}\n" for k, v in _dirs(base, **kw).items())
                    + "[advanced]\n" + "".join(f"{k} = {v}\n" for k, v in (advanced or {}).items()))
    return path


def _rows(capsys, base: Path) -> list[str]:
    capsys.readouterr()
    assert main(["list", str(base)]) == 0
    return capsys.readouterr().out.splitlines()[1:]


# --- 2: a level-4 Zarr store that lost its manifest --------------------------------------------------------------

def test_a_level4_zarr_store_that_lost_its_manifest_is_damaged(tmp_path, capsys):
    """The store was passed over (only stores holding ftidask-manifest.json were collected): `verify` said every
    file sound (exit 0), and with only that store `verify config.fti` said "no checkpoint files" (exit 2)."""
    config = _config(tmp_path, {"l4_format": "zarr"})
    ctx = ftidask.init(str(config))
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 4)
    ctx._close()  # the program dies: its checkpoint stays
    (store,) = (tmp_path / "Global").rglob("Ckpt1-Rank0.zarr")
    (store / "ftidask-manifest.json").unlink()
    for target in (config, tmp_path / "Global", tmp_path):
        capsys.readouterr()
        assert main(["verify", str(target)]) == 1, target
        out = capsys.readouterr().out
        assert f"DAMAGED  {store}" in out and "no ftidask-manifest.json" in out and "0 sound, 1 damaged" in out
    (row,) = _rows(capsys, tmp_path)
    assert row.split()[1:4] == ["1", "4", "1"] and "DAMAGED (1 of 1 files)" in row and "MISSING" not in row


def test_a_zarr_store_without_manifest_of_another_name_is_not_taken_for_a_checkpoint(tmp_path, capsys):
    """Only a store that looks like a checkpoint's (ftidask's level-4 name, or *.zarr) is reported without its
    manifest: a Zarr group of another name without one is no checkpoint (nothing to verify: exit 2)."""
    group = tmp_path / "data"
    group.mkdir()
    (group / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    assert main(["verify", str(tmp_path)]) == 2
    shutil.move(group, tmp_path / "data.zarr")
    assert main(["verify", str(tmp_path)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


# --- 3: an export store whose name does not end in .zarr ----------------------------------------------------------

def test_verify_checks_an_export_store_by_its_content_not_its_name(tmp_path, capsys):
    """`export --to-zarr state` writes a store named `state`: `verify state` said "no FTI-FF files" (exit 2) even
    once it was damaged, and `verify .` left it out (exit 0)."""
    config = _config(tmp_path)
    ctx = ftidask.init(str(config))
    ctx.protect(1, np.arange(100.0), name="a")
    ctx.checkpoint(1, 4)
    ctx._close()
    store = tmp_path / "state"
    assert main(["export", str(config), "--to-zarr", str(store)]) == 0
    capsys.readouterr()
    assert main(["verify", str(store)]) == 0
    assert f"OK       {store}\n1 sound, 0 damaged" in capsys.readouterr().out
    chunk = next(p for p in store.rglob("*") if p.is_file() and p.parent.name == "c")
    chunk.unlink()
    assert main(["verify", str(store)]) == 1
    assert f"DAMAGED  {store}" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  {store}" in out and "1 sound, 1 damaged" in out  # the run's file, and the store
    assert not [line for line in out.splitlines() if line.startswith("OK") and str(store) in line]  # its groups


# --- 5: a damaged dCP spare in `list` -------------------------------------------------------------------------------

def test_list_shows_a_damaged_dcp_spare_as_the_previous_differential_checkpoint(tmp_path, capsys):
    """After one byte of the spare (dcp/Spare-Rank0.fti, named by commits/fallback-l4.json) flipped, `list` showed
    `? ? 0 ? ... DAMAGED, not committed`: its id, level and seq came from its own (unreadable) table."""
    ctx = ftidask.init(**_dirs(tmp_path, enable_dcp=1))
    a = np.arange(1000.0)
    ctx.protect(1, a, name="a")
    ctx.checkpoint(1, 8)
    a += 1
    ctx.checkpoint(2, 8)
    (fallback,) = ctx.state.fallbacks()
    before = _rows(capsys, tmp_path)
    (spare,) = (tmp_path / "Global").rglob("dcp/Spare-Rank0.fti")
    raw = bytearray(spare.read_bytes())
    raw[1000] ^= 0xFF
    spare.write_bytes(bytes(raw))
    after = _rows(capsys, tmp_path)
    ctx._close()
    assert len(after) == len(before) == 2
    old, new = (line.split() for line in after)
    assert old[:4] == [ctx.exec_id, "1", "4", str(fallback.seq)] and old[4] != "?"
    assert "DAMAGED (1 of 1 files), the previous differential checkpoint" in after[0], after
    assert "not committed" not in after[0] and new[1] == "2" and new[-1] == "sound"
    assert "sound, the previous differential checkpoint" in before[0]


# --- 6: names with terminal control characters -----------------------------------------------------------------------

EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[31mEVIL"


def test_export_prints_a_variable_name_with_control_characters_escaped(tmp_path, capsys):
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(4.0), name=EVIL)
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = (tmp_path / "Local").rglob("Ckpt1-Rank0.fti")
    assert main(["export", str(path), "--to-zarr", str(tmp_path / "out.zarr")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and f"  {ascii(EVIL)}\n" in out


def test_verify_prints_file_names_with_control_characters_escaped(tmp_path, capsys):
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(4.0), name="a")
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = (tmp_path / "Local").rglob("Ckpt1-Rank0.fti")
    odd = tmp_path / f"copy{EVIL}"
    odd.mkdir()
    shutil.copy(path, odd / "Ckpt1-Rank0.fti")
    shutil.copy(path, odd / f"Ckpt1-Rank1{EVIL}.fti")
    raw = bytearray((odd / f"Ckpt1-Rank1{EVIL}.fti").read_bytes())
    raw[-40] ^= 0xFF
    (odd / f"Ckpt1-Rank1{EVIL}.fti").write_bytes(bytes(raw))
    assert main(["verify", str(odd)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert f"OK       {ascii(str(odd / 'Ckpt1-Rank0.fti'))}" in out and "DAMAGED  " in out
    assert "\\x1b[2J" in out.splitlines()[1]  # the damaged file's reason names it, escaped


# --- 7: export's rebuild warning -------------------------------------------------------------------------------------

def test_export_names_only_the_ranks_whose_files_it_rebuilt(tmp_path, capsys, caplog):
    """Only rank 0's L3 file lost: the warning said "rebuilt the lost files of old ranks [0, 1]"."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    config = _config(tmp_path, {"local_test": 1}, node_size=1, group_size=2)

    def program(t):
        ctx = Context(load_config(str(config)), t)
        ctx.protect(1, np.arange(1000.0) + t.rank)
        ctx.checkpoint(1, 3)
        ctx._close()  # the program dies: its checkpoint stays

    assert run_ranks(load_config(str(config)), 2, program, wait=60)[1] == []
    (lost,) = (tmp_path / "Local").rglob("Ckpt1-Rank0.fti")
    lost.unlink()
    (kept,) = (tmp_path / "Local").rglob("Ckpt1-Rank1.fti")
    kept_bytes = kept.read_bytes()
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        assert main(["export", str(config), "--to-zarr", str(tmp_path / "out.zarr")]) == 0
    warnings = [r.getMessage() for r in caplog.records if "rebuilt" in r.getMessage()]
    assert warnings == ["checkpoint 1 (level 3): rebuilt the lost or damaged files of old ranks [0] from their group"]
    assert lost.is_file() and kept.read_bytes() == kept_bytes


# --- minor: import's message ---------------------------------------------------------------------------------------

def test_import_says_the_level_its_checkpoint_is_kept_at(tmp_path, capsys):
    """`import --level 1 --id 7` said "as checkpoint 7 (level 1)": keep_last_ckpt keeps it at level 4."""
    ctx = ftidask.init(**_dirs(tmp_path / "src"))
    ctx.protect(1, np.arange(4.0), name="a")
    ctx.checkpoint(3, 1)
    ctx._close()
    (path,) = (tmp_path / "src" / "Local").rglob("Ckpt3-Rank0.fti")
    store = tmp_path / "s.zarr"
    assert main(["export", str(path), "--to-zarr", str(store)]) == 0
    for name, level, said in (("one", "1", "(written at level 1, kept at level 4)"), ("four", "4", "(level 4)")):
        (tmp_path / name).mkdir()
        config = _config(tmp_path / name)
        capsys.readouterr()
        assert main(["import", str(store), str(config), "--level", level, "--id", "7"]) == 0
        assert f"as checkpoint 7 {said};" in capsys.readouterr().out
        (row,) = _rows(capsys, tmp_path / name)
        assert row.split()[1:3] == ["7", "4"]


def test_list_names_a_run_fti_wrote_by_its_exec_id(tmp_path, capsys):
    """FTI keeps its files at ``{exec_id}/l{level}/Ckpt{id}-Rank{r}.fti``, a directory less deep than ftidask's: a
    config whose directories hold FTI's own files (a program migrating with its config.fti) was listed as runs named
    ``node0`` and ``Global``, id ``?``, and told to "give the run's config" although it was given."""
    data = Path(__file__).parent / "data" / "fti_written" / "r2"
    run = "2023-05-04_10-20-30"
    for src, dest in (("Ckpt2-Rank0.fti", f"Local/node0/{run}/l1"), ("Ckpt3-Rank0.fti", f"Global/{run}/l4")):
        (tmp_path / dest).mkdir(parents=True)
        shutil.copyfile(data / src, tmp_path / dest / src)
    config = tmp_path / "config.fti"
    config.write_text(f"[basic]\nckpt_dir = {tmp_path}/Local\nglbl_dir = {tmp_path}/Global\nmeta_dir = {tmp_path}/Meta"
                      f"\n[restart]\nexec_id = {run}\n[advanced]\nlocal_test = 1\n")
    assert main(["list", str(config)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:6] for r in rows] == [[run, "(FTI)", "2", "1", "-", "?"], [run, "(FTI)", "3", "4", "-", "?"]], rows
    assert all("written by FTI" in " ".join(r) and "--config" not in " ".join(r) for r in rows), rows


def test_list_names_fti_s_mpiio_file_by_its_run(tmp_path, capsys):
    """FTI's MPI-IO level-4 file (every rank's part in one file, no FTI-FF metadata) was a DAMAGED run named
    ``Global``; it is checked with its meta file (verify --meta), and listed as the FTI run's checkpoint."""
    from test_fti_mpiio import EXEC, _write_fti_mpiio
    from test_fti_mpiio import _config as mpiio_config

    _write_fti_mpiio(tmp_path, 8, [0, 1, 2, 3])
    assert main(["list", str(mpiio_config(tmp_path))]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:5] for r in rows] == [[EXEC, "(FTI)", "8", "4", "-"]], rows
    assert "DAMAGED" not in " ".join(rows[0]) and "verify --meta" in " ".join(rows[0]), rows
