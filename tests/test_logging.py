"""What ftidask prints: nothing by default, a line per checkpoint and recovery on stderr when the
verbosity is set explicitly (in the call or in the config file) or ``log_to_stderr()`` is called.
Each case runs a fresh interpreter (a run, then its restart in the same process) and reads its stderr."""

import logging
import subprocess
import sys

import pytest
from conftest import run_python
from mpi_util import env, mpiexec, need_mpi

SCRIPT = """
import logging, sys
import numpy as np
import ftidask

base, mode = sys.argv[1], sys.argv[2]
kw = dict(ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta")
config = None
if mode.startswith("verbosity="):
    kw["verbosity"] = int(mode.split("=")[1])
elif mode == "file":
    config = f"{base}/config.fti"
    with open(config, "w") as fh:
        fh.write("[basic]\\nverbosity = 2\\n")
elif mode == "log_to_stderr":
    ftidask.log_to_stderr(logging.INFO)
elif mode == "app_logging":  # the application configured logging itself: its handler gets the lines
    logging.basicConfig(format="APP %(name)s %(message)s")
    kw["verbosity"] = 2
a = np.arange(10.0)
ctx = ftidask.init(config, **kw)
ctx.protect(1, a)
ctx.checkpoint(1, 1)
ctx.checkpoint(2, 4)
ctx._close()                                # dies without finalize: the next init is a restart
ctx = ftidask.init(config, **kw)
ctx.protect(1, a)
ctx.recover()
ctx.finalize()
"""

LINES = ["fresh start", "checkpoint 1 (level 1) written", "checkpoint 2 (level 4) written", "restart (status 1)",
         "recovered checkpoint 2 from level 4"]


def run(tmp_path, mode):
    return run_python(SCRIPT, str(tmp_path), mode).stderr


@pytest.mark.parametrize("mode", ["verbosity=2", "file", "log_to_stderr", "verbosity=1"])
def test_one_line_per_checkpoint_and_recovery(tmp_path, mode):
    err = run(tmp_path, mode)
    for line in LINES:
        assert err.count(line) == 1, (line, err)  # once: the handler is attached once for two contexts
    assert all(line.startswith("[ftidask ") for line in err.splitlines()), err
    if mode != "verbosity=1":
        assert len(err.splitlines()) == len(LINES), err


@pytest.mark.parametrize("mode", ["default", "verbosity=3", "verbosity=4"])
def test_quiet(tmp_path, mode):
    assert run(tmp_path, mode) == ""


def test_application_logging_is_used_not_doubled(tmp_path):
    err = run(tmp_path, "app_logging")
    for line in LINES:
        assert err.count(line) == 1, (line, err)
    assert all(line.startswith("APP ftidask") for line in err.splitlines()), err


def test_log_to_stderr_attaches_once():
    import ftidask

    logger = logging.getLogger("ftidask")
    before = list(logger.handlers)
    try:
        first = ftidask.log_to_stderr(logging.WARNING)
        assert ftidask.log_to_stderr(logging.DEBUG) is first
        assert logger.handlers.count(first) == 1 and logger.level == logging.DEBUG
    finally:
        logger.handlers[:] = before
        logger.setLevel(logging.NOTSET)


@pytest.mark.parametrize("level", ["LOUD", 3.5, None])
def test_log_to_stderr_refuses_an_unknown_level(level):
    """An ftidask error naming the levels it takes (before: logging's raw ValueError/TypeError); nothing changed."""
    import ftidask

    logger = logging.getLogger("ftidask")
    before, was = list(logger.handlers), logger.level
    with pytest.raises(ftidask.FTIError, match=r"log_to_stderr\(level=.*\): .*logging.INFO or 'INFO'"):
        ftidask.log_to_stderr(level)
    assert logger.handlers == before and logger.level == was


MPI_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
import ftidask

base, verbosity = sys.argv[1], int(sys.argv[2])
ctx = ftidask.init(ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                   local_test=1, group_size=2, verbosity=verbosity, comm=MPI.COMM_WORLD)
ctx.protect(1, np.full(100, float(MPI.COMM_WORLD.rank)))
ctx.checkpoint(1, 2)
ctx.finalize()
"""


MPI_MARK, MPI_SKIP = need_mpi()


@MPI_MARK
@MPI_SKIP
@pytest.mark.parametrize("verbosity", [2, 1])
def test_mpi_information_from_rank_0_only(tmp_path, verbosity):
    """As FTI: information lines come from rank 0 alone; debug (verbosity 1) from every rank, tagged."""
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", MPI_SCRIPT, str(tmp_path), str(verbosity)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("checkpoint 1 (level 2) written") == (2 if verbosity == 1 else 1), proc.stderr
    assert ("[ftidask INFO rank 1]" in proc.stderr) == (verbosity == 1), proc.stderr
