"""Thousands of protected variables through the per-variable calls: var_id by name, protect under a name,
stored_size, recover_var. Each of them scanned every variable (or read the whole checkpoint again) per call, n calls
O(n^2); these tests check that what they answer at that scale is still right, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from recovery_counts import counting_checks

import ftidask
from ftidask.engine.variables import Protected
from ftidask.engine.vartable import VarTable
from ftidask.storage.files import find_paths

N = 3000


def _values(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 2**63, 1 + i % 37, dtype=np.int64) if i % 3 else rng.random(1 + i % 29)


def _names(n: int = N) -> list[str]:
    return [f"field/{i:05d}" for i in range(n)]


def _written(dirs: dict, order: list[int]) -> dict[str, int]:
    """Checkpoint 1 of N variables given ids by name in ``order``, then closed as a job that ends."""
    ctx = ftidask.init(**dirs)
    names, ids = _names(), {}
    for i in order:
        ids[names[i]] = ctx.var_id(names[i])
        ctx.protect(ids[names[i]], _values(i))
    assert sorted(ids.values()) == list(range(N))  # one above every id known, each time
    assert all(ctx.var_id(name, create=False) == vid for name, vid in ids.items())
    ctx.checkpoint(1, 1)
    assert [ctx.stored_size(ids[name]) for name in names] == [_values(i).nbytes for i in range(N)]
    ctx._close()
    return ids


def test_thousands_of_names_find_their_ids_again_on_a_restart(dirs):
    order = list(range(N))
    random.Random(1).shuffle(order)
    ids = _written(dirs, order)
    random.Random(2).shuffle(order)
    names = _names()
    ctx = ftidask.init(**dirs)
    out = {}
    for i in order:  # asked for in another order: the stored names' ids, never new ones
        vid = ctx.var_id(names[i], create=False)
        assert vid == ids[names[i]]
        out[i] = np.zeros_like(_values(i))
        ctx.protect(vid, out[i])
    assert ctx.var_id("not/stored", create=False) is None
    assert ctx.var_id("new") == N  # one above every stored id
    assert [ctx.stored_size(ids[name]) for name in names] == [_values(i).nbytes for i in range(N)]
    ctx.recover()
    assert all(out[i].tobytes() == _values(i).tobytes() for i in range(N))
    ctx.finalize()


def test_recover_var_of_each_of_thousands_verifies_the_file_once(dirs, monkeypatch):
    """recover_var() of one variable after another: the file the first verified, unchanged, is loaded as it is;
    each call read and hashed the whole file again (10,000 of 1 KiB: 0.85 s a call). A full recover() still
    verifies again, and so does a recover_var() once the file has changed."""
    ids = _written(dirs, list(range(N)))
    checked = counting_checks(monkeypatch)
    ctx = ftidask.init(**dirs)
    out = [np.full_like(_values(i), 7) for i in range(N)]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    every = list(range(0, N, 7))
    for vid in every:
        assert ctx.recover_var(vid) is out[vid]
    assert len(checked) == 1
    assert all(out[i].tobytes() == (_values(i) if i in every else np.full_like(_values(i), 7)).tobytes()
               for i in range(N))
    ctx.recover()
    assert len(checked) == 2 and all(out[i].tobytes() == _values(i).tobytes() for i in range(N))
    path = next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")))
    out[1][...] = 7
    raw = bytearray(path.read_bytes())
    with open(path, "r+b") as fh:  # damaged in place after the recoveries: the next one sees it
        fh.seek(len(raw) // 2)
        fh.write(bytes([raw[len(raw) // 2] ^ 0xFF]))
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover_var(1)
    assert len(checked) == 3 and (out[1] == 7).all()
    assert ids  # (the names were given as well)


def test_protect_under_thousands_of_names_refuses_a_taken_one(dirs):
    with ftidask.init(**dirs) as ctx:
        for i, name in enumerate(_names()):
            ctx.protect(i, np.zeros(2), name=name)
        with pytest.raises(ftidask.ProtectError, match="variable 1234's"):
            ctx.protect(N, np.zeros(2), name="field/01234")
        ctx.protect(1234, np.ones(2), name="renamed")  # its own id again, under another name
        ctx.protect(N, np.zeros(2), name="field/01234")  # now free
        assert ctx.var_id("field/01234", create=False) == N and ctx.var_id("renamed", create=False) == 1234
        assert ctx.var_id("fresh") == N + 1


def test_the_variable_table_keeps_its_index_of_names():
    table = VarTable()
    for vid in (5, 2, 9):
        table[vid] = Protected(vid, f"n{vid}", np.zeros(1))
    assert (table.named("n2"), table.top(), table.other_named("n2", 2), table.other_named("n2", 3)) == (2, 9, None, 2)
    table[2] = Protected(2, "n5", np.zeros(1))  # two called n5: the first in protection order
    assert table.named("n2") is None and table.named("n5") == 5 and list(table) == [5, 2, 9]
    del table[5]
    assert table.named("n5") == 2 and table.top() == 9
    assert table.pop(9).name == "n9" and table.top() == 2 and table.pop(9, None) is None
    table.update({7: Protected(7, "n7", np.zeros(1))})
    table.setdefault(8, Protected(8, "n8", np.zeros(1)))
    assert (table.named("n7"), table.named("n8"), table.top()) == (7, 8, 8)
    table.clear()
    assert (table.named("n7"), table.top(), dict(table)) == (None, -1, {})


def test_small_spans_written_one_after_another_land_at_their_offsets(tmp_path):
    """Small spans are written together where they follow each other (a seek and a write per variable cost more than
    its copy); spans that follow each other, leave a gap or go back all land where they belong, hashed as written."""
    from concurrent.futures import ThreadPoolExecutor

    from ftidask.ftiff import hashing, writer
    from ftidask.model.arrays import ArrayBytes

    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, 1 + i % 300, dtype=np.uint8) for i in range(2000)]
    offsets, at = [], 0
    for i, a in enumerate(arrays):
        at += 17 if i % 9 == 0 else 0  # a gap now and then
        offsets.append(at)
        at += a.nbytes
    order = list(range(2000))
    order[100:110] = order[109:99:-1]  # some written backwards
    spans = [(i, offsets[i], ArrayBytes(arrays[i]), 0, arrays[i].nbytes) for i in order]
    path = tmp_path / "spans"
    with open(path, "w+b") as fh, ThreadPoolExecutor(2) as pool:
        fh.write(bytes(at))
        digests = writer.write_spans(fh, spans, 2, pool)
    raw = path.read_bytes()
    assert all(raw[offsets[i]:offsets[i] + a.nbytes] == a.tobytes() for i, a in enumerate(arrays))
    assert all(digests[i] == hashing.digest(2, memoryview(a)) for i, a in enumerate(arrays))
    assert sum(map(len, (raw[offsets[i] - 17:offsets[i]] for i in range(9, 2000, 9)))) and not any(
        raw[offsets[i] - 17:offsets[i]].strip(b"\0") for i in range(9, 2000, 9))
