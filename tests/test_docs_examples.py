"""The Python examples of the README and docs/, run as a user runs them: saved beside a copy of
examples/config.fti in an empty directory, in a fresh interpreter. Where a block is a fragment, the
lines around it are the README's or the page's own; where it holds a placeholder (``...``), the test
fills it and says so. The examples cannot drift from the code without one of these failing."""

import os
import re
import shutil
import subprocess
import sys

import mpi_util
import pytest
from conftest import ROOT

from ftidask.storage.files import find_paths

EXAMPLE_CONFIG = ROOT / "examples" / "config.fti"


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of ``page`` (README.md or docs/NAME.md), in order."""
    text = (ROOT / page).read_text()
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S)]


def block(page: str, *marks: str) -> str:
    """The one python block of ``page`` that holds every string of ``marks``."""
    found = [b for b in python_blocks(page) if all(mark in b for mark in marks)]
    assert len(found) == 1, f"{page}: {len(found)} python blocks hold {marks}"
    return found[0]


def fill(code: str, placeholder: str, replacement: str) -> str:
    """``code`` with the line holding ``placeholder`` (a doc's ``...``) replaced, indentation kept."""
    lines = code.splitlines()
    at = [i for i, line in enumerate(lines) if line.strip().startswith(placeholder)]
    assert len(at) == 1, (placeholder, code)
    indent = lines[at[0]][:len(lines[at[0]]) - len(lines[at[0]].lstrip())]
    lines[at[0]:at[0] + 1] = [indent + line for line in replacement.splitlines()]
    return "\n".join(lines) + "\n"


def run(folder, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    (folder / "prog.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "prog.py", *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def rank_files(folder) -> list:
    return sorted(p for p in find_paths(folder, "Ckpt*.fti"))


QUICK_START = ("README.md", "ctx = ftidask.init(\"config.fti\")", "ctx.finalize()")


def test_readme_quick_start_killed_and_run_again_carries_on(folder):
    """'Run it, kill it part-way (Ctrl-C, kill -9), run it again: it carries on from the last checkpoint.'"""
    code = block(*QUICK_START)
    # The block's compute placeholder becomes a SIGKILL at step 350 (after checkpoints 1-3) when asked.
    killed = fill(code, "...", "if state['step'] == 350 and len(__import__('sys').argv) > 1:\n"
                               "    __import__('os').kill(__import__('os').getpid(), 9)")
    proc = run(folder, killed, "kill")
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert proc.stderr.count("written:") == 3 and "checkpoint 3 (level 1) written" in proc.stderr, proc.stderr
    proc = run(folder, code + "print(state['step'], float(temperature.sum()))\n")  # the block as written
    assert ok(proc).split() == ["1000", "0.0"]
    assert "restart (status 1)" in proc.stderr and "recovered checkpoint 3 from level 1" in proc.stderr, proc.stderr
    assert "checkpoint 8 (level 4) written" in proc.stderr and "checkpoint 10 (level 1) written" in proc.stderr
    assert rank_files(folder) == []  # finalize() cleaned up


def test_readme_fragments_after_the_quick_start(folder):
    """The README's asynchronous, staging and incremental fragments, after the quick start's own setup."""
    setup = block(*QUICK_START).split("\nif ctx.status()")[0] + "\n"
    code = setup + block("README.md", "wait=False") + "print(info.id, info.level)\n"
    code += "ctx.protect(3, np.ones(8))\n" + block("README.md", "ctx.incremental(7")
    code = fill(code, "...", "icp.add(3)")  # between the two adds: the third protected variable
    code += "print(ctx.last_checkpoint.id)\nctx.finalize()\n"
    assert ok(run(folder, code)).split() == ["7", "4", "7"]
    staging = block("README.md", "enable_staging=1")
    code = "import numpy as np\nimport ftidask\nfield = np.arange(10.0)\n" + fill(staging, "...", "pass")
    code = code.replace("ctx.wait_staged()", "print(ctx.wait_staged())")
    assert ok(run(folder, code)).strip() == "{1: 0}"
    assert (folder / "Global" / "frames" / "frame042.npy").is_file()


def test_index_and_tutorial_programs_run(folder):
    out = ok(run(folder, block("docs/index.md", "with ftidask.init(\"config.fti\") as ctx:")))
    assert out == ""
    tutorial = block("docs/tutorial.md", "resuming at step")
    out = ok(run(folder, tutorial.replace("time.sleep(0.01)", "pass")))  # the sleep only slows it for Ctrl-C
    assert out.startswith("done ")
    assert rank_files(folder) == []


def test_guide_python_state_continues_the_generator_stream(folder):
    code = "import numpy as np\nimport ftidask\nctx = ftidask.init(\"config.fti\")\nfield = np.zeros(4)\n"
    state_block = block("docs/guide.md", "ftidask.State({\"epoch\": 0")
    code += fill(state_block, "...", "ctx.checkpoint(1, 1)\nexpected = rng.random(3)\nstate['epoch'] = 5\n"
                                     "best.value = 0.5")
    code += "print(state['epoch'], best.value, bool((rng.random(3) == expected).all()))\nctx.finalize()\n"
    assert ok(run(folder, code)).split() == ["0", "inf", "True"]


def test_dcp_and_icp_blocks(folder):
    code = "import numpy as np\nimport ftidask\nstate = np.zeros(1 << 16)\n" + block("docs/dcp.md", "enable_dcp=1")
    code += "ctx.protect(2, np.ones(10))\n" + block("docs/dcp.md", "ctx.init_icp(20, 1)")
    code += "print(info.id, ctx.last_checkpoint.id)\nctx.finalize()\n"
    out = ok(run(folder, code)).split()
    # checkpoint 11, the second differential one, fills the other of the two files: every block is new there
    assert out[:3] == [str(8 << 16), "32", "32"] and float(out[3]) > 0, out
    assert out[4:] == ["20", "21"], out


def test_config_reference_example(folder):
    (folder / "config.fti").write_text(re.search(r"```ini\n(.*?)```", (ROOT / "docs/config.md").read_text(),
                                                 re.S).group(1))
    code = "import ftidask\n" + block("docs/config.md", "verbosity=3")
    code += "print(ctx.config.verbosity, ctx.config.compressor, ctx.config.l4_format, ctx.config.ckpt_l1)\n"
    code += "ctx.finalize()\n"
    assert ok(run(folder, code)).split() == ["3", "blosc", "zarr", "5"]


def test_mpi_restart_on_another_number_of_ranks(folder):
    """docs/mpi.md: '4 ranks wrote it, 2, 3 or 8 recover it' (here 4, then 3), with the page's own program."""
    text = (folder / "config.fti").read_text()
    assert "local_test      = 0" in text
    (folder / "config.fti").write_text(text.replace("local_test      = 0", "local_test      = 1"))  # one machine
    code = block("docs/mpi.md", "global_shape=(n,), offset=(lo,)")
    write = code.replace("u = np.zeros(hi - lo)", "u = np.arange(lo, hi, dtype=float)")
    write = write.replace("params = np.zeros(3)", "params = np.array([1.0, 2.0, 3.0])")
    write += "    ctx.checkpoint(1, 1)\n    comm.Barrier()\n    __import__('os')._exit(0)\n"  # dies unfinalized
    # Each rank writes its own file: the ranks' stdout lines interleave.
    read = code + ("        open(f'result-{comm.rank}.txt', 'w').write(f'{comm.rank}: '"
                   "f'{bool((u == np.arange(lo, hi)).all())} {params.tolist()}')\n")
    for ranks, prog in ((4, write), (3, read)):
        (folder / "prog.py").write_text(prog)
        proc = subprocess.run([mpi_util.mpiexec(), "-n", str(ranks), sys.executable, "prog.py"], cwd=folder,
                              env=mpi_util.env(), capture_output=True, text=True, timeout=120)
        # The writers die unfinalized: MPICH's mpiexec may then kill the ranks not yet gone (exit 9), a race of
        # the launcher (a plain mpi4py program does the same); what they left is checked by the restart.
        assert proc.returncode == 0 or prog is write, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    got = [(folder / f"result-{r}.txt").read_text() for r in range(3)]
    assert got == [f"{r}: True [1.0, 2.0, 3.0]" for r in range(3)], (got, proc.stdout + proc.stderr)
    assert "recovered checkpoint 1 from level 1, written by 4 ranks, on 3" in proc.stderr, proc.stderr
    assert rank_files(folder) == []  # the with block finalized the restarted run


for _mark in mpi_util.need_mpi():
    test_mpi_restart_on_another_number_of_ranks = _mark(test_mpi_restart_on_another_number_of_ranks)


@pytest.mark.slow  # xarray and matplotlib take seconds to import
def test_zarr_export_open_and_import_blocks(folder):
    """docs/zarr.md's Python blocks: export a run's checkpoint, open the store with zarr, Dask and xarray,
    import it into a new run that recovers it (status 2)."""
    pytest.importorskip("zarr")
    pytest.importorskip("xarray")
    pytest.importorskip("matplotlib")
    write = ("import os\nimport numpy as np\nimport ftidask\nctx = ftidask.init('config.fti')\n"
             "u = np.arange(12.0).reshape(3, 4)\nctx.protect(1, u, name='u')\nctx.checkpoint(1, 1)\nos._exit(0)\n")
    ok(run(folder, write))
    code = "import matplotlib\nmatplotlib.use('Agg')\n" + block("docs/zarr.md", "export_checkpoint(\"config.fti\"")
    code += block("docs/zarr.md", "zarr.open_group(\"state.zarr\")")
    opened = 'zarr.open_group("state.zarr")["u"][...]'
    code = code.replace(opened, f"print({opened}.sum())")
    code += "print(da.from_zarr('state.zarr', component='u').sum().compute())\n"
    assert ok(run(folder, code)).split() == ["66.0", "66.0"]
    new = folder / "new"
    new.mkdir()
    shutil.copy(EXAMPLE_CONFIG, new / "config.fti")
    shutil.move(folder / "state.zarr", new / "state.zarr")
    code = "import numpy as np\nimport ftidask\n" + block("docs/zarr.md", "import_zarr(\"state.zarr\", \"config.fti\")")
    code += "print(ctx.status())\nu = np.zeros((3, 4))\nctx.protect(1, u)\nctx.recover()\nprint(u.sum())\n"
    code += "ctx.finalize()\n"
    assert ok(run(new, code)).split() == ["2", "66.0"]


@pytest.mark.dask
@pytest.mark.slow  # a LocalCluster per program
def test_dask_lineage_loop_and_its_cost_in_disk(folder):
    """docs/dask-lineage.md's loop (100 steps here): the page's loop holds ``x`` while the checkpoint is written,
    so checkpoint N-1 stays until the next one starts; with ``del x`` first it is retired at once."""
    pytest.importorskip("distributed")
    loop = block("docs/dask-lineage.md", "x = client.persist(update(x))")
    loop = loop.replace("range(1, 1001)", "range(1, 101)")
    count = "print(len({p.name for p in Path('Local').glob('node*/*/l3/ckpt*')}))"  # checkpoints on disk
    loop = loop.replace("        x = ctx.protected[1]", f"        x = ctx.protected[1]\n        {count}")
    head = ("from pathlib import Path\nimport dask.array as da\nimport ftidask\nfrom distributed import Client, "
            "LocalCluster\n\ndef initial_state():\n    return da.zeros((64, 64), chunks=16)\n\ndef update(x):\n"
            "    return x + 1\n\nif __name__ == '__main__':\n    client = Client(LocalCluster(n_workers=2, "
            "threads_per_worker=1, processes=False))\n")
    # The cluster closed too: left to the interpreter's exit, distributed may log a traceback, which ok() counts
    tail = ("    print(float(x.sum().compute()))\n    ctx.finalize()\n    cluster = client.cluster\n    client.close()\n"
            "    cluster.close()\n")
    text = (folder / "config.fti").read_text()
    (folder / "config.fti").write_text(text.replace("group_size      = 4", "group_size      = 2"))  # 2 workers
    program = head + "".join("    " + line + "\n" for line in loop.splitlines()) + tail
    assert ok(run(folder, program)).split() == ["1"] + ["2"] * 9 + [str(64 * 64 * 100.0)]
    dropped = program.replace('ctx.protect(1, x, name="field")\n', 'ctx.protect(1, x, name="field")\n'
                              "            del x\n")
    assert dropped != program
    assert ok(run(folder, dropped)).split() == ["1"] * 10 + [str(64 * 64 * 100.0)]
