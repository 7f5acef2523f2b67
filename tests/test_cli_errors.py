"""What a new user meets on the command line: a config named config.fti, wrong paths and files,
damaged checkpoints, a closed pipe. Every command runs as a real subprocess (``python -m ftidask``)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import ftidask
from ftidask.storage.files import find_paths

EXAMPLE_CONFIG = ROOT / "examples" / "config.fti"


def cli(*args, cwd, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ftidask", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120, stdin=subprocess.DEVNULL, **kw)


def assert_error(proc, *words):
    """Exit non-zero with one ``ftidask: error:`` line that says ``words``, and no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "ftidask: error:" in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run started from the shipped example config, copied as tmp_path/config.fti: two checkpoints."""
    shutil.copy(EXAMPLE_CONFIG, tmp_path / "config.fti")
    monkeypatch.chdir(tmp_path)  # the config's paths (./Local, ...) are relative to the working directory
    ctx = ftidask.init("config.fti")
    ctx.protect(1, np.arange(1000.0), name="density")
    ctx.checkpoint(1, 4)
    ctx.checkpoint(2, 1)  # a level-1 checkpoint after a level-4 one: both are kept
    yield tmp_path
    ctx._close()


def test_example_config_is_valid_and_names_relative_dirs():
    cfg = ftidask.load_config(EXAMPLE_CONFIG)
    assert (cfg.ckpt_dir, cfg.glbl_dir, cfg.meta_dir) == ("./Local", "./Global", "./Meta")
    assert cfg.verbosity == 2


def test_config_named_config_fti_is_a_config(run_dir):
    # export, the command of the README, docs/cli.md and docs/zarr.md
    proc = cli("export", "config.fti", "--to-zarr", "s.zarr", cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "exported checkpoint 2 (level 1" in proc.stdout
    from ftidask.tools.zarr_export import export_checkpoint

    result = export_checkpoint(run_dir / "config.fti", run_dir / "t.zarr")
    assert (result.ckpt_id, result.level) == (2, 1)
    # verify: config.fti in the folder is not a damaged checkpoint
    proc = cli("verify", ".", cwd=run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config.fti" not in proc.stdout and "0 damaged" in proc.stdout
    # verify given the config checks the run's directories; list too
    proc = cli("verify", "config.fti", cwd=run_dir)
    assert proc.returncode == 0 and "2 sound, 0 damaged" in proc.stdout, proc.stdout + proc.stderr
    proc = cli("list", "--config", "config.fti", cwd=run_dir)
    assert proc.returncode == 0 and proc.stdout.count("sound") == 2, proc.stdout + proc.stderr
    proc = cli("list", ".", cwd=run_dir)
    assert proc.returncode == 0 and "config.fti" not in proc.stdout, proc.stdout + proc.stderr
    # the README's pair, literally: export, then start a new run from the store
    assert cli("export", "config.fti", "--to-zarr", "state.zarr", cwd=run_dir).returncode == 0
    proc = cli("import", "state.zarr", "config.fti", cwd=run_dir)
    assert proc.returncode == 0 and "imported state.zarr" in proc.stdout, proc.stdout + proc.stderr


def test_truncated_or_text_checkpoint_file_is_damaged_not_a_config(run_dir):
    files = sorted(find_paths(Path("."), "Ckpt*-Rank0.fti"))
    assert len(files) == 2
    files[0].write_bytes(b"")  # truncated to nothing
    files[1].write_text("[basic]\nverbosity = 2\n")  # overwritten with text
    proc = cli("verify", ".", cwd=run_dir)
    assert proc.returncode == 1 and "0 sound, 2 damaged" in proc.stdout, proc.stdout + proc.stderr


def test_binary_file_or_directory_as_config(run_dir):
    (rank_file,) = Path("Local").glob("node0/*/l1/*/Ckpt2-Rank0.fti")
    (run_dir / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (run_dir / "adir").mkdir()
    for bad, words in ((rank_file, ("not a text (INI) file",)), ("blob.bin", ("not a text (INI) file",)),
                       ("adir", ("is a directory",))):
        assert_error(cli("list", "--config", bad, cwd=run_dir), *words)
        assert_error(cli("clean", "--config", bad, "--yes", cwd=run_dir), *words)
        assert_error(cli("import", "s.zarr", bad, cwd=run_dir), *words)
    # export takes a config or a checkpoint: a binary file is read as a checkpoint file, a directory
    # as a checkpoint directory; neither is one
    assert_error(cli("export", "blob.bin", "--to-zarr", "x.zarr", cwd=run_dir), "blob.bin")
    assert_error(cli("export", "adir", "--to-zarr", "x.zarr", cwd=run_dir), "adir")
    assert_error(cli("export", "nope.fti", "--to-zarr", "x.zarr", cwd=run_dir), "does not exist")
    assert not (run_dir / "x.zarr").exists()


def test_text_file_that_is_not_ini_is_a_one_line_error(run_dir):
    """configparser's messages span lines (the file, the line number, the offending line); the CLI promises
    one ``ftidask: error:`` line (README, docs/cli.md), and a ConfigError reads as one sentence."""
    (run_dir / "notes.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")  # no [section] header
    (run_dir / "broken.ini").write_text("[basic]\nverbosity = 2\n  this line is no key\n[basic]\n")
    for bad in ("notes.txt", "broken.ini"):
        with pytest.raises(ftidask.ConfigError) as info:
            ftidask.load_config(run_dir / bad)
        assert "\n" not in str(info.value) and bad in str(info.value), str(info.value)
        for command in (("list", "--config", bad), ("clean", "--config", bad, "--yes"), ("verify", bad)):
            proc = cli(*command, cwd=run_dir)
            assert_error(proc, bad, "not a valid INI file")
            assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ftidask: error:"), proc.stderr


def test_mistyped_paths_say_they_do_not_exist(run_dir):
    for command in (("verify", "Lcal"), ("list", "Lcal"), ("clean", "Lcal", "--yes"), ("inspect", "Lcal.fti")):
        assert_error(cli(*command, cwd=run_dir), "Lcal")
    for command in (("verify", "Lcal"), ("list", "Lcal"), ("clean", "Lcal", "--yes")):
        assert_error(cli(*command, cwd=run_dir), "does not exist")
    assert_error(cli("list", "--config", "nope.fti", cwd=run_dir), "does not exist")


def test_clean_unknown_exec_id_says_no_such_run(run_dir):
    proc = cli("clean", "--exec-id", "nope", "--yes", cwd=run_dir)
    assert_error(proc, "no such run", "nope")
    assert list(find_paths(Path("Local"), "*.fti")), "nothing may be removed"


@pytest.mark.parametrize("command", [("list",), ("clean", "--yes")])
def test_a_dir_and_a_config_both_given_are_refused(run_dir, tmp_path, command):
    """DIR was ignored beside --config (the config's directories used): ``clean OTHER --config C`` removed this run's
    checkpoints, not OTHER's (found by a review). Both given is an error now; nothing is removed."""
    other = tmp_path / "other"
    other.mkdir()
    proc = cli(*command, str(other), "--config", "config.fti", cwd=run_dir)
    assert_error(proc, "not both")
    assert list(find_paths(Path("Global"), "*.fti")), "nothing may be removed"


def test_list_shows_damaged_committed_checkpoint(run_dir):
    (path,) = Path("Global").glob("*/l4/*/Ckpt1-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0xFF  # the file block: the file cannot even be parsed
    path.write_bytes(bytes(raw))
    proc = cli("list", ".", cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if "DAMAGED" in line]
    fields = row.split()
    assert fields[1:4] == ["1", "4", "1"], row  # id, level, seq
    assert "not committed" not in row and "?" not in row


def test_list_says_a_damaged_commit_record_is_not_a_commit(run_dir):
    (record,) = Path("Meta").glob("*/commits/s00000001.json")  # the L4 checkpoint's
    raw = json.loads(record.read_text())
    raw["nranks"] += 1  # still valid JSON: only the record's digest tells
    record.write_text(json.dumps(raw))
    proc = cli("list", ".", cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line for line in proc.stdout.splitlines() if line.split()[1:4] == ["1", "4", "1"]]
    assert "commit record damaged" in row, row


def test_inspect_prints_readable_timestamp(run_dir):
    (path,) = Path("Local").glob("node0/*/l1/*/Ckpt2-Rank0.fti")
    proc = cli("inspect", path, cwd=run_dir)
    assert proc.returncode == 0, proc.stderr
    assert " UTC)" in proc.stdout.splitlines()[1]


def test_help_lists_every_command_in_plain_text(tmp_path):
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "``" not in proc.stdout
    for command in ("inspect", "verify", "list", "clean", "export", "import"):
        assert command in proc.stdout, command


@pytest.mark.parametrize("command", ["inspect", "list", "--help"])
def test_closed_pipe_ends_quietly(run_dir, command):
    (path,) = Path("Local").glob("node0/*/l1/*/Ckpt2-Rank0.fti")
    args = {"inspect": ["inspect", str(path)], "list": ["list", "."], "--help": ["--help"]}[command]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # As `ftidask inspect F | head -0`: the reader is gone before the command writes (it is still importing).
    proc = subprocess.Popen([sys.executable, "-m", "ftidask", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=run_dir)
    proc.stdout.close()
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_commands_on_a_config_before_any_run(tmp_path):
    """A new user's first commands, with the example config and no run yet (or a config given to inspect): each
    error says what is wrong and what to do (before: 'no run found in Meta: pass exec_id', an option export does
    not have under that name; 'no FTI-FF files under config.fti'; a config inspected was 'damaged')."""
    shutil.copy(EXAMPLE_CONFIG, tmp_path / "config.fti")
    proc = cli("export", "config.fti", "--to-zarr", "s.zarr", cwd=tmp_path)
    assert_error(proc, f"no run found in {tmp_path / 'Meta'}", "--exec-id", "relative directories")
    proc = cli("verify", "config.fti", cwd=tmp_path)
    assert_error(proc, f"no checkpoint files under {tmp_path / 'Local'} or {tmp_path / 'Global'}")
    proc = cli("inspect", "config.fti", cwd=tmp_path)
    assert_error(proc, "config.fti is a config file", "ftidask list --config config.fti")
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "Meta").exists()


@pytest.mark.parametrize("timestamp", [1e300, -1e18, 253402300800.0])
def test_list_with_a_sealed_record_whose_time_no_calendar_has(tmp_path, timestamp):
    """A commit record sealed (digest matching) with a time past year 9999 or long before 1970, its checkpoint's
    files damaged so that ``list`` shows the record's time: an OverflowError traceback (1e300) or an OSError that
    ended the listing (-1e18). No record ftidask writes has such a time: the record is damaged, so listed."""
    from ftidask.engine.runstate import seal_json
    from ftidask.tools.cli import main

    ctx = ftidask.init(ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                       meta_dir=str(tmp_path / "Meta"), verbosity=4)
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    ctx._close()
    (record,) = (tmp_path / "Meta").glob("*/commits/s*.json")
    raw = json.loads(record.read_text())
    raw["timestamp"] = timestamp
    record.write_text(json.dumps(seal_json(raw)))
    for path in find_paths(tmp_path / "Local", "Ckpt*.fti"):
        damaged = bytearray(path.read_bytes())
        damaged[200] ^= 1
        path.write_bytes(bytes(damaged))
    proc = cli("list", tmp_path, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "DAMAGED (1 of 1 files), commit record damaged" in proc.stdout, proc.stdout
    assert main(["list", str(tmp_path)]) == 0


def test_list_and_clean_take_a_config_as_their_directory(run_dir):
    """`ftidask list config.fti` (as `verify config.fti` is written) said 'no checkpoints under config.fti' (exit 0);
    it now lists the config's run, as --config does, and clean takes it too. Another file is an error."""
    proc = cli("list", "config.fti", cwd=run_dir)
    assert proc.returncode == 0 and proc.stdout.count("sound") == 2, proc.stdout + proc.stderr
    rank_file = find_paths(Path("Local"), "Ckpt2-Rank0.fti")[0]
    for command in (("list", rank_file), ("clean", rank_file, "--yes")):
        assert_error(cli(*command, cwd=run_dir), "is a file, not a directory", "--config")
    proc = cli("clean", "config.fti", "--yes", cwd=run_dir)  # the run_dir context holds the run: skipped
    assert proc.returncode == 0 and "in use by" in proc.stdout and "nothing to clean" in proc.stdout, proc.stdout
    assert list(find_paths(Path("Local"), "*.fti"))


def test_a_meta_path_that_names_no_meta_file_is_a_usage_error(run_dir):
    """``verify FILE --meta /nonexistent`` said DAMAGED of a sound file (status 1): a wrong argument is status 2."""
    (ckpt,) = find_paths(Path("Global"), "Ckpt1-Rank0.fti")
    proc = cli("verify", ckpt, "--meta", "nowhere", cwd=run_dir)
    assert proc.returncode == 2 and "DAMAGED" not in proc.stdout
    assert_error(proc, "--meta nowhere", "no such FTI meta file")


def test_list_and_clean_of_a_fifo_say_it_is_not_a_directory(run_dir):
    """``list FIFO`` said "no checkpoints under FIFO" with status 0."""
    os.mkfifo("pipe")
    for command in (("list", "pipe"), ("clean", "pipe", "--yes")):
        proc = cli(*command, cwd=run_dir)
        assert proc.returncode == 2
        assert_error(proc, "pipe is not a directory")
