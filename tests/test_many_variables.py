"""Thousands of protected variables: every byte back, and the readers' batching of small containers.

A state of many small arrays (a model's parameters, a notebook's variables) is planned, verified and copied a run
of containers at a time: one task and one ``preadv`` per run, not per container. These tests check that the runs
lose no byte and still name the container that is damaged or cut.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.ftiff import reader, verify
from ftidask.ftiff.layout import plan_layout
from ftidask.model.arrays import ArrayBytes
from ftidask.storage.files import find_paths

N = 3000
DTYPES = [np.float64, np.int8, np.complex64, np.uint16, np.dtype([("a", "<i2"), ("b", "<f4", (2,))])]


def _state(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(N):
        dtype = np.dtype(DTYPES[i % len(DTYPES)])
        n = int(rng.integers(0, 40))
        raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
        a = raw.view(dtype) if n else np.zeros(0, dtype)
        out.append(np.asfortranarray(a.reshape(1, -1).repeat(2, 0)) if i % 7 == 0 else a.copy())
    return out


def _rank_file(dirs: dict, ckpt_id: int) -> Path:
    return next(iter(find_paths(Path(dirs["ckpt_dir"]), f"Ckpt{ckpt_id}-Rank0.fti")))


def test_thousands_of_variables_round_trip_bit_for_bit(dirs):
    data = _state(1)
    with ftidask.init(**dirs) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        ctx.checkpoint(1, 1)
        grown = {i: np.concatenate([data[i], data[i]]) for i in range(0, N, 11) if data[i].ndim == 1}
        for i, a in grown.items():  # some grow: their new bytes in a block appended for this checkpoint
            ctx.protect(i, a)
        data = [grown.get(i, a) for i, a in enumerate(data)]
        ctx.checkpoint(2, 1)
        with open(_rank_file(dirs, 2), "rb") as fh:
            assert len(reader.parse_ftiff(fh).blocks) == 2
        in_use = [np.full_like(a, 7) if a.nbytes else np.empty_like(a) for a in data]
        for i, a in enumerate(in_use):
            ctx.protect(i, a)
        ctx.recover()
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype for a, b in zip(in_use, data))


def test_a_layout_of_many_variables_is_planned_once_per_variable():
    """The containers of each variable come from one index of the previous layout (its scan per variable made
    planning quadratic); grown variables get their one new container, shrunk ones keep theirs."""
    first = plan_layout(None, [(i, 8 * (i % 5)) for i in range(2000)])
    second = plan_layout(first, [(i, 8 * (i % 5) + (16 if i % 3 == 0 else 0)) for i in range(2000)])
    assert len(second.blocks) == 2
    for i in range(2000):
        held = second.slots_of(i)
        assert [s.containerid for s in held] == list(range(len(held)))
        assert second.capacity(i) == 8 * (i % 5) + (16 if i % 3 == 0 else 0)
        assert sum(s.chunksize for s in held) == second.capacity(i)


def _checkpointed(dirs: dict, data: list[np.ndarray]) -> Path:
    with ftidask.init(**dirs) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        ctx.checkpoint(1, 1)
        ctx._close()
    return _rank_file(dirs, 1)


def _damage(path: Path, vid: int) -> str:
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
    meta = next(m for _b, _c, m in parsed.containers() if m.id == vid)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x40]))
    return f"var id {vid},"


@pytest.mark.parametrize("vid", [0, 1234, 2999])
def test_the_damaged_one_of_thousands_of_small_containers_is_named(dirs, monkeypatch, vid):
    monkeypatch.setattr(verify, "INLINE_BYTES", 0)  # on the verifying threads, a run of containers per task
    monkeypatch.setattr(verify, "BATCH_BYTES", 5000)
    data = [np.random.default_rng(i).random(64) for i in range(N)]
    path = _checkpointed(dirs, data)
    where = _damage(path, vid)
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="hash does not match") as err:
        reader.verify_data(fh, reader.parse_ftiff(fh, str(path)))
    assert where in str(err.value)
    ctx = ftidask.init(**dirs)
    out = [np.full(64, 3.0) for _ in range(N)]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    with pytest.raises(ftidask.NoCheckpointError, match="damaged|hash"):
        ctx.recover()
    assert all((a == 3.0).all() for a in out)  # nothing touched


@pytest.mark.parametrize("iov", [1, 3, 1024])
def test_the_grouped_copy_fills_every_byte_and_sees_a_cut_file(dirs, monkeypatch, iov):
    """Containers that follow each other in the file are read with one preadv (at most ``iov`` buffers), runs of
    them spread over threads; a file cut after its verification is a FormatError naming a container, never
    arrays silently short."""
    monkeypatch.setattr(reader, "_IOV_MAX", iov)
    monkeypatch.setattr(reader, "_COPY_PIECE", 4096)
    monkeypatch.setattr(reader, "_COPY_THREADS", 3)
    data = [np.random.default_rng(i).integers(0, 2**63, 17 + i % 50, dtype=np.int64) for i in range(400)]
    path = _checkpointed(dirs, data)
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
        reader.verify_data(fh, parsed)
        out = [np.zeros_like(a) for a in data]
        reader.read_into(fh, parsed, {i: ArrayBytes(a) for i, a in enumerate(out)})
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    last = max((m for _b, _c, m in parsed.containers()), key=lambda m: m.fptr)
    with open(path, "r+b") as fh:  # cut inside the data: the reads of the last containers come back short
        fh.truncate(last.fptr - 1000)
    out = [np.zeros_like(a) for a in data]
    with open(path, "rb") as fh, pytest.raises(ftidask.FormatError, match="changed|modified|ends inside"):
        reader.read_into(fh, parsed, {i: ArrayBytes(a) for i, a in enumerate(out)})
    with open(path, "rb") as fh:  # the copy alone (the file's identity check passed over): the short piece named
        with pytest.raises(ftidask.FormatError, match=r"var id \d+\).*ends inside"):
            reader.copy_direct(fh, parsed, [(m.fptr, memoryview(out[m.id].view(np.uint8)), (b, c, m.id))
                                             for b, c, m in parsed.containers()])


def test_protect_under_a_name_still_refuses_another_variables_name(dirs):
    with ftidask.init(**dirs) as ctx:
        for i in range(50):
            ctx.protect(i, np.zeros(2))
        ctx.protect(50, np.zeros(2), name="u")
        with pytest.raises(ftidask.ProtectError, match="variable 50's"):
            ctx.protect(51, np.zeros(2), name="u")
        with pytest.raises(ftidask.ProtectError, match="variable 7's"):
            ctx.protect(51, np.zeros(2), name="var7")  # the default name of variable 7
        ctx.protect(50, np.ones(2), name="u")  # its own name again
        ctx.protect(52, np.ones(2))


def test_an_incremental_checkpoint_of_thousands_of_variables(dirs):
    """Each variable added to an incremental checkpoint is written at once, its containers found from the layout's
    index (each add scanned every container of the file before)."""
    data = _state(2)
    with ftidask.init(**dirs) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        ctx.init_icp(1, 1)
        for i in reversed(range(N)):  # any order
            ctx.add_var_icp(i)
        ctx.finalize_icp()
        out = [np.full_like(a, 9) if a.nbytes else np.empty_like(a) for a in data]
        for i, a in enumerate(out):
            ctx.protect(i, a)
        ctx.recover()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(out, data))
