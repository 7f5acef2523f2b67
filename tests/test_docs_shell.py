"""The shell examples of the README and docs/ (the ``ftidask`` command lines, the install checks), run as written
on the checkpoints of a real run, in a temp dir. Every ``ftidask ...`` line of a page's shell blocks is either run
as it is or listed in ``CONCRETE`` with the commands that stand for its placeholders: a new example that is in
neither fails ``test_every_shell_example_is_run``."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_docs_examples import EXAMPLE_CONFIG, ok, run

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FTIDASK = Path(sys.executable).parent / "ftidask"  # .venv/bin/ftidask, as the docs write it

# A documented line with placeholders -> the concrete command lines run for it ({exec}, {l1dir}: the run's).
CONCRETE = {
    "ftidask inspect Ckpt1-Rank0.fti [--json]": ["ftidask inspect {l4dir}/Ckpt1-Rank0.fti",
                                                 "ftidask inspect {l4dir}/Ckpt1-Rank0.fti --json"],
    "ftidask verify DIR_OR_FILE": ["ftidask verify .", "ftidask verify {l1dir}/Ckpt40-Rank0.fti",
                                   "ftidask verify config.fti"],
    "ftidask list [BASEDIR] [--config F]": ["ftidask list", "ftidask list .", "ftidask list --config config.fti"],
    "ftidask export config.fti --id 40 --level 4 --to-zarr state.zarr": [
        "ftidask export config.fti --id 1 --level 4 --to-zarr by-id.zarr"],  # this run's level-4 checkpoint is 1
    "ftidask export Local/node0/<exec_id>/l1/ckpt40.s12 --to-zarr state.zarr": [
        "ftidask export {l1dir} --to-zarr by-dir.zarr"],
    "ftidask clean [BASEDIR] [--config F] [--exec-id X] [--yes]": [],  # run by test_readme_clean
    "ftidask inspect --json Local/node2/<exec_id>/l3/ckpt3.s3/Ckpt3-Rank2.fti": [],  # the Dask test below
}
SYNOPSIS = re.compile(r"[A-Z]{3,}|\[")  # docs/cli.md's usage lines (checked by test_docs_reference.py)


def shell_lines(page: Path) -> list[str]:
    """The ``ftidask`` and ``python -c`` lines of ``page``'s shell blocks, comments and ``.venv/bin/`` dropped."""
    text = page.read_text()
    found = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if block.group(1) in ("python", "ini", "text"):
            continue
        for line in block.group(2).splitlines():
            line = re.sub(r"^\$ |\.venv/bin/", "", line.split("  #")[0].strip()).strip()
            if line.startswith("ftidask ") or line.startswith("python -c "):
                found.append(line)
    return found


def documented() -> list[str]:
    lines = []
    for page in DOCS:
        lines += [line for line in shell_lines(page) if line not in lines]
    return lines


def runnable(line: str) -> bool:
    return line in CONCRETE or not (page_synopsis(line) or "<" in line)


def page_synopsis(line: str) -> bool:
    return line.startswith("ftidask ") and bool(SYNOPSIS.search(line.replace("config.fti", "")))


def test_every_shell_example_is_run():
    left = [line for line in documented() if "<" in line and line not in CONCRETE
            or page_synopsis(line) and line not in CONCRETE and not _in_cli_usage(line)]
    assert not left, f"shell examples with placeholders that no test runs (add them to CONCRETE): {left}"


def _in_cli_usage(line: str) -> bool:
    return line in shell_lines(ROOT / "docs" / "cli.md")


def sh(folder: Path, line: str) -> subprocess.CompletedProcess:
    """``line`` as the docs' reader runs it. ``ftidask ...`` runs in this process (``ftidask.tools.cli.main``, the
    entry point of ``.venv/bin/ftidask``: a second each saved), in ``folder``; ``python ...`` with this
    interpreter."""
    import contextlib
    import io
    import os
    import shlex

    from ftidask.tools.cli import main

    argv = shlex.split(line)
    if argv[0] != "ftidask":
        return subprocess.run([sys.executable, *argv[1:]], cwd=folder, capture_output=True, text=True, timeout=120)
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as exc:  # --help
                code = exc.code
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def test_the_installed_command_is_the_cli(tmp_path):
    """docs/installation.md: `.venv/bin/ftidask --help`; the tests below call its entry point in-process."""
    proc = subprocess.run([str(FTIDASK), "--help"], capture_output=True, text=True, timeout=120)
    inside = sh(tmp_path, "ftidask --help").stdout
    assert proc.returncode == 0 and proc.stdout.split() == inside.split(), proc.stdout + proc.stderr  # wrapping aside


WRITE = """import os
import numpy as np
import ftidask
ctx = ftidask.init("config.fti")
u = np.arange(12.0).reshape(3, 4)
step = ftidask.State({"step": 0})
ctx.protect(1, u, name="u")
ctx.protect(2, step, name="step")
ctx.checkpoint(1, 4)
step["step"] = 40
u += 1
ctx.checkpoint(40, 1)
print(ctx.exec_id)
os._exit(0)                          # killed: the run stays to restart
"""


@pytest.fixture
def killed_run(tmp_path):
    """A directory holding examples/config.fti and a run killed after checkpoint 1 (level 4) and 40 (level 1)."""
    shutil.copy(EXAMPLE_CONFIG, tmp_path / "config.fti")
    exec_id = ok(run(tmp_path, WRITE)).strip()
    l1 = next(tmp_path.glob(f"Local/node0/{exec_id}/l1/ckpt40.s*"))
    l4 = next(tmp_path.glob(f"Global/{exec_id}/l4/ckpt1.s*"))
    return tmp_path, {"exec": exec_id, "l1dir": str(l1.relative_to(tmp_path)), "l4dir": str(l4.relative_to(tmp_path))}


@pytest.mark.parametrize("export", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["inspect-verify-list",
                                                                                       "export"])  # export: Zarr, 3 s
def test_shell_examples_on_a_killed_run(killed_run, export):
    """Every documented command line but import (below), as written or as CONCRETE gives it: exit 0, the output
    the docs describe. ``export``: the export lines; otherwise the others."""
    folder, names = killed_run
    if export:
        pytest.importorskip("zarr")
    for line in documented():
        if line.startswith("ftidask import") or not runnable(line) or line.startswith("ftidask export") != export:
            continue  # import: on a new run's directory, below
        for concrete in CONCRETE.get(line, [line]):
            concrete = concrete.format(**names)
            if concrete.startswith("ftidask export"):
                shutil.rmtree(folder / concrete.split("--to-zarr ")[1].split()[0], ignore_errors=True)
            proc = sh(folder, concrete)
            assert proc.returncode == 0 and not proc.stderr.startswith("ftidask: error"), \
                f"{concrete}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
            check_output(concrete, proc.stdout, names)


def check_output(line: str, out: str, names: dict) -> None:
    """What the docs say each command prints."""
    if line.startswith("ftidask list"):
        rows = [row.split() for row in out.splitlines()[1:]]
        assert [(r[0], r[1], r[2]) for r in rows] == [(names["exec"], "1", "4"), (names["exec"], "40", "1")], out
        assert all(row[-1] == "sound" for row in rows), out
    elif line.startswith("ftidask verify"):
        assert out.splitlines()[-1].endswith(" sound, 0 damaged") and "OK " in out, out
    elif line.startswith("ftidask inspect") and line.endswith("--json"):
        table = json.loads(out)["table"]
        assert table["ckpt_id"] == 1 and table["level"] == 4 and table["exec_id"] == names["exec"], out
    elif line.startswith("ftidask inspect"):
        assert "'u'" in out and "Python state" in out and "{\"step\": 0}" in out, out
    elif line.startswith("ftidask export"):  # docs/cli.md's example output
        ckpt, level = ("1", "4") if "--id 1" in line else ("40", "1")
        said = rf"exported checkpoint {ckpt} \(level {level}, 1 rank file\(s\)\) to \S+\.zarr: 2 array\(s\), "
        assert re.fullmatch(said + r"[\d,]+ bytes in \d+\.\d\d s\n  u\n  step\n", out), out
    elif line == "ftidask --help":
        for command in ("inspect", "verify", "list", "clean", "export", "import"):
            assert command in out, out
    elif "__version__" in line:
        import ftidask

        assert out.strip() == ftidask.__version__


def test_verify_exit_status_on_damage(killed_run):
    """README: 'check every hash; exit 1 on damage'."""
    folder, names = killed_run
    path = folder / names["l1dir"] / "Ckpt40-Rank0.fti"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = sh(folder, "ftidask verify .")
    assert proc.returncode == 1 and "DAMAGED" in proc.stdout and "1 damaged" in proc.stdout, proc.stdout


def test_readme_clean(killed_run):
    folder, names = killed_run
    proc = sh(folder, f"ftidask clean --exec-id {names['exec']}")  # no terminal: refused, nothing removed
    # docs/cli.md: an error is one line, `ftidask: error: ...`, exit status 2
    assert proc.returncode == 2 and proc.stderr.startswith("ftidask: error: ") and "pass --yes" in proc.stderr, \
        proc.stdout + proc.stderr
    assert (folder / names["l1dir"]).is_dir()
    proc = sh(folder, f"ftidask clean . --exec-id {names['exec']} --yes")
    assert proc.returncode == 0 and "removed 3 directories" in proc.stdout, proc.stdout + proc.stderr
    assert "no checkpoints under" in sh(folder, "ftidask list").stdout


def test_export_then_import_into_a_new_run(killed_run):
    """README and docs/zarr.md: `ftidask export config.fti --to-zarr state.zarr`, `ftidask import state.zarr
    config.fti`: the new run starts with status 2 and recovers the exported values."""
    pytest.importorskip("zarr")
    folder, _names = killed_run
    assert "ftidask import state.zarr config.fti" in documented()
    ok(sh(folder, "ftidask export config.fti --to-zarr state.zarr"))
    new = folder / "new"
    new.mkdir()
    shutil.copy(EXAMPLE_CONFIG, new / "config.fti")
    shutil.move(folder / "state.zarr", new / "state.zarr")
    ok(sh(new, "ftidask import state.zarr config.fti"))
    code = ("import numpy as np\nimport ftidask\nctx = ftidask.init('config.fti')\nu = np.zeros((3, 4))\n"
            "step = ftidask.State()\nctx.protect(1, u)\nctx.protect(2, step)\nprint(ctx.status())\nctx.recover()\n"
            "print(u.sum(), step['step'])\nctx.finalize()\n")
    assert ok(run(new, code)).split() == ["2", "78.0", "40"]


@pytest.mark.dask
@pytest.mark.slow  # a LocalCluster
def test_troubleshooting_which_files_were_a_workers_own(tmp_path):
    """docs/troubleshooting.md: the worker at position r of the sorted live workers is rank r, writes under
    node{r}, and its file records its address (``ftidask inspect --json``: "table": {"worker": ..., "rank": r})."""
    pytest.importorskip("distributed")
    shutil.copy(EXAMPLE_CONFIG, tmp_path / "config.fti")
    text = (tmp_path / "config.fti").read_text()
    (tmp_path / "config.fti").write_text(text.replace("group_size      = 4", "group_size      = 2"))
    code = ("import json\nimport dask.array as da\nimport ftidask\nfrom distributed import Client, LocalCluster\n"
            "if __name__ == '__main__':\n"
            "    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False) as cluster, "
            "Client(cluster) as client:\n"
            "        ctx = ftidask.init('config.fti', client=client)\n"
            "        ctx.protect(1, client.persist(da.ones((64, 64), chunks=32)), name='field')\n"
            "        ctx.checkpoint(3, 3)\n"
            "        print(json.dumps([ctx.exec_id, ctx.cluster.workers()]))\n"
            "        ctx._close()  # crashed: its checkpoint stays for the commands below\n")
    exec_id, workers = json.loads(ok(run(tmp_path, code)).strip().splitlines()[-1])
    assert workers == sorted(workers)
    for rank, worker in enumerate(workers):
        path = next(tmp_path.glob(f"Local/node{rank}/{exec_id}/l3/ckpt3.s*/Ckpt3-Rank{rank}.fti"))
        table = json.loads(ok(sh(tmp_path, f"ftidask inspect --json {path}")))["table"]
        assert table["worker"] == worker and table["rank"] == rank, table
