"""What a checkpoint reads of the run's state besides the commit records (``run.json``, the fallback records of
differential checkpoints) is parsed again only when its file changed (:class:`ftidask.engine.records.JsonFiles`):
a small checkpoint read them all at each step. A change made on disk by another process is still seen, and the
paths a run deletes are still checked against its directories as they are named (relative ones against the
working directory of the moment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import ftidask
from ftidask.engine import records
from ftidask.engine.records import CommitRecord, FileRecord, sealed_record
from ftidask.storage.paths import RunPaths


def _dirs(tmp_path: Path, **kw) -> dict:
    return {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4, "exec_id": "state", **kw}


def _run_json(tmp_path: Path) -> Path:
    return tmp_path / "M" / "state" / "run.json"


def _started(tmp_path: Path) -> tuple[ftidask.Context, Path, dict]:
    """A fresh run protecting one array: its context, its run.json and what run.json holds."""
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.zeros(64))
    return ctx, _run_json(tmp_path), json.loads(_run_json(tmp_path).read_text())


def _replace_from_another_process(path: Path, value: dict) -> None:
    """Write ``value`` to ``path`` as another process of the run would: a temporary file renamed over it."""
    code = ("import json, os, sys; tmp = sys.argv[1] + '.tmp-x'; open(tmp, 'w').write(sys.argv[2]); "
            "os.replace(tmp, sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(path), json.dumps(value)], check=True)


def test_checkpoints_parse_the_run_state_files_once_while_they_stay_the_same(tmp_path):
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, a)
    ctx.checkpoint(1, 1)
    before = records.stats["files_parsed"]
    for i in range(2, 22):
        a[:] = i
        ctx.checkpoint(i, 1)
    assert records.stats["files_parsed"] - before == 0  # run.json unchanged, no fallback record: none read again
    ctx.finalize()


def test_a_run_json_replaced_by_another_process_is_read_again(tmp_path):
    ctx, path, info = _started(tmp_path)
    assert ctx.checkpoint(1, 1).seq == 1
    _replace_from_another_process(path, {**info, "seq": 1000})  # as a finished start's mark
    assert ctx.checkpoint(2, 1).seq == 1001  # never a sequence number the run used
    ctx.finalize()


def test_a_run_json_changed_in_place_to_the_same_size_is_read_again(tmp_path):
    ctx, path, info = _started(tmp_path)
    path.write_text(json.dumps({**info, "seq": 1000}))
    assert ctx.checkpoint(1, 1).seq == 1001
    time.sleep(0.05)  # past the file system's clock tick: its modification time differs
    size = path.stat().st_size
    with open(path, "r+b") as f:  # the same inode and size, another mark
        f.write(json.dumps({**info, "seq": 2000}).encode())
    assert path.stat().st_size == size
    assert ctx.checkpoint(2, 1).seq == 2001
    ctx.finalize()


def test_a_fallback_record_written_by_another_process_is_seen(tmp_path):
    ctx, _path, _info = _started(tmp_path)
    ctx.checkpoint(1, 1)
    fallback = CommitRecord(500, 7, 1, time.time(), 1, (FileRecord(0, 0, 1, "00" * 16),), {"fallback": True,
                                                                                            "dcp": True})
    path = tmp_path / "M" / "state" / "commits" / "fallback-l1.json"
    _replace_from_another_process(path, sealed_record(fallback))
    assert ctx.checkpoint(2, 1).seq == 501  # past the fallback's: its directory names are not taken again
    ctx._close()


def test_a_run_json_that_cannot_be_parsed_is_read_again_once_repaired(tmp_path):
    ctx, path, info = _started(tmp_path)
    path.write_text("{torn")
    ctx.checkpoint(1, 1)  # a damaged run.json is read as empty, as before
    before = records.stats["files_parsed"]
    ctx.checkpoint(2, 1)
    assert records.stats["files_parsed"] - before == 1  # not kept: read again
    _replace_from_another_process(path, {**info, "seq": 300})
    assert ctx.checkpoint(3, 1).seq == 301
    ctx.finalize()


def test_relative_run_directories_are_checked_against_the_working_directory_of_the_moment(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    paths = RunPaths(Path("L"), Path("G"), Path("M"), "run")
    monkeypatch.chdir(tmp_path / "one")
    assert paths.contains(tmp_path / "one" / "L" / "node0" / "run")
    assert paths.contains(Path("M/run/commits"))
    monkeypatch.chdir(tmp_path / "two")
    assert not paths.contains(tmp_path / "one" / "L" / "node0" / "run")
    assert paths.contains(tmp_path / "two" / "G" / "run" / "l4")
    assert not paths.contains(Path("L/../elsewhere"))
    assert not paths.contains(Path("L"))  # a root itself is not inside it


def test_absolute_run_directories_contain_only_what_lies_strictly_inside_them(tmp_path):
    paths = RunPaths(tmp_path / "L", tmp_path / "G", tmp_path / "M", "run")
    assert paths.contains(tmp_path / "L" / "node0")
    assert paths.contains(tmp_path / "G" / "run" / ".." / "other")  # lexically inside G
    assert not paths.contains(tmp_path / "G" / ".." / "M2" / "x")
    assert not paths.contains(tmp_path / "L2" / "x")  # a sibling that shares the prefix
    assert not paths.contains(tmp_path / "M")
    assert not paths.contains(Path(os.sep))
    assert RunPaths(Path(os.sep), tmp_path / "G", tmp_path / "M", "run").contains(tmp_path / "anything")
