"""A run that keeps many commit records (``keep_l4_ckpt``: every L4 checkpoint stays) does not read them all again
at every checkpoint: each checkpoint numbered the next one, retired and collected garbage by parsing every record
file three times (0.45 ms a record kept: 266 ms a checkpoint after 600 of them). Records are now parsed once while
their files stay the same, and committed directories found clean are not looked into again; what an interrupted
checkpoint leaves is still removed (a record changed on disk is read again: test_records_cache.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import ftidask
from ftidask.engine import records


def _dirs(tmp_path: Path, **kw) -> dict:
    return {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4, "exec_id": "many", **kw}


def test_a_checkpoint_parses_only_its_own_record_however_many_are_kept(tmp_path):
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    ctx.protect(1, a)
    for i in range(1, 41):
        a[:] = i
        ctx.checkpoint(i, 4)
    before = records.stats["parsed"]
    for i in range(41, 51):
        a[:] = i
        ctx.checkpoint(i, 4)
    # none, whatever the 40-50 kept: not 3 x 45 a checkpoint (and a record this process wrote is not read back)
    assert records.stats["parsed"] - before == 0
    a[:] = 0
    ctx.recover()
    assert (a == 50).all()
    ctx._close()


def test_leftovers_are_still_collected_in_a_run_of_many_records(tmp_path):
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    ctx.protect(1, a)
    for i in range(1, 6):
        ctx.checkpoint(i, 4)
    l4 = tmp_path / "G" / "many" / "l4"
    newest, oldest = sorted(l4.glob("ckpt5.s*"))[0], sorted(l4.glob("ckpt1.s*"))[0]
    planted = [newest / ".Ckpt5-Rank0.fti.tmp-x", l4 / "ckpt99.s99", l4 / ".x.tmp-y"]
    planted[0].write_bytes(b"torn")
    planted[1].mkdir()
    planted[2].write_bytes(b"torn")
    (oldest / ".Ckpt1-Rank0.fti.tmp-z").write_bytes(b"a head's copy torn, long ago")  # settled: left for a restart
    ctx.checkpoint(6, 4)
    assert not any(p.exists() for p in planted), [p for p in planted if p.exists()]
    assert (oldest / ".Ckpt1-Rank0.fti.tmp-z").exists()
    ctx._close()
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))  # a new process looks into every directory again
    ctx.protect(1, a)
    ctx.recover()
    ctx.checkpoint(7, 4)
    assert not (oldest / ".Ckpt1-Rank0.fti.tmp-z").exists()
    ctx._close()


def test_dask_lists_the_records_and_the_kept_directories_without_a_stat_each(tmp_path, dask_client, monkeypatch):
    """On Dask, retirement and garbage collection list the records once for both (they listed them once each, and
    a checkpoint numbered the next: three listings a checkpoint, a stat per record each), and the global L4
    directory is sorted by the listing's file types (it took a stat per kept checkpoint)."""
    a = np.zeros(64)
    ctx = ftidask.init(client=dask_client, **_dirs(tmp_path, keep_l4_ckpt=1))
    ctx.protect(1, a)
    for i in range(1, 9):
        a[:] = i
        ctx.checkpoint(i, 4)
    l4 = str(tmp_path / "G" / "many" / "l4")
    stats_in_l4 = []
    real_stat = os.stat

    def counting_stat(path, *args, **kw):
        if os.path.dirname(os.fspath(path)) == l4:
            stats_in_l4.append(os.fspath(path))
        return real_stat(path, *args, **kw)

    listed = records.stats["listed"]
    monkeypatch.setattr(os, "stat", counting_stat)
    for i in range(9, 14):
        a[:] = i
        ctx.checkpoint(i, 4)
    monkeypatch.undo()
    assert records.stats["listed"] - listed == 2 * 5  # numbering the next, then retirement and garbage together
    assert stats_in_l4 == []  # not 8-13 a checkpoint
    leftover = Path(l4) / "ckpt99.s99"  # an interrupted checkpoint's directory is still removed
    leftover.mkdir()
    ctx.checkpoint(14, 4)
    assert not leftover.exists()
    assert len(list(Path(l4).glob("ckpt*"))) == 14
    a[:] = 0
    ctx.recover()
    assert (a == 13).all()
    ctx.finalize()


def test_a_recovery_sends_the_records_kept_without_copying_each_field(tmp_path, monkeypatch):
    """A recovery sends every committed record to the ranks as JSON: with keep_l4_ckpt, thousands. to_json was
    dataclasses.asdict, which deep-copied every field one by one (a copy.deepcopy per value, the file records twice):
    90 us a record, 100 ms a recover() after 1000 kept. The JSON is the same, key for key, type for type."""
    a = np.zeros(64)
    ctx = ftidask.init(**_dirs(tmp_path, keep_l4_ckpt=1))
    ctx.protect(1, a)
    for i in range(1, 21):
        a[:] = i
        ctx.checkpoint(i, 4)
    import copy
    import dataclasses

    newest = ctx.state.records()[-1]
    raw = dataclasses.asdict(newest)
    raw["files"] = [dataclasses.asdict(f) for f in newest.files]
    assert newest.to_json() == raw and list(newest.to_json()) == list(raw)
    assert newest.to_json()["extra"] is not newest.extra
    copies = []
    real_deepcopy = copy.deepcopy

    def counting_deepcopy(value, *args, **kw):
        copies.append(type(value).__name__)
        return real_deepcopy(value, *args, **kw)

    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    a[:] = 0
    ctx.recover()
    monkeypatch.undo()
    assert (a == 20).all()
    assert copies == []  # not one a value of each of the 20 records
    ctx._close()


def test_the_listing_numbering_took_serves_once_and_never_after_a_record_changed(tmp_path):
    """RunState.take_numbered (the Dask committer's early collection keeps what it names): the records as next_seq
    listed them, once; after a record was written or deleted, a listing of now (a stale one would let the
    collection remove a committed checkpoint's directories)."""
    from ftidask.engine.runstate import CommitRecord, FileRecord, RunState

    state = RunState(tmp_path / "meta", "run")

    def record(seq: int) -> CommitRecord:
        return CommitRecord(seq, seq, 1, 0.0, 1, (FileRecord(0, 0, 1, "00" * 16),))

    state.write_record(record(1))
    assert state.next_seq() == 2
    listed = records.stats["listed"]
    assert [r.seq for r in state.take_numbered()] == [1]
    assert records.stats["listed"] == listed  # the numbering's listing, not another
    assert [r.seq for r in state.take_numbered()] == [1] and records.stats["listed"] == listed + 1  # once only
    state.next_seq()
    state.write_record(record(2))
    assert [r.seq for r in state.take_numbered()] == [1, 2]
    state.next_seq()
    state.delete_record(1)
    assert [r.seq for r in state.take_numbered()] == [2]
