"""A Dask commit record sealed with a matching digest but a content that cannot be right (a forgery,
another version's bug) is damage: recovery falls back to the previous checkpoint, never a raw
KeyError/IndexError/TypeError from the planner, never chunks read from the wrong place."""

import json
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
pytest.importorskip("distributed")

import ftidask  # noqa: E402
from ftidask.engine.runstate import seal_json  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 2
N, CHUNK = 1000, 250  # four chunks


def _set(key, value):
    return lambda extra: extra.__setitem__(key, value)


def _var(key, value):
    return lambda extra: extra["vars"][0].__setitem__(key, value)


def _rows(position, value):
    return lambda extra: [row.__setitem__(position, value) for row in extra["chunks"]["1"]]


def _swap_indexes(extra):
    rows = extra["chunks"]["1"]
    rows[0][0], rows[2][0] = rows[2][0], rows[0][0]


FORGERIES = {
    "no variables": lambda extra: extra.pop("vars"),
    "variables not a list": _set("vars", "x"),
    "shape not a list": _var("shape", "abc"),
    "negative shape": _var("shape", [-5]),
    "bad dtype": _var("dtype", "zz"),
    "object dtype": _var("dtype", "|O"),
    "chunks not adding up": _var("chunks", [[1, 2]]),
    "id not an integer": _var("id", "abc"),
    "no chunk table": lambda extra: extra.pop("chunks"),
    "chunk table a list": _set("chunks", []),
    "rank out of range": _rows(1, 99),
    "short chunk row": lambda extra: extra["chunks"].__setitem__("1", [[0]]),
    "negative dptr": _rows(2, -10),
    "dptr past the file": _rows(2, 10**12),
    "grid index outside the grid": _rows(0, [99]),
    "two chunks' grid indexes swapped": _swap_indexes,
    "workers not a list": _set("workers", "abc"),
    "groups naming a rank twice": _set("groups", [[0, 0]]),
    "groups naming a rank it has not": _set("groups", [[0, 1, 2]]),  # (was: recovered; a rebuild's KeyError: 2)
}


def _two_checkpoints(client, dirs):
    """Checkpoint 1 at L4 (values 0..N-1), checkpoint 2 at L1 (values + 1); the record of 2's path."""
    ctx = ftidask.init(client=client, **dirs)
    x = da.arange(N, chunks=CHUNK).astype(np.float64).persist()
    ctx.protect(1, x)
    ctx.checkpoint(1, 4)
    ctx.protect(1, (x + 1).persist())
    ctx.checkpoint(2, 1)
    (record,) = Path(dirs["meta_dir"]).glob("*/commits/s00000002.json")
    return record


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_dask_record_falls_back_to_the_previous_checkpoint(dask_client, dirs, forgery):
    record = _two_checkpoints(dask_client, dirs)
    raw = json.loads(record.read_text())
    FORGERIES[forgery](raw["extra"])
    record.write_text(json.dumps(seal_json(raw)))  # its digest matches: only its content is wrong
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, da.zeros(N, chunks=CHUNK))
    assert ctx.status() == 1
    ctx.recover()
    assert ctx.recovered_from == (1, 4)
    assert np.array_equal(ctx.protected[1].compute(), np.arange(N, dtype=np.float64))
    ctx.finalize()


def test_an_untouched_record_still_recovers_the_newest(dask_client, dirs):
    """The checks pass what the backend writes (the control of the forgeries above)."""
    record = _two_checkpoints(dask_client, dirs)
    record.write_text(json.dumps(seal_json(json.loads(record.read_text()))))
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, da.zeros(N, chunks=CHUNK))
    ctx.recover()
    assert ctx.recovered_from == (2, 1)
    assert np.array_equal(ctx.protected[1].compute(), np.arange(N, dtype=np.float64) + 1)
    ctx.finalize()


def test_stored_size_passes_over_a_damaged_record(dask_client, dirs):
    record = _two_checkpoints(dask_client, dirs)
    raw = json.loads(record.read_text())
    raw["extra"]["vars"][0]["shape"] = "abc"
    record.write_text(json.dumps(seal_json(raw)))
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, da.zeros(N, chunks=CHUNK))
    assert ctx.stored_size(1) == N * 8  # from checkpoint 1's record
    assert ctx.stored_size(7) == 0  # FTI_GetStoredSize: no size stored for that id
    ctx.finalize()


def test_stored_size_is_0_before_the_first_checkpoint(dask_client, dirs):
    """FTI_GetStoredSize returns 0 when nothing is stored, as on the other backends."""
    ctx = ftidask.init(client=dask_client, **dirs)
    ctx.protect(1, da.zeros(N, chunks=CHUNK))
    assert ctx.stored_size(1) == 0
    ctx.finalize()


def _nested(depth):
    """A list nested ``depth`` deep, built without recursion: as deep, at the point a message formats it, as a
    forged record JSON still parses (nesting near Python's recursion limit, read at a shallow stack)."""
    value = []
    for _ in range(depth):
        value = [value]
    return value


_EXTRA = {"backend": "dask", "workers": ["tcp://a:1", "tcp://b:2"],
          "vars": [{"id": 1, "name": "a", "dtype": "<f8", "shape": [10, 4], "chunks": [[5, 5], [4]], "kind": "dask"}],
          "chunks": {"1": [[[0, 0], 0, 0, 160], [[1, 0], 1, 0, 160]]}}


@pytest.mark.parametrize("where", ["shape", "chunks", "name", "kind", "variable", "row", "workers"])
def test_a_value_nested_past_the_recursion_limit_is_damage_not_a_recursion_error(where):
    """The messages naming a forged value print it with reprlib (a few levels, a few items), not str(): str() of
    a list nested as deep as Python recurses raised RecursionError out of the record's check."""
    import copy
    import sys

    from ftidask.backends.dask.recorded import DamagedRecord, layout
    from ftidask.engine.runstate import CommitRecord, FileRecord

    extra = copy.deepcopy(_EXTRA)
    deep = _nested(sys.getrecursionlimit() + 100)
    if where in ("shape", "chunks", "name", "kind"):
        extra["vars"][0][where] = deep
    elif where == "variable":
        extra["vars"][0] = deep
    elif where == "row":
        extra["chunks"]["1"][0] = deep
    else:
        extra["workers"] = deep
    record = CommitRecord(1, 1, 1, 1.0, 2, (FileRecord(0, 0, 10, "x"), FileRecord(1, 0, 10, "y")), extra)
    with pytest.raises(DamagedRecord, match="is damaged"):
        layout(record)


def test_deeply_nested_groups_and_codec_records_are_clean_errors():
    """The same for a record's ``groups`` (recorded_topology) and a variable's ``codec_plain`` list."""
    import sys

    from ftidask.ftiff.compression import plain_ids
    from ftidask.levels.topology import recorded_topology
    from ftidask.model.errors import FormatError, LevelError

    deep = _nested(sys.getrecursionlimit() + 100)
    with pytest.raises(LevelError, match="are not lists of ranks"):
        recorded_topology([deep])
    with pytest.raises(FormatError, match="invalid codec_plain record"):
        plain_ids({"codec_plain": [deep]})
