"""The retention rule (engine.retention.to_retire), shared by the ranks, the MPI heads and the Dask client."""

from ftidask.engine.retention import to_retire
from ftidask.engine.runstate import CommitRecord


def rec(seq: int, level: int) -> CommitRecord:
    return CommitRecord(seq, seq, level, 0.0, 1, ())


def test_a_commit_retires_earlier_checkpoints_of_its_level_and_below_oldest_first():
    history = [rec(1, 1), rec(2, 4), rec(3, 2), rec(4, 1), rec(5, 3)]
    new = rec(6, 2)
    assert [r.seq for r in to_retire(reversed(history), new, keep_l4=False)] == [1, 3, 4]
    assert [r.seq for r in to_retire(history, rec(7, 4), keep_l4=False)] == [1, 2, 3, 4, 5]


def test_keep_l4_keeps_every_level_4_checkpoint():
    history = [rec(1, 4), rec(2, 1), rec(3, 4)]
    assert [r.seq for r in to_retire(history, rec(4, 4), keep_l4=True)] == [2]


def test_newer_records_the_new_one_itself_and_unreadable_records_stay():
    new = rec(5, 4)
    history = [None, rec(5, 1), rec(6, 1), new]
    assert to_retire(history, new, keep_l4=False) == []
