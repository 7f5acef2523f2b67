"""The per-variable fast paths of a checkpoint and a recovery of many small arrays say what the general code says.

A checkpoint of 10,000 small arrays cost 30-40 us a variable in Python objects: a VarInfo, a ContainerMeta and a
new Slot per variable, a local step per variable, an empty array per variable to check a table. These tests pin
what the paths that make none of them produce against the objects' own answers, for every kind of array.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.engine import pending as pending_module
from ftidask.ftiff import hashing, reader, verify
from ftidask.ftiff.layout import layout_from_slots, plan_layout
from ftidask.ftiff.structs import BMD_SIZE
from ftidask.ftiff.writer import write_ftiff
from ftidask.model.arrays import ArrayBytes, VarInfo
from ftidask.model.errors import CheckpointError, FormatError
from ftidask.storage.files import find_paths


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [
        rng.random(16), np.arange(12, dtype=np.int16).reshape(3, 4), np.asfortranarray(rng.random((3, 5))),
        np.array(2.5), np.zeros(0), np.zeros((0, 4), np.int8), np.arange(6, dtype=">f8"),
        np.array([1 + 2j, 3j], np.complex64), np.array([True, False, True]),
        np.array(["2020-01-01", "2021-02-03"], dtype="datetime64[D]"), np.zeros((2, 2), "m8[s]"),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8", (2,))]),
        np.zeros(2, dtype=np.dtype({"names": ["a"], "formats": ["<i2"], "offsets": [4], "itemsize": 12})),
        np.array(["ab", "c"], "U3"), np.array([b"ab"], "S4"), np.zeros(2, dtype=("<f4", (2, 3))),
        np.zeros(3, np.float16), np.arange(10.0)[::2], np.arange(24.0).reshape(2, 3, 4)[:, 1:, :],
    ]


def test_a_table_entry_made_without_a_varinfo_is_the_varinfos():
    for i, a in enumerate(_arrays()):
        for extra in (None, {}, {"k": [1, 2]}):
            assert VarInfo.json_of(i, f"v{i}", a, extra) == VarInfo.of(i, f"v{i}", a, **(extra or {})).to_json()


def test_the_byte_view_of_each_kind_of_array_is_its_stream():
    for a in _arrays():
        stream = ArrayBytes(a)
        expected = (a.T if stream.order == "F" else a).tobytes()
        view = stream.view(0, a.nbytes)
        if view is None:  # not contiguous: read in pieces
            assert not (a.flags.c_contiguous or a.flags.f_contiguous)
            assert b"".join(bytes(p) for p in stream.pieces(0, a.nbytes)) == expected
        else:
            assert view.format == "B" and view.ndim == 1 and bytes(view) == expected


def test_a_plan_for_the_same_variables_is_the_previous_layout_itself():
    """Planned again for the variables it was planned for, a layout is its own plan: the same object (a run of
    unchanged variables reuses it whole, and what it cached); otherwise what a plan from scratch of its
    containers gives."""
    sizes = [(i, 8 * (i % 5)) for i in range(2000)]
    first = plan_layout(None, sizes)
    assert plan_layout(first, sizes) is first
    assert plan_layout(first, list(sizes)) is first
    grown = [(i, n + (16 if i % 3 == 0 else 0)) for i, n in sizes]
    second = plan_layout(first, grown)
    assert second is not first and len(second.blocks) == 2
    assert plan_layout(second, grown) is second
    # from a file's containers (no plan remembered): the same layout, planned again
    rebuilt = layout_from_slots([block.slots for block in second.blocks])
    again = plan_layout(rebuilt, grown)
    assert again == second and plan_layout(again, grown) is again
    # shrunk and removed ones: emptied, not dropped; the others reordered keep their containers
    shrunk = [(i, n // 2) for i, n in reversed(grown[:1500])]
    third = plan_layout(second, shrunk)
    assert len(third.blocks) == 2 and third.fs == second.fs
    for i, n in shrunk:
        assert sum(s.chunksize for s in third.slots_of(i)) == n
        assert all(s.idx == 1499 - i for s in third.slots_of(i))
    assert all(s.chunksize == 0 and s.idx == i for i in range(1500, 2000) for s in third.slots_of(i))
    with pytest.raises(ValueError, match="duplicate"):
        plan_layout(third, [(1, 8), (1, 8)])


@pytest.mark.parametrize("hash_id", [1, 2])
def test_the_metadata_packed_in_place_is_each_containers_own(tmp_path, hash_id):
    arrays = {i: a for i, a in enumerate(_arrays()) if a.flags.c_contiguous or a.flags.f_contiguous}
    arrays[99] = np.random.default_rng(0).random(100_000)  # above the inline size: hashed on the pool
    layout = plan_layout(None, [(v, a.nbytes) for v, a in arrays.items()])
    layout = plan_layout(layout, [(v, a.nbytes * (2 if v % 2 else 1)) for v, a in arrays.items()])
    sources = {v: ArrayBytes(np.concatenate([a.reshape(-1).view(np.uint8)] * (2 if v % 2 else 1)))
               for v, a in arrays.items()}
    with open(tmp_path / "f.fti", "w+b") as fh:
        written = write_ftiff(fh, layout, sources, hash_id=hash_id, trailer={"vars": []}, timestamp=1)
    raw = (tmp_path / "f.fti").read_bytes()
    for block, metas in zip(layout.blocks, written.containers):
        packed = raw[block.offset + BMD_SIZE:block.offset + block.metasize]
        assert packed == b"".join(m.pack() for m in metas)
        for slot, meta in zip(block.slots, metas):
            assert (meta.id, meta.idx, meta.containerid, meta.dptr, meta.fptr, meta.chunksize, meta.containersize) \
                == (slot.var_id, slot.idx, slot.containerid, slot.dptr, slot.fptr, slot.chunksize, slot.containersize)
            data = raw[slot.fptr:slot.fptr + slot.chunksize]
            assert meta.hascontent == (slot.chunksize > 0)
            assert meta.hash == (hashing.digest(hash_id, data) if slot.chunksize else bytes(16))
    assert written.fb.ckpt_size == layout.ckpt_size and len(raw) == written.file_size
    with open(tmp_path / "f.fti", "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(tmp_path / "f.fti"))
    assert [m for _b, _c, m in parsed.containers()] == [m for metas in written.containers for m in metas]


def test_a_checked_dtype_still_refuses_what_numpy_cannot_hold():
    ok = {"id": 1, "name": "a", "dtype": "<f8", "shape": [2, 3], "order": "C", "nbytes": 48}
    assert VarInfo.from_json(ok).shape == (2, 3)
    assert VarInfo.from_json(ok).shape == (2, 3)  # the second time from the checked ones
    with pytest.raises(FormatError, match="more dimensions"):
        VarInfo.from_json({**ok, "shape": [1] * 70, "nbytes": 8})
    for bad in ({**ok, "nbytes": 40}, {**ok, "shape": [-2, -3]}, {**ok, "dtype": "O"}, {**ok, "dtype": "<q9"},
                {**ok, "order": "X"}):
        with pytest.raises(FormatError):
            VarInfo.from_json(bad)


def _kw(root: Path) -> dict:
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=4)


def test_a_variable_failing_midway_fails_the_checkpoint_and_the_previous_stays(tmp_path, monkeypatch):
    """The variables are written in one local step: the first failure stops it, the checkpoint fails with it on
    every rank, and the previous one is what a recovery finds (a differential checkpoint: written variable by
    variable)."""
    data = [np.full(16, float(i)) for i in range(3000)]
    ctx = ftidask.init(**_kw(tmp_path), enable_dcp=True)
    for i, a in enumerate(data):
        ctx.protect(i, a)
    ctx.checkpoint(1, 5)
    for a in data:
        a += 0.5
    real = pending_module.ArrayBytes

    def failing(array, *args):
        if array is data[1700]:
            raise MemoryError()
        return real(array, *args)

    monkeypatch.setattr(pending_module, "ArrayBytes", failing)
    with pytest.raises(CheckpointError, match="checkpoint 2 at level 5 failed; the previous checkpoint is kept: "
                                              "rank 0: MemoryError"):
        ctx.checkpoint(2, 5)
    monkeypatch.setattr(pending_module, "ArrayBytes", real)
    out = [np.zeros(16) for _ in data]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    ctx.recover()
    assert ctx.recovered_from == (1, 1)  # a differential checkpoint is recorded at its base level
    assert all((a == float(i)).all() for i, a in enumerate(out))
    ctx._close()


def test_a_checkpoint_after_a_recovery_plans_on_the_recovered_files_containers(tmp_path):
    data = [np.random.default_rng(i).random(8 + i % 5) for i in range(2000)]
    ctx = ftidask.init(**_kw(tmp_path))
    for i, a in enumerate(data):
        ctx.protect(i, a)
    ctx.checkpoint(1, 1)
    ctx._close()  # as a job that ends (finalize would remove its checkpoints)
    with open(next(iter(find_paths(tmp_path / "l", "Ckpt1-Rank0.fti"))), "rb") as fh:
        before = reader.parse_ftiff(fh)
    ctx = ftidask.init(**_kw(tmp_path))
    out = [np.zeros_like(a) for a in data]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    ctx.recover()
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    out[7] = np.concatenate([out[7], out[7]])  # grows: one new container, in a block after the recovered ones
    ctx.protect(7, out[7])
    ctx.checkpoint(2, 1)
    ctx._close()
    with open(next(iter(find_paths(tmp_path / "l", "Ckpt2-Rank0.fti"))), "rb") as fh:
        after = reader.parse_ftiff(fh)
    assert len(after.blocks) == 2
    assert [(m.id, m.fptr, m.containersize) for m in after.blocks[0][1]] == \
        [(m.id, m.fptr, m.containersize) for m in before.blocks[0][1]]
    assert [m.id for m in after.blocks[1][1]] == [7]


def _rank_file(root: Path, ckpt_id: int) -> Path:
    return next(iter(find_paths(root / "l", f"Ckpt{ckpt_id}-Rank0.fti")))


@pytest.mark.parametrize("inline", [True, False])
def test_small_containers_hashed_from_one_read_each_still_answer_for_themselves(tmp_path, monkeypatch, inline):
    """Small containers close together are read at once and each hashed from that read: one whose variable shrank
    (unused container space read along), one damaged (named), a file cut inside the run (the one cut named)."""
    if not inline:  # on the verifying threads, a run of containers per task
        monkeypatch.setattr(verify, "INLINE_BYTES", 0)
        monkeypatch.setattr(verify, "BATCH_BYTES", 20_000)
    data = [np.random.default_rng(i).random(40) for i in range(600)]
    ctx = ftidask.init(**_kw(tmp_path))
    for i, a in enumerate(data):
        ctx.protect(i, a)
    ctx.checkpoint(1, 1)
    for i in range(0, 600, 7):  # shrink: their containers keep their size, partly filled
        data[i] = data[i][:13].copy()
        ctx.protect(i, data[i])
    ctx.checkpoint(2, 1)
    ctx._close()
    path = _rank_file(tmp_path, 2)
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
        reader.verify_data(fh, parsed)
    metas = {m.id: m for _b, _c, m in parsed.containers()}
    with open(path, "r+b") as fh:  # one byte of variable 300, in the middle of a run
        fh.seek(metas[300].fptr + 17)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 1]))
    with open(path, "rb") as fh, pytest.raises(FormatError, match=r"var id 300, containerid 0\): data hash does not "
                                                                    r"match"):
        reader.verify_data(fh, reader.parse_ftiff(fh, str(path)))
    jobs = [(b, c, m) for b, c, m in parsed.containers() if m.hascontent]
    with open(path, "r+b") as fh:
        fh.truncate(metas[450].fptr + 100)  # the file now ends inside variable 450's bytes
    with open(path, "rb") as fh:
        problem = verify.first_problem(fh.fileno(), parsed, jobs, True)
    assert "var id 300," in problem or "var id 450," in problem
    with open(path, "rb") as fh:
        later = [(b, c, m) for b, c, m in jobs if m.id > 300]
        assert re.search(r"var id 450, containerid 0\): the file ends inside its data",
                         verify.first_problem(fh.fileno(), parsed, later, True))
    out = [np.zeros_like(a) for a in data]
    ctx = ftidask.init(**_kw(tmp_path))
    for i, a in enumerate(out):
        ctx.protect(i, a)
    with pytest.raises(ftidask.NoCheckpointError):
        ctx.recover()
    assert all((a == 0).all() for a in out)  # nothing touched
    ctx._close()


def test_shrunk_small_variables_verify_and_come_back(tmp_path):
    data = [np.random.default_rng(i).random(40) for i in range(600)]
    ctx = ftidask.init(**_kw(tmp_path))
    for i, a in enumerate(data):
        ctx.protect(i, a)
    ctx.checkpoint(1, 1)
    for i in range(0, 600, 3):
        data[i] = data[i][:5].copy()
        ctx.protect(i, data[i])
    ctx.checkpoint(2, 1)
    out = [np.zeros_like(a) for a in data]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    ctx.recover()
    assert ctx.recovered_from == (2, 1)
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    ctx._close()
