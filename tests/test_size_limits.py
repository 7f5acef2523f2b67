"""What ftidask refuses to read for its size it never writes, and a file forged large allocates nothing.

The variable table of an FTI-FF file is read only up to ``trailer.MAX_TRAILER`` bytes and a JSON record (commit
record, parity hash record, run state, Zarr manifest) only up to ``files.MAX_RECORD``: a table or record beyond
them is refused by the writer, as a failed checkpoint that keeps the previous one, not committed and then found
unreadable. The limits are lowered here (module attributes, read at each call) to keep the tests small.
"""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import CheckpointError
from ftidask.ftiff import trailer
from ftidask.storage import files


def test_a_table_larger_than_the_reader_takes_fails_the_checkpoint_not_the_recovery(dirs, monkeypatch):
    monkeypatch.setattr(trailer, "MAX_TRAILER", 2000)
    ctx = ftidask.init(**dirs)
    first = np.arange(10.0)
    ctx.protect(1, first)
    ctx.checkpoint(1, 1)
    for vid in range(2, 40):  # a table of about 3000 bytes: more than the reader takes
        ctx.protect(vid, np.zeros(1), name=f"variable number {vid}")
    first += 1
    with pytest.raises(CheckpointError, match="variable table"):
        ctx.checkpoint(2, 1)
    del ctx  # a crash: finalize would remove the checkpoints
    ctx = ftidask.init(**dirs)
    back = np.zeros(10)
    ctx.protect(1, back)
    ctx.recover()
    assert ctx.recovered_from == (1, 1)  # the previous checkpoint, whole
    assert (back == np.arange(10.0)).all()
    ctx.finalize()


def _sparse(path, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_commit_record_forged_huge_is_passed_over_without_reading_it(dirs):
    """A commit record replaced by a sparse file of 300 MiB (any size costs nothing on disk) is taken as a
    damaged record: recovery falls back to the previous checkpoint and never allocates its size."""
    ctx = ftidask.init(**dirs)
    array = np.arange(100.0)
    ctx.protect(1, array)
    ctx.checkpoint(1, 4)
    array += 1
    ctx.checkpoint(2, 1)
    del ctx  # a crash: no finalize
    (newest,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    _sparse(newest, 300 << 20)
    ctx = ftidask.init(**dirs)
    back = np.zeros(100)
    ctx.protect(1, back)
    assert _peak(lambda: ctx.recover()) < 64 << 20
    assert ctx.recovered_from == (1, 4) and (back == np.arange(100.0)).all()  # checkpoint 2's record is none


def test_read_json_refuses_what_is_larger_than_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_RECORD", 100)
    path = tmp_path / "r.json"
    path.write_text('{"a": "' + "x" * 200 + '"}')
    assert files.read_json(path) is None
    path.write_text('{"a": 1}')
    assert files.read_json(path) == {"a": 1}
    with pytest.raises(OSError, match="larger than"):
        files.write_json_atomic(tmp_path / "w.json", {"a": "x" * 200})
    assert not (tmp_path / "w.json").exists()


@pytest.mark.parametrize("which", ["metadata", "chunk"])
def test_a_foreign_zarr_store_with_a_file_forged_huge_is_refused_before_it_is_read(tmp_path, which):
    """Nothing in a Zarr store ftidask did not write is hash-checked: a metadata file or a chunk replaced by a
    sparse file of 300 MiB was read whole by Zarr (900 MiB allocated for the metadata); refused before."""
    zarr = pytest.importorskip("zarr")
    from ftidask.zarrfmt.foreign import read_plain_group

    store = tmp_path / "s.zarr"
    group = zarr.open_group(str(store), mode="w")
    group.create_array("a", shape=(100,), chunks=(10,), dtype="f8")[:] = np.arange(100.0)
    assert read_plain_group(store)[1][1].tobytes() == np.arange(100.0).tobytes()
    _sparse(store / "a" / ("zarr.json" if which == "metadata" else "c/0"), 300 << 20)
    peak = []
    with pytest.raises(ftidask.FormatError, match="larger than"):
        try:
            tracemalloc.start()
            read_plain_group(store)
        finally:
            peak.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
    assert peak[0] < 16 << 20
