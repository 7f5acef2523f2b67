"""The dCP fallback under kills and damage: found by an adversarial review and its random-crash campaign.

* Killed at each step of a retirement, then the newest checkpoint damaged: the previous checkpoint (whole, in its
  directory or as the spare) stays recoverable.
* A spare that a recovery tried as the fallback and found damaged is never patched by the next checkpoint
  (on the process's own layout and on another one).
* A restart on another layout recovers an older checkpoint of its own layout when the newer ones fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.storage.files import find_paths

sys.path.insert(0, str(Path(__file__).parent))
from mpi_util import need_mpi, run  # noqa: E402
from test_dcp import _kw  # noqa: E402

CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import numpy as np, crashpoints, ftidask
from {module} import {cls}
crashpoints.kill_at_call({cls}, {name!r}, {nth}, after={after})   # SIGKILL
ctx = ftidask.init(**{kw!r})
a = np.zeros(10_000); ctx.protect(1, a)
for i in (1, 2, 3):
    a[:] = i
    a[i * 700] = -i
    ctx.checkpoint(i, {level})
"""


def _killed(root: Path, owner: str, name: str, nth: int, after: bool, level: int) -> None:
    """Checkpoints 1-3 at ``level`` in a child process SIGKILLed at the ``nth`` call of ``owner.name``."""
    module, cls = owner.split(":")
    code = CHILD.format(tests=str(Path(__file__).parent), module=module, cls=cls, name=name, nth=nth, after=after,
                        kw=_kw(root), level=level)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr


def _state(i: int) -> np.ndarray:
    a = np.full(10_000, float(i))
    a[i * 700] = -i
    return a


def _recovered(root: Path, size: int = 10_000) -> np.ndarray:
    """A restart's recovery of array 1 (``size`` float64)."""
    ctx = ftidask.init(**_kw(root))
    b = np.zeros(size)
    ctx.protect(1, b)
    try:
        ctx.recover()
    finally:
        ctx._closed = True
        if ctx._run_lock is not None:
            ctx._run_lock.release()
    return b


# Checkpoint 3's retirement of checkpoint 2 (the second retirement): killed as each of its steps starts or ends.
STEPS = [("ftidask.engine.dcpstore:DcpStore", "retire", False), ("ftidask.engine.dcpstore:DcpStore", "retire", True),
         ("ftidask.engine.runstate:RunState", "note_retired", False),
         ("ftidask.engine.runstate:RunState", "note_retired", True),
         ("ftidask.engine.runstate:RunState", "delete_record", True)]


@pytest.mark.parametrize("level", [5, 8])
@pytest.mark.parametrize("owner,name,after", STEPS)
def test_killed_while_retiring_the_previous_checkpoint_then_newest_damaged(tmp_path, owner, name, after, level):
    """Checkpoints 1-3; killed during checkpoint 3's retirement of checkpoint 2; checkpoint 3's file then cut.
    Checkpoint 2 is whole (its file in its directory or renamed to the spare): the restart recovers it, exactly.
    Before, a kill once the file was the spare and before its fallback record was written left checkpoint 2 named
    by its commit record only, which points at its directory: NoCheckpointError with checkpoint 2 whole."""
    _killed(tmp_path, owner, name, 2, after, level)
    (newest,) = tmp_path.glob("*/**/ckpt3.*/Ckpt3-Rank0.fti")
    os.truncate(newest, newest.stat().st_size - 100)
    whole = sorted(str(p.relative_to(tmp_path)) for p in find_paths(tmp_path, "*.fti"))
    try:
        got = _recovered(tmp_path)
    except ftidask.NoCheckpointError as exc:
        pytest.fail(f"files {whole}: checkpoint 2 is whole, yet {exc}")
    assert got.tobytes() == _state(2).tobytes()


# --- a spare that a recovery found damaged ------------------------------------------------------------------

def _flip_unchanged_block(spare: Path, a: np.ndarray, at: int) -> None:
    """Flip a bit of ``a[at]`` in the spare: a block that the next checkpoint does not change (bit rot)."""
    data = spare.read_bytes()
    off = data.find(a[at:at + 4].tobytes())
    assert off > 0
    with open(spare, "r+b") as fh:
        fh.seek(off)
        fh.write(bytes([data[off] ^ 1]))


@pytest.mark.parametrize("restart", [True, False])
@pytest.mark.parametrize("level", [5, 8])
def test_a_spare_found_damaged_is_never_patched(tmp_path, level, restart):
    """Checkpoints 1-3; a bit of the spare (checkpoint 2) flipped in a block that never changes, checkpoint 3's file
    cut: recovery finds nothing (NoCheckpointError). Checkpoint 4 must then be written in full, not by patching the
    spare that the recovery has just found damaged: before, a restart trusted the spare's own block hashes (its hint
    named its FB hash) and the process that wrote it its block state, so checkpoint 4 patched only the changed
    blocks, was committed and reported written, and never verified (the next restart recovered nothing)."""
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(40_000, dtype=np.float64)
    ctx.protect(1, a)
    for i in (1, 2, 3):
        a[i * 100] = -i
        ctx.checkpoint(i, level)
    _flip_unchanged_block(ctx._dcp.spare_path(level - 4), a, 30_000)
    newest = ctx._rank_file(ctx.state.records()[-1])
    os.truncate(newest, newest.stat().st_size - 100)
    if restart:
        ctx._closed = True
        ctx._run_lock.release()
        ctx = ftidask.init(**_kw(tmp_path))
        a = np.arange(40_000, dtype=np.float64)
        ctx.protect(1, a)
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    a[4 * 100] = -4
    ctx.checkpoint(4, level)
    ctx._closed = True
    ctx._run_lock.release()
    got = _recovered(tmp_path, a.size)
    assert got.tobytes() == a.tobytes()


# --- restarts on another number of ranks ---------------------------------------------------------------------

def _resharded_newest_cut(tmp_path, level):
    """Checkpoint 1 at L4 on 4 ranks; a restart on 2 ranks recovers it and writes checkpoints 2 and 3 at ``level``;
    rank 0's file of checkpoint 3 is cut (at L1_DCP, its spare too: checkpoint 2 is lost)."""
    run(4, "reshard_older_job.py", "l4", str(tmp_path), str(level))
    run(2, "reshard_older_job.py", "dcp", str(tmp_path), str(level))
    (newest,) = tmp_path.glob("Local/node0/*/l1/ckpt3.*/Ckpt3-Rank0.fti")
    os.truncate(newest, newest.stat().st_size - 100)
    if level == 5:
        spare = next(tmp_path.glob("Local/node0/*/l1/dcp/Spare-Rank0.fti"))
        os.truncate(spare, spare.stat().st_size - 100)


@pytest.mark.parametrize("level", [1, 5])
@need_mpi()[0]
@need_mpi()[1]
def test_an_older_checkpoint_of_this_layout_is_recovered_when_the_resharded_ones_fail(tmp_path, level):
    """Checkpoint 1 at L4 on 4 ranks; a restart on 2 ranks recovers it and writes checkpoints 2 and 3 at ``level``;
    rank 0's file of checkpoint 3 is cut (at L1_DCP, its spare too: checkpoint 2 is lost). A restart on 4 ranks
    recovers checkpoint 1, exactly: before, the newest checkpoints had another layout, only they were tried (to be
    redistributed), and the restart raised NoCheckpointError with checkpoint 1, of its own layout, sound."""
    _resharded_newest_cut(tmp_path, level)
    run(4, "reshard_older_job.py", "recover", str(tmp_path), str(level))
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    assert got == [{"from": [1, 4], "exact": True}] * 4, got


@pytest.mark.parametrize("ranks,node_size,level,rank", [(4, 2, 5, 0), (4, 2, 8, 1), (2, 1, 8, 1)])
@need_mpi()[0]
@need_mpi()[1]
def test_spares_found_damaged_on_another_layout_are_never_patched(tmp_path, ranks, node_size, level, rank):
    """4 ranks on 4 nodes write checkpoints 1-3 at ``level`` (zeros but a marker: blocks alike); a bit of rank
    ``rank``'s spare is flipped and its file of checkpoint 3 cut. A restart on another layout (``ranks`` ranks,
    ``node_size`` per node) recovers nothing (NoCheckpointError) and writes checkpoint 4, which a restart on that
    layout recovers exactly. Before, a rank that found its spare again (4 ranks on 2 nodes: rank 0's L1 spare on its
    node, rank 1's L4 spare in the global directory) patched it, damaged (its hint still named its FB hash): the
    damaged block, unchanged, stayed, and checkpoint 4 never verified."""
    run(4, "reshard_spare_job.py", "write", str(tmp_path), "1", str(level))
    where = "Global/*/l4" if level == 8 else f"Local/node{rank}/*/l1"
    spare = next(tmp_path.glob(f"{where}/dcp/Spare-Rank{rank}.fti"))
    data = spare.read_bytes()
    off = data.find(bytes(4096), 4096 * 2)  # a zero block of its data
    with open(spare, "r+b") as fh:
        fh.seek(off + 100)
        fh.write(b"\x01")
    (newest,) = tmp_path.glob(f"{where}/ckpt3.*/Ckpt3-Rank{rank}.fti")
    os.truncate(newest, newest.stat().st_size - 100)
    args = (str(tmp_path), str(node_size), str(level))
    run(ranks, "reshard_spare_job.py", "continue", *args)
    assert [json.loads((tmp_path / f"continue-{r}.json").read_text()) for r in range(ranks)] == \
        [{"error": "NoCheckpointError"}] * ranks
    run(ranks, "reshard_spare_job.py", "recover", *args)
    got = [json.loads((tmp_path / f"recover-{r}.json").read_text()) for r in range(ranks)]
    assert got == [{"from": [4, level - 4], "exact": True}] * ranks, got


@need_mpi()[0]
@need_mpi()[1]
def test_a_fallback_of_another_layout_is_recovered_after_the_newest_of_this_layout_fails(tmp_path):
    """4 ranks write L4_DCP checkpoints 1-3 (rank 1's file of 3 then cut); a restart on 2 ranks redistributes
    checkpoint 2 from the spares and writes checkpoint 4 beside them; rank 1's file of 4 is cut. A restart on 2 ranks
    recovers checkpoint 2 again, from the spares of the 4 ranks, exactly: before, the newest checkpoint (4) had this
    run's layout, so only checkpoints of this layout were tried, and the restart raised NoCheckpointError."""
    run(4, "dcp_fallback_job.py", "write", str(tmp_path), timeout=120)
    (newest,) = tmp_path.glob("Global/*/l4/ckpt3.*/Ckpt3-Rank1.fti")
    os.truncate(newest, newest.stat().st_size - 100)
    run(2, "dcp_fallback_job.py", "continue", str(tmp_path), timeout=120)
    (newest,) = tmp_path.glob("Global/*/l4/ckpt4.*/Ckpt4-Rank1.fti")
    os.truncate(newest, newest.stat().st_size - 100)
    run(2, "dcp_fallback_job.py", "recover", str(tmp_path), timeout=120)
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert got == [{"from": [2, 4], "exact": True}] * 2, got


@need_mpi()[0]
@need_mpi()[1]
def test_stored_size_refuses_when_the_newest_checkpoint_has_another_layout(tmp_path):
    """Checkpoint 1 at L4 on 4 ranks; a restart on 2 ranks writes checkpoints 2 and 3. A restart on 4 ranks asks
    stored_size(1) and realloc(1) before recover(), FTI's order: both raise a RecoveryError naming the layout change,
    and recover() then redistributes checkpoint 3, exactly. Before, both answered for checkpoint 1 (the newest of
    this run's layout) while recover() redistributed checkpoint 3: sizes of another checkpoint than the one loaded."""
    run(4, "reshard_older_job.py", "l4", str(tmp_path), "1")
    run(2, "reshard_older_job.py", "dcp", str(tmp_path), "1")
    run(4, "reshard_older_job.py", "sizes", str(tmp_path), "1")
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    for res in got:
        assert res["from"] == [3, 1] and res["exact"], res
        for call in ("stored_size", "realloc"):
            assert isinstance(res[call], dict) and res[call]["error"] == "RecoveryError", res
            assert "checkpoint 3 (level 1) was written by 2 ranks, this run recovers on 4" in res[call]["message"], res


@pytest.mark.parametrize("level", [1, 5])
@need_mpi()[0]
@need_mpi()[1]
def test_stored_size_answers_for_the_older_checkpoint_that_recover_loads_when_the_resharded_ones_fail(tmp_path, level):
    """As above (checkpoint 1 at L4 on 4 ranks, checkpoints 2 and 3 at ``level`` on 2 ranks, rank 0's file of 3 cut,
    at L1_DCP its spare too): a restart on 4 ranks asks stored_size(1) and realloc(1) before recover(). recover()
    loads checkpoint 1 (this run's layout), so both answer for it (8192 bytes per rank). Before, both raised a
    RecoveryError naming checkpoint 3's layout, which recover() cannot redistribute and does not load."""
    _resharded_newest_cut(tmp_path, level)
    run(4, "reshard_older_job.py", "sizes", str(tmp_path), str(level))
    got = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    assert got == [{"from": [1, 4], "exact": True, "stored_size": 8192, "realloc": 8192}] * 4, got
