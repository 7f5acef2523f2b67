"""More of the docs' Python blocks run as a user runs them (see test_docs_examples.py): staging, logging, per-variable
compression and the three backends' set-up lines in one process; the MPI pages' programs on real ``mpiexec`` ranks;
the Dask page's loop and restart on a LocalCluster (slow)."""

import json
import subprocess
import sys

import mpi_util
import pytest
from test_docs_examples import block, fill, ok, rank_files, run


def test_staging_block(folder):
    """docs/staging.md: send_file returns at once, the states go SI_PEND/SI_ACTV -> SI_SCES (once) -> SI_NINI,
    wait_staged does not consume the final state, the file lands under glbl_dir and the local one goes."""
    code = "import numpy as np\nfield = np.arange(10.0)\n" + block("docs/staging.md", "ctx.stage_dir() /")
    code = code.replace("ctx.finalize()", "first = ctx.stage_status(req)\nthen = ctx.stage_status(req)\n"
                        "print(state in (SI_PEND, SI_ACTV, SI_SCES), first == SI_SCES, then == SI_NINI,\n"
                        "      repr(ctx.stage_info(req).reason), local.exists(),\n"
                        "      local.parent.relative_to(ctx.config.ckpt_dir).parts[::2] == ('stage', 'node0'))\n"
                        "ctx.finalize()")
    assert ok(run(folder, code)).split() == ["True", "True", "True", "''", "False", "True"]
    import numpy as np

    assert (np.load(folder / "Global" / "frames" / "frame042.npy") == np.arange(10.0)).all()


def test_troubleshooting_logging_lines_are_printed_once(folder):
    """docs/troubleshooting.md: verbosity=2, or log_to_stderr(), or both: each line once on stderr."""
    code = "import numpy as np\nimport ftidask\n" + block("docs/troubleshooting.md", "ftidask.log_to_stderr()")
    code += "ctx.protect(1, np.zeros(4))\nctx.checkpoint(1, 1)\nctx.finalize()\n"
    proc = run(folder, code)
    ok(proc)
    assert proc.stderr.count("fresh start") == 1 and proc.stderr.count("checkpoint 1 (level 1) written") == 1, \
        proc.stderr


def test_per_variable_compressors(folder):
    """docs/zarr.md: compressor= per variable (a spec, "none", a numcodecs codec); round trip bit for bit."""
    pytest.importorskip("numcodecs")
    code = ("import numpy as np\nimport numcodecs\nimport ftidask\nctx = ftidask.init('config.fti')\n"
            "field = np.linspace(0, 1, 1 << 16)\nnoise = np.random.default_rng(0).random(1 << 12)\n"
            "other = np.zeros(1 << 16)\n" + block("docs/zarr.md", 'compressor="blosc-zstd:5"')
            + "info = ctx.checkpoint(1, 1)\nkept = [a.copy() for a in (field, noise, other)]\n"
            "for a in (field, noise, other):\n    a[:] = -1\nctx.recover()\n"
            "print(all((a == k).all() for a, k in zip((field, noise, other), kept)))\n"
            # stored_size: the variable's bytes, compressed or not (docs/guide.md); the file: compressed (holes)
            "print(info.bytes_written < noise.nbytes + field.nbytes // 2, ctx.stored_size(0) == field.nbytes, "
            "ctx.stored_size(2) == other.nbytes)\nctx.finalize()\n")
    assert ok(run(folder, code)).split() == ["True"] * 4


def test_guide_one_process_line(folder):
    code = "import ftidask\n" + block("docs/guide.md", "# or ftidask.init(ckpt_dir=..., glbl_dir=..., meta_dir=...)")
    code += "print(ctx.status(), ctx.transport.name)\nctx.finalize()\n"
    assert ok(run(folder, code)).split() == ["0", "single-process"]


# --- MPI ---------------------------------------------------------------------------------------------------

def mpirun(folder, code: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """``code`` on ``ranks`` real MPI ranks, one simulated node each, in groups of 2 (levels 2 and 3)."""
    text = (folder / "config.fti").read_text()
    text = text.replace("local_test      = 0", "local_test      = 1").replace("group_size      = 4",
                                                                               "group_size      = 2")
    (folder / "config.fti").write_text(text)
    (folder / "prog.py").write_text(code)
    return subprocess.run([mpi_util.mpiexec(), "-n", str(ranks), sys.executable, "prog.py"], cwd=folder,
                          env=mpi_util.env(), capture_output=True, text=True, timeout=180)


def test_mpi_page_programs(folder):
    """docs/mpi.md's first program (level 3), docs/guide.md's MPI lines and docs/async.md's loop (level 2,
    wait=False), on 2 ranks; then the resilient loop of docs/mpi.md, killed and run again."""
    code = "import numpy as np\n" + block("docs/mpi.md", 'ctx.checkpoint(7, level=3)')
    code = code.replace("u = ...", "u = np.full(1000 + comm.rank, float(comm.rank))")
    code = fill(code, "...", "pass")
    code += block("docs/guide.md", "ctx = ftidask.init(\"config.fti\", comm=MPI.COMM_WORLD)")
    code += ("assert ctx.comm.size == 2\nctx.finalize()\ncomm = MPI.COMM_WORLD\nnsteps = 300\n"
             "field = np.zeros(1 << 16)\ndef compute(f):\n    f += 1\n")
    code += block("docs/async.md", "handle = ctx.checkpoint(step, 2, wait=False)")
    code += ("open(f'result-{comm.rank}', 'w').write(f'{type(handle).__name__} {handle.result().id} {field[0]}')\n")
    proc = mpirun(folder, code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [(folder / f"result-{r}").read_text() for r in range(2)]  # a file per rank: stdout lines interleave
    assert got == ["CheckpointHandle 300 300.0"] * 2, (got, proc.stdout + proc.stderr)
    assert "checkpoint 7 (level 3) written" in proc.stderr and "checkpoint 300 (level 2) written" in proc.stderr
    assert "asynchronous checkpoints are written before the call returns" not in proc.stderr  # MULTIPLE by default
    assert rank_files(folder) == []


@pytest.mark.slow  # two MPI jobs; examples/heat_mpi.py's loop runs by default (tests/test_mpi_resilient.py)
def test_mpi_resilient_loop_block(folder):
    """docs/mpi.md's decorated loop on 2 ranks at level 3: killed at iteration 120, run again, it resumes at 100."""
    loop = block("docs/mpi.md", "@ftidask.resilient(")
    loop = loop.replace("iterations=10_000", "iterations=200")
    head = ("import os, sys\nimport numpy as np\nfrom mpi4py import MPI\nimport ftidask\n"
            "ctx = ftidask.init('config.fti', comm=MPI.COMM_WORLD)\nu = np.zeros(64)\n"
            "def halo_exchange(comm, u):\n    comm.Barrier()\n"
            # every rank looks for the file before rank 0 removes it: all die at iteration 120, or none
            "def update(u):\n    u += 1\n    if u[0] == 120:\n        kill = os.path.exists('kill')\n"
            "        ctx.comm.Barrier()\n        if kill:\n"
            "            os.remove('kill') if ctx.comm.rank == 0 else None\n            os._exit(9)\n")
    tail = "open(f'result-{ctx.comm.rank}', 'w').write(json.dumps(u[0]))\nctx.finalize()\n"  # stdout lines interleave
    (folder / "kill").write_text("")
    proc = mpirun(folder, head + "import json\n" + loop + tail)
    assert proc.returncode != 0 and "checkpoint 100 (level 3) written" in proc.stderr, proc.stdout + proc.stderr
    proc = mpirun(folder, head + "import json\n" + loop + tail)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [json.loads((folder / f"result-{r}").read_text()) for r in range(2)] == [200.0, 200.0]
    assert "recovered checkpoint 100" in proc.stderr, proc.stderr


for _mark in mpi_util.need_mpi():
    test_mpi_page_programs = _mark(test_mpi_page_programs)
    test_mpi_resilient_loop_block = _mark(test_mpi_resilient_loop_block)


# --- Dask --------------------------------------------------------------------------------------------------

@pytest.mark.dask
@pytest.mark.slow  # two LocalClusters
def test_dask_page_loop_then_restart(folder):
    """docs/dask.md: the loop (smaller), killed after its checkpoints; the restart block recovers the last one,
    in the original chunks or in those asked for."""
    pytest.importorskip("distributed")
    text = (folder / "config.fti").read_text()
    (folder / "config.fti").write_text(text.replace("group_size      = 4", "group_size      = 2"))
    loop = block("docs/dask.md", "x = update(x)")
    loop = loop.replace("n_workers=4, threads_per_worker=1", "n_workers=2, threads_per_worker=1, processes=False")
    loop = loop.replace("(8192, 8192), chunks=(1024, 1024)", "(256, 256), chunks=(64, 64)")
    loop = loop.replace("range(1, 101)", "range(1, 31)")
    main = ("import os\nimport numpy as np\n\ndef update(x):\n    return x + 1\n\nif __name__ == '__main__':\n"
            + "".join("    " + line + "\n" for line in loop.splitlines())
            + "    np.save('expected.npy', x.compute())\n    os._exit(0)\n")
    ok(run(folder, main))
    restart = block("docs/dask.md", "x = ctx.recover(chunks={1: (2048, 2048)})[1]")
    restart = restart.replace("(2048, 2048)", "(128, 128)")
    main = ("import numpy as np\nimport ftidask\nfrom distributed import Client, LocalCluster\n\n"
            "if __name__ == '__main__':\n    client = Client(LocalCluster(n_workers=2, threads_per_worker=1, "
            "processes=False))\n    expected = np.load('expected.npy')\n"
            + "".join("    " + line + "\n" for line in restart.splitlines())
            + "    print(ctx.status(), ctx.recovered_from, arrays[1].chunksize, x.chunksize,\n"
              "          bool((arrays[1].compute() == expected).all()), bool((x.compute() == expected).all()))\n"
              "    ctx.finalize()\n    cluster = client.cluster\n    client.close()\n    cluster.close()\n")
    # status 0 after a recovery of every variable (FTI_Recover's rule); recovered_from: the last checkpoint, (3, 3)
    assert ok(run(folder, main)).split() == ["0", "(3,", "3)", "(64,", "64)", "(128,", "128)", "True", "True"]
