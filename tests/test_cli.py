"""The command line: inspect, verify, list, clean (in-process and as a real subprocess)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths
from ftidask.tools.cli import main


def _run(dirs, base):
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(1000.0), name="density")
    ctx.checkpoint(1, 4)
    ctx.checkpoint(2, 1)
    return ctx


def test_inspect_text_and_json(dirs, tmp_path, capsys):
    _run(dirs, tmp_path)
    (path,) = Path(dirs["ckpt_dir"]).glob("node0/*/l1/*/Ckpt2-Rank0.fti")
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    for label in ("DATASTRUCTURE BEGIN", "DataBase-id: 0", "numvars: 1", "dbsize: 8076", "Var-id: 0", "id: 1",
                  "idx: 0", "containerid: 0", "hascontent: true", "dptr: 0", "fptr: 172", "chunksize: 8000",
                  "containersize: 8000", "DATASTRUCTURE END", "'density'"):
        assert label in text, label
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blocks"][0]["vars"][0]["fptr"] == 172 and data["table"]["vars"][0]["name"] == "density"
    assert main(["inspect", str(tmp_path / "nope.fti")]) == 2


def test_verify_list_clean(dirs, tmp_path, capsys):
    ctx = _run(dirs, tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert "2 sound, 0 damaged" in capsys.readouterr().out
    assert main(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert ctx.exec_id in listing and listing.count("sound") == 2
    (path,) = Path(dirs["glbl_dir"]).glob("*/l4/*/Ckpt1-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path)]) == 1
    assert main(["list", str(tmp_path)]) == 0
    assert "DAMAGED" in capsys.readouterr().out
    ctx._close()  # the run's process has ended: clean skips a live run (tests/test_run_isolation.py)
    # clean refuses without confirmation when nobody can answer, then removes with --yes
    proc = subprocess.run([sys.executable, "-m", "ftidask", "clean", str(tmp_path)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.returncode == 2 and "--yes" in proc.stderr
    assert main(["clean", str(tmp_path), "--yes"]) == 0
    assert not list(find_paths(tmp_path, "*.fti"))
    assert ftidask.init(**dirs).status() == 0


def test_list_shows_level4_zarr_stores(dirs, tmp_path, capsys):
    ctx = ftidask.init(l4_format="zarr", **dirs)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 4)
    ctx.checkpoint(2, 1)
    assert main(["list", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], r[2], r[-1]) for r in rows] == [("1", "4", "sound"), ("2", "1", "sound")]


def test_list_shows_a_checkpoint_kept_at_level4_by_keep_last_ckpt_as_committed(dirs, tmp_path, capsys):
    """keep_last_ckpt moves the last checkpoint to level 4 at finalize under a sequence number of its own (its commit
    record's), its files unchanged (their variable table still says level 1 and the first sequence number): list
    shows it committed, at level 4 (before: "level 1, seq 1, sound, not committed", though the next init restarts
    from it)."""
    ctx = ftidask.init(keep_last_ckpt=1, **dirs)
    ctx.protect(1, np.arange(1000.0), name="density")
    ctx.checkpoint(40, 1)
    ctx.finalize()
    assert ftidask.init(keep_last_ckpt=1, **dirs).status() == 2
    assert main(["list", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    (row,) = [r for r in rows if r[1] == "40"]
    (kept,) = Path(dirs["glbl_dir"]).glob("*/l4/ckpt40.s*")
    assert (row[2], row[3], row[-1]) == ("4", kept.name.split(".s")[1], "sound")


def test_clean_tidies_the_stage_directories_and_keeps_the_application_files(dirs, tmp_path, capsys):
    """clean removed Local/node*/{run}, Global/{run} and Meta/{run} but left Local/stage/{run} (its empty directories,
    the notes and temporary files of transfers a kill interrupted), which no later start could sweep once Meta/{run}
    was gone. Now tidied as an abandoned run's: the application's files waiting to be staged stay, and clean says so."""
    ctx = ftidask.init(enable_staging=1, **dirs)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    kept = ctx.stage_dir() / "result.npy"
    np.save(kept, np.arange(3))
    stage_root = Path(dirs["ckpt_dir"]) / "stage" / ctx.exec_id
    (stage_root / "node7" / "rank3").mkdir(parents=True)  # empty: goes
    ctx._close()
    assert main(["clean", str(tmp_path), "--yes"]) == 0
    out = capsys.readouterr().out
    assert kept.is_file() and np.array_equal(np.load(kept), np.arange(3))
    assert not (stage_root / "node7").exists()
    assert "kept 1 file" in out and str(stage_root) in out
    kept.unlink()
    assert main(["clean", str(tmp_path), "--yes"]) == 0  # the run's state is gone: its stage directory is tidied too
    assert not stage_root.exists() and not (Path(dirs["ckpt_dir"]) / "stage").exists()


def test_list_prints_an_odd_run_name_escaped(dirs, tmp_path, capsys):
    """A run's name comes from a file's variable table or, for a damaged file, its directory: one holding terminal
    control characters (or a path) is printed escaped, never sent to the terminal as it is."""
    ctx = ftidask.init(**dirs)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    ctx._close()
    (path,) = Path(dirs["ckpt_dir"]).glob("node0/*/l1/*/Ckpt1-Rank0.fti")
    run_dir = path.parent.parent.parent
    odd = run_dir.with_name("run\x1b[2J")
    run_dir.rename(odd)
    (path,) = odd.glob("l1/*/Ckpt1-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[0] ^= 0xFF  # damaged: the name is the directory's
    path.write_bytes(bytes(raw))
    assert main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "'run\\x1b[2J'" in out
