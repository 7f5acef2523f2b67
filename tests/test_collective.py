"""One process: a failure in a collective step is the same clear error as with MPI (ftidask.transport.collective).

The MPI side (the same error on every rank, no hang) is in test_mpi_one_rank_fault.py.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine import writing as context_writing
from ftidask.model.errors import CheckpointError
from ftidask.storage import files as storage
from ftidask.storage.files import find_paths


def _kw(root: Path) -> dict:
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=4)


def _recovered(root: Path) -> tuple[tuple[int, int] | None, np.ndarray]:
    ctx = ftidask.init(**_kw(root))
    out = np.zeros(1000)
    ctx.protect(1, out)
    ctx.recover()
    ctx._close()
    return ctx.recovered_from, out


@pytest.mark.parametrize(("owner", "name", "exc", "words"), [
    (storage, "write_json_atomic", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "No space left on device"),
    (context_writing, "write_rank_file", MemoryError(), "MemoryError"),
])
def test_failed_step_is_a_checkpoint_error_and_the_previous_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  owner: object, name: str, exc: BaseException,
                                                                  words: str) -> None:
    ctx = ftidask.init(**_kw(tmp_path))
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    a[:] = -1

    def broken(*_args: object, **_kwargs: object) -> None:
        raise exc

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, broken)  # the commit record (a full meta_dir), or the writer
        with pytest.raises(CheckpointError, match=f"checkpoint 2 at level 1 failed; the previous checkpoint is kept: "
                                                  f"rank 0: .*{words}"):
            ctx.checkpoint(2, 1)
    ctx._close()
    source, got = _recovered(tmp_path)
    assert source == (1, 1) and (got == np.arange(1000.0)).all()
    assert not list(find_paths(tmp_path / "l", "Ckpt2-*"))  # the failed checkpoint's file is gone


def test_a_big_job_that_disagrees_is_named_by_groups_of_ranks() -> None:
    """Ten ranks, two calls: the error names each call once with its ranks (a 4096-rank job: a few lines, not 4096)."""
    from ftidask.transport.collective import agree_call
    from ftidask.transport.threads import run_group

    def rank(m):  # a ThreadMember has allgather; agree_call needs rank and size too
        m.rank = m.index
        level = 4 if m.index in (3, 7) else 1
        with pytest.raises(CheckpointError) as info:
            agree_call(m, "checkpoint", lambda: ({"id": 2, "level": level}, None), CheckpointError)
        m.allgather(None)  # nobody leaves (and breaks the group's barrier) before every member has raised
        return str(info.value)

    errors, failed = run_group(10, rank)
    assert not failed and len(set(errors)) == 1
    assert errors[0].endswith("checkpoint(id=2, level=1); ranks 3, 7: checkpoint(id=2, level=4)"), errors[0]
    assert all("in the same order): ranks 0-2, 4-6, 8-9: checkpoint(id=2, level=1); " in e for e in errors), errors[0]
