"""What the command line must never do to a user's files: delete outside a run or a run in use, retire a run's
checkpoints through an import, call a checkpoint with lost rank files sound, stop on an odd file or a forged
record with a traceback. Each case was found by a review; the commands run in process (``cli.main``)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import ftidask
from ftidask.tools.cli import main


def _dirs(base, **kw):
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"), **kw}


def _finished_run(base, exec_id="mysim"):
    """A finished run that kept its last checkpoint (7, L4: the README's pattern), the next init restarts it."""
    ctx = ftidask.init(**_dirs(base, exec_id=exec_id, keep_last_ckpt=1))
    a = np.full(4, 42.0)
    ctx.protect(1, a, name="u")
    ctx.checkpoint(7, 4)
    ctx.finalize()


def _ckpt_dir(base):
    (path,) = (base / "Global").rglob("Ckpt7-Rank0.fti")
    return path.parent


def _listing(capsys, base) -> list[str]:
    capsys.readouterr()
    assert main(["list", str(base)]) == 0
    return capsys.readouterr().out.splitlines()[1:]


def test_import_refuses_directories_holding_a_run_to_restart(tmp_path, capsys, monkeypatch):
    """`ftidask import` into directories that hold a run to restart (crashed, or finished with keep_last_ckpt)
    restarted that run and its finalize retired the run's checkpoints: only the import's was left, silently."""
    _finished_run(tmp_path)
    assert main(["export", str(_ckpt_dir(tmp_path)), "--to-zarr", str(tmp_path / "s.zarr")]) == 0
    before = _listing(capsys, tmp_path)
    monkeypatch.chdir(tmp_path)  # the default config's directories: ./Local, ./Global, ./Meta
    assert main(["import", str(tmp_path / "s.zarr"), "--id", "50"]) == 2
    assert "hold run mysim" in capsys.readouterr().err
    assert _listing(capsys, tmp_path) == before
    ctx = ftidask.init(**_dirs(tmp_path, exec_id="mysim"))
    a = np.zeros(4)
    ctx.protect(1, a)
    assert ctx.status() == 2  # the refusal changed nothing of the run (a first version restarted it: status 1)
    ctx.recover()
    assert (a == 42).all()
    ctx.finalize()
    assert main(["import", str(tmp_path / "s.zarr"), "--id", "50"]) == 0  # nothing to restart: the import runs


@pytest.mark.parametrize("value", ["abc", [1], 2.5, True, {}])
def test_import_refuses_a_forged_checkpoint_id(tmp_path, capsys, value):
    """A manifest's checkpoint_id of another type raised a raw ValueError/TypeError/OverflowError, or was cut
    (2.5 -> 2) or taken (true -> 1)."""
    _finished_run(tmp_path)
    store = tmp_path / "s.zarr"
    assert main(["export", str(_ckpt_dir(tmp_path)), "--to-zarr", str(store)]) == 0
    manifest = store / "ftidask-manifest.json"
    record = json.loads(manifest.read_text())
    record["attrs"]["checkpoint_id"] = value
    manifest.write_text(json.dumps(record))
    config = tmp_path / "other.fti"
    config.write_text(f"[basic]\nckpt_dir = {tmp_path}/L2\nglbl_dir = {tmp_path}/G2\nmeta_dir = {tmp_path}/M2\n")
    capsys.readouterr()
    assert main(["import", str(store), str(config)]) == 2
    assert "is not an integer" in capsys.readouterr().err
    assert not (tmp_path / "M2").exists() or not list((tmp_path / "M2").iterdir())


def test_clean_leaves_a_live_run_alone_when_meta_dir_is_ckpt_dir(tmp_path, capsys, monkeypatch):
    """With ckpt_dir = glbl_dir = meta_dir (init takes it), clean took the node0 directory for a run's and deleted
    the live run's newest checkpoint (it said it skipped that run)."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.fti"
    config.write_text("[basic]\nckpt_dir = ./ck\nglbl_dir = ./ck\nmeta_dir = ./ck\n")
    ctx = ftidask.init(str(config), exec_id="live")
    a = np.arange(5.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 10
    ctx.checkpoint(2, 1)
    clean = subprocess.run([sys.executable, "-m", "ftidask", "clean", "--config", str(config), "--yes"],
                           capture_output=True, text=True, timeout=120)  # another process: the run's lock holds
    assert clean.returncode == 0 and "nothing to clean" in clean.stdout, clean.stdout + clean.stderr
    a[:] = -1
    ctx.recover()
    assert (a == np.arange(5.0) + 10).all()
    ctx.finalize()
    assert main(["clean", "--config", str(config), "--yes"]) == 0  # finished: its directories go, once each
    out = capsys.readouterr().out
    assert out.count("ck/live\n") == 1 and "removed 1 directories" in out and not (tmp_path / "ck" / "live").exists()


def test_clean_with_a_forged_current_exec_id_and_an_eof_at_its_question(tmp_path, capsys, monkeypatch):
    """A current_exec_id record naming a list raised a TypeError traceback after the directories were removed;
    Ctrl-D at clean's question raised an EOFError traceback."""
    _finished_run(tmp_path, "run1")
    (tmp_path / "Meta" / "current_exec_id").write_text(json.dumps({"exec_id": [1]}))

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(""))  # a terminal that is closed at once: EOF
    assert main(["clean", str(tmp_path)]) == 1
    assert (tmp_path / "Meta" / "run1").is_dir()
    assert main(["clean", str(tmp_path), "--yes"]) == 0
    assert not (tmp_path / "Meta" / "run1").exists() and not (tmp_path / "Meta" / "current_exec_id").exists()


def test_list_tells_committed_checkpoints_whose_files_are_gone(tmp_path, capsys):
    """A committed checkpoint with a rank file missing was listed "sound"; one with every file gone was not
    listed at all; a dangling link named like a checkpoint file stopped the listing (exit 2)."""
    ctx = ftidask.init(**_dirs(tmp_path, exec_id="run1", keep_last_ckpt=1))
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(2, 4)
    ctx.checkpoint(3, 1)
    ctx._close()  # a crash: both stay committed
    (only,) = (tmp_path / "Local").rglob("Ckpt3-Rank0.fti")
    only.unlink()
    (only.parent / "Ckpt3-Rank1.fti").symlink_to(tmp_path / "nowhere")
    rows = _listing(capsys, tmp_path)
    assert len(rows) == 2 and rows[0].split()[-1] == "sound"
    assert "MISSING 1 of 1 rank files" in rows[1] and "DAMAGED (1 of 1 files)" in rows[1], rows
    (only.parent / "Ckpt3-Rank1.fti").unlink()
    rows = _listing(capsys, tmp_path)
    assert rows[1].split()[1:3] == ["3", "1"] and rows[1].endswith("MISSING 1 of 1 rank files"), rows


def test_export_refuses_files_of_different_checkpoints_in_one_directory(tmp_path, capsys):
    """`ftidask export DIR` joined every Ckpt*-Rank* file of the directory: files of two runs as one checkpoint's
    ranks, two checkpoints of one rank as one store."""
    ctx = ftidask.init(**_dirs(tmp_path, exec_id="run1", keep_last_ckpt=1))
    a = np.arange(10.0)
    ctx.protect(1, a)
    ctx.checkpoint(2, 4)
    a += 1
    ctx.checkpoint(3, 1)
    ctx._close()  # a crash: both stay
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for path in tmp_path.rglob("Ckpt*-Rank0.fti"):
        (mixed / path.name).write_bytes(path.read_bytes())
    assert sorted(p.name for p in mixed.iterdir()) == ["Ckpt2-Rank0.fti", "Ckpt3-Rank0.fti"]
    capsys.readouterr()
    assert main(["export", str(mixed), "--to-zarr", str(tmp_path / "m.zarr")]) == 2
    assert "different checkpoints" in capsys.readouterr().err and not (tmp_path / "m.zarr").exists()
    (mixed / "Ckpt2-Rank0.fti").unlink()
    assert main(["export", str(mixed), "--to-zarr", str(tmp_path / "m.zarr")]) == 0  # one checkpoint's file


@pytest.mark.parametrize("dest", [".", "", "sub/.."])
def test_export_to_a_directory_that_names_no_store(tmp_path, capsys, monkeypatch, dest):
    """`--to-zarr . --overwrite` raised a raw ValueError from deep inside."""
    _finished_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    capsys.readouterr()
    assert main(["export", str(_ckpt_dir(tmp_path)), "--to-zarr", dest, "--overwrite"]) == 2
    assert ("names no store" if dest else "an empty value for to_zarr") in capsys.readouterr().err


def test_export_overwrite_replaces_a_store_only(tmp_path, capsys):
    """`--overwrite` replaced any directory: `--to-zarr Global --overwrite` deleted the run's level-4 checkpoints."""
    _finished_run(tmp_path)
    source = _ckpt_dir(tmp_path)
    for dest in (tmp_path / "Global", tmp_path / "afile"):
        (tmp_path / "afile").write_text("mine")
        assert main(["export", str(source), "--to-zarr", str(dest), "--overwrite"]) == 2
        assert "not a Zarr store" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine" and (source / "Ckpt7-Rank0.fti").is_file()
    store = tmp_path / "s.zarr"
    assert main(["export", str(source), "--to-zarr", str(store)]) == 0
    assert main(["export", str(source), "--to-zarr", str(store), "--overwrite"]) == 0  # a store: replaced


def test_odd_destinations_and_names_get_one_line(tmp_path, capsys, caplog):
    """An export under a file printed two "could not remove" warnings before its error; a one-byte dCP file (or a
    short MPI-IO one) was called a config file."""
    _finished_run(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["export", str(_ckpt_dir(tmp_path)), "--to-zarr", str(tmp_path / "afile" / "s.zarr")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and "could not remove" not in caplog.text
    for name in ("dcp-id3-rank0.fti", "Ckpt2-mpiio.fti", "Ckpt-2-Rank0.fti"):
        (tmp_path / name).write_text("x")
        main(["inspect", str(tmp_path / name)])
        assert "config file" not in capsys.readouterr().err, name


def test_list_says_what_verify_says_of_an_l3_file_and_where_no_record_is(tmp_path, capsys):
    """A byte changed in a container's slack of an L3 rank file (no container hash covers it; the parity's record of
    the whole file does): `verify` said DAMAGED, `list` said sound. Files listed from a directory without Meta were
    "not committed"."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config
    from ftidask.storage.files import find_paths

    config = load_config(None, **_dirs(tmp_path, local_test=1, node_size=1, group_size=4))

    def program(t):
        ctx = Context(config, t)
        ctx.protect(1, np.ones(1000))
        ctx.checkpoint(1, 3)
        ctx.protect(1, np.ones(500))  # smaller: the containers keep their size, with slack
        ctx.checkpoint(2, 3)
        ctx._close()

    assert run_ranks(config, 4, program, wait=60)[1] == []
    (path,) = find_paths(tmp_path / "Local", "Ckpt2-Rank1.fti")
    raw = bytearray(path.read_bytes())
    raw[path.stat().st_size // 2 + 2000] ^= 0xFF  # in the slack of the shrunk variable's container
    path.write_bytes(bytes(raw))
    assert main(["verify", str(path)]) == 1
    rows = _listing(capsys, tmp_path)
    assert "DAMAGED (1 of 4 files)" in rows[-1], rows
    capsys.readouterr()
    assert main(["list", str(path.parent)]) == 0
    assert "commit not checked (no" in capsys.readouterr().out


def test_a_name_the_terminal_cannot_encode_is_escaped(tmp_path):
    """A variable named from an undecodable file name (a lone surrogate: protect takes it, the file keeps it as
    JSON) made ``ftidask inspect`` die of a raw UnicodeEncodeError on a UTF-8 terminal."""
    import os

    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(4.0), name=os.fsdecode(b"temp\xff"))
    info = ctx.checkpoint(1, 4)
    ctx._close()
    (path,) = (tmp_path / "Global").glob(f"**/ckpt1.s{info.seq}/Ckpt1-Rank0.fti")
    done = subprocess.run([sys.executable, "-m", "ftidask", "inspect", str(path)], capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"temp\\udcff" in done.stdout


def test_a_retired_checkpoint_being_deleted_is_not_listed(tmp_path, capsys):
    """A retired checkpoint's directory renamed to ``.trash-*`` (deleted in the background, or left by a crash) was
    listed as a checkpoint "not committed", and DAMAGED when deleted while it was checked."""
    import shutil

    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(4.0))
    ctx.checkpoint(1, 1)
    (own,) = (tmp_path / "Local").rglob("Ckpt1-Rank0.fti")
    trash = own.parent.parent / ".trash-ckpt0.s0-123-abcd"
    trash.mkdir()
    shutil.copy(own, trash / "Ckpt0-Rank0.fti")
    capsys.readouterr()
    assert main(["list", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "Ckpt1-Rank0.fti" in listed or " 1 " in listed
    assert ".trash-" not in listed and "Ckpt0" not in listed
    assert main(["verify", str(tmp_path / "Local")]) == 0
    assert ".trash-" not in capsys.readouterr().out
    ctx.finalize()


def test_a_differential_l3_runs_spare_parity_is_checked_as_parity(tmp_path, capsys):
    """dCP's spare parity files (SpareRSed-Rank{r}.fti) were parsed as FTI-FF rank files: `verify` called a healthy
    run DAMAGED (exit 1) and `list` showed a row '? ? ... DAMAGED, not committed'."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    cfg = load_config(None, **_dirs(tmp_path, local_test=1, node_size=1, group_size=2, enable_dcp=1, verbosity=4))

    def write(t):
        ctx = Context(cfg, t)
        u = np.arange(5000.0) + t.rank
        ctx.protect(1, u)
        ctx.checkpoint(1, 7)
        u[:10] = -1
        ctx.checkpoint(2, 7)
        ctx._close()  # the program dies: its spares stay

    assert run_ranks(cfg, 2, write, wait=60)[1] == []
    assert list((tmp_path / "Local").rglob("SpareRSed-Rank*.fti"))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "Local")]) == 0
    assert "DAMAGED" not in capsys.readouterr().out
    assert main(["list", str(tmp_path)]) == 0
    assert "DAMAGED" not in capsys.readouterr().out


def test_a_sound_file_in_place_of_the_committed_one_is_listed_damaged(tmp_path, capsys):
    """Checkpoint 1's (sound) file copied over checkpoint 2's: `list` said checkpoint 2 was sound, under id 1 (its
    file's own table), where recover() refuses it as not the file its commit record names."""
    import shutil

    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    a = np.arange(4.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 4)
    (first,) = (tmp_path / "Global").rglob("Ckpt1-Rank0.fti")
    (second,) = (tmp_path / "Global").rglob("Ckpt2-Rank0.fti")
    shutil.copy(first, second)
    capsys.readouterr()
    assert main(["list", str(tmp_path)]) == 0
    seq = second.parent.name.split(".s")[1]  # ckpt2.s{seq}: the listing's fourth column
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.split()[3:4] == [seq]]
    assert line.split()[1] == "2" and "DAMAGED" in line, line
    ctx._close()


@pytest.mark.parametrize("argv", [["clean", "--config", "", "--yes"], ["clean", "", "--yes"],
                                  ["list", "--config", ""], ["verify", "Ckpt7-Rank0.fti", "--meta", ""]])
def test_an_empty_path_argument_is_refused_not_taken_for_the_current_directory(tmp_path, capsys, monkeypatch, argv):
    """``clean --config "$UNSET" --yes`` (an empty string: Path("") is ".") removed the current directory's finished
    run; ``verify --meta ""`` dropped the meta file silently. An empty path is an error (status 2), nothing removed."""
    _finished_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(argv) == 2
    assert "ftidask: error: an empty value for" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert main(["clean", ".", "--yes"]) == 0  # the same command with a path does remove it
    assert not list((tmp_path / "Global").rglob("Ckpt7-Rank0.fti"))
