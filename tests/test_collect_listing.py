"""The garbage collection's listing (``storage.removal.collect_level_garbage``, on ``os.scandir`` since the
collection stopped looking into committed directories it found clean) reads a level directory as the
``Path.is_dir`` / ``iterdir`` before it did: what is not a directory (a link loop included) is passed over, never an
error that fails every start of the run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import ftidask


def _dirs(tmp_path: Path) -> dict:
    return {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4, "exec_id": "listing"}


def test_a_link_loop_in_place_of_a_level_directory_of_a_node_the_run_does_not_have_is_passed_over(tmp_path):
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, a)
    a[:] = 1
    ctx.checkpoint(1, 1)
    ctx._close()
    gone = tmp_path / "L" / "node5" / "listing"  # a node of an earlier start on more of them: rank 0 collects there
    gone.mkdir(parents=True)
    (gone / "l2").symlink_to(gone / "l2")  # ELOOP: Path.is_dir said False
    (gone / "l1").mkdir()
    (gone / "l1" / "ckpt9.s9").mkdir()  # what an interrupted checkpoint of that start left: still collected
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, a)
    a[:] = 0
    ctx.recover()
    assert (a == 1).all()
    a[:] = 2
    ctx.checkpoint(2, 1)
    assert not (gone / "l1" / "ckpt9.s9").exists()
    assert (gone / "l2").is_symlink()
    ctx._close()
