"""Hostile reads, sixth campaign: the fast paths for thousands of small variables (a layout planned again being the
previous one itself, containers copied by memoryview and hashed in one call, metadata packed in place, every VMD
unpacked at once, a cache of checked table dtypes, small containers verified from one read, the variables written
in one local step) against arrays of every kind changing between checkpoints, and against hostile files.

The fuzzer itself is tests/fuzz_small_containers.py (run alone for a campaign of thousands of cases, one line each);
here a seeded slice of it runs, and property tests over sequences of checkpoints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.ftiff.layout import plan_layout

sys.path.insert(0, str(Path(__file__).parent))
import fuzz_small_containers as fuzz  # noqa: E402
from mpi_util import env, mpiexec, need_mpi  # noqa: E402

_KINDS = ["f8", ">f8", "<i2", "u1", "c8", "?", "U3", "S5", "M8[s]", "f2", "rec", "g"]


def _dtype(kind: str) -> np.dtype:
    if kind == "rec":
        return np.dtype([("a", "<i4"), ("b", ">f8", (2,))])
    if kind == "sub":
        return np.dtype(("<f4", (2,)))
    return np.dtype(kind)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """An array of any kind a user protects: 0-d, empty, Fortran-order, big, byte-swapped, record dtypes, and views
    (strided, transposed, of another array)."""
    dtype = _dtype(draw(st.sampled_from(_KINDS)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    seed = draw(st.integers(0, 2 ** 16))
    n = int(np.prod(shape)) * dtype.itemsize
    base = np.frombuffer(np.random.default_rng(seed).bytes(max(n, 1))[:n], np.uint8).copy()
    a = base.view(dtype).reshape(shape) if n else np.zeros(shape, dtype)
    if dtype.kind == "M":  # NaT-free, comparable
        a = np.asarray(a.view("i8") % (10 ** 9)).view(dtype)
    how = draw(st.sampled_from(["c", "f", "t", "s", "v"]))
    if how == "f":
        a = np.asfortranarray(a)
    elif how == "t" and a.ndim >= 2:
        a = a.T  # Fortran-contiguous view of a C array
    elif how == "s" and a.ndim >= 1 and a.shape[0] > 1:
        a = a[::2]  # not contiguous
    elif how == "v" and a.size > 1:
        a = a.reshape(-1)[1:]  # a view into the middle of another array
    return a


def _stream(a: np.ndarray) -> bytes:
    return (a.T if (a.flags.f_contiguous and not a.flags.c_contiguous) else a).tobytes()


def _kw(root: Path, **extra: object) -> dict:
    return dict(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"), verbosity=4, **extra)


def _blank_like(a: np.ndarray) -> np.ndarray:
    b = np.zeros(a.shape, a.dtype, order="F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C")
    return b


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 5), arrays()), max_size=4),
                                st.sampled_from([1, 4, 5, 8, "icp", "async"])), min_size=1, max_size=4))
def test_any_sequence_of_checkpoints_of_changing_arrays_recovers_the_last_bit_for_bit(tmp_path_factory, steps):
    """Variables replaced between checkpoints by arrays of another shape, dtype, size or order (grown after shrunk,
    views of other arrays, 0-d, empty): each checkpoint's plan starts from the last one's layout (reused whole
    when nothing changed), and a restart recovers the last one exactly; a checkpoint after it plans on the recovered
    file's containers and is recovered exactly too."""
    root = tmp_path_factory.mktemp("seq")
    ctx = ftidask.init(**_kw(root, enable_dcp=True))
    current: dict[int, np.ndarray] = {}
    ckpt = 0
    expected: dict[int, bytes] = {}
    for changes, level in steps:
        for vid, a in changes:
            current[vid] = a
            ctx.protect(vid, a)
        if not current:
            continue
        ckpt += 1
        if level == "icp":
            ctx.init_icp(ckpt, 1)
            for vid in current:
                ctx.add_var_icp(vid)
            ctx.finalize_icp()
        elif level == "async":
            ctx.checkpoint(ckpt, 1, wait=False).result()
        else:
            ctx.checkpoint(ckpt, level)
        expected = {vid: _stream(a) for vid, a in current.items()}
        for a in current.values():  # changed after the checkpoint: never in it
            a[...] = np.zeros((), a.dtype)
    ctx._close()
    if not ckpt:
        return
    for round_ in range(2):
        ctx = ftidask.init(**_kw(root, enable_dcp=True))
        out = {vid: _blank_like(a) for vid, a in current.items()}
        for vid, b in out.items():
            ctx.protect(vid, b)
        ctx.recover()
        assert {vid: _stream(b) for vid, b in out.items()} == expected
        if round_:
            ctx._close()
            break
        # grown after the recovery (one variable), then checkpointed on the recovered file's containers
        vid0 = min(out)
        grown = np.concatenate([out[vid0].reshape(-1)] * 2) if out[vid0].ndim else out[vid0]
        out[vid0] = grown
        ctx.protect(vid0, grown)
        ckpt += 1
        ctx.checkpoint(ckpt, 1)
        current, expected = out, {vid: _stream(a) for vid, a in out.items()}
        ctx._close()


def test_a_layout_reused_whole_is_its_plan_for_any_sequence_of_sizes():
    """plan_layout from the previous plan (the same object when the variables are the same) gives what a plan
    from the same containers rebuilt afresh gives, for a seeded sequence of growths, shrinks, removals, re-adds and
    reorders."""
    from ftidask.ftiff.layout import layout_from_slots

    rng = np.random.default_rng(11)
    layout = None
    for step in range(300):
        n = int(rng.integers(1, 40))
        ids = rng.permutation(60)[:n]
        sizes = [(int(v), int(rng.integers(0, 300))) for v in ids]
        for _ in range(int(rng.integers(1, 3))):
            fresh = None if layout is None else layout_from_slots([b.slots for b in layout.blocks])
            planned = plan_layout(layout, sizes)
            assert planned == plan_layout(fresh, sizes), step
            assert planned.fs == fuzz_fs(planned) and planned.ckpt_size == sum(s.chunksize for s in planned.slots())
            for vid, nbytes in sizes:
                assert sum(s.chunksize for s in planned.slots_of(vid)) == nbytes
            layout = planned


def fuzz_fs(layout) -> int:  # the file size summed afresh (what the cached property must equal)
    from ftidask.ftiff.structs import BMD_SIZE, FB_SIZE, VMD_SIZE

    return FB_SIZE + sum(BMD_SIZE + VMD_SIZE * len(b.slots) + sum(s.containersize for s in b.slots)
                         for b in layout.blocks)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return fuzz.make_bases(tmp_path_factory.mktemp("fuzzbase"), 1200)


@pytest.mark.parametrize("first", [0, 1000])
def test_hostile_files_of_many_small_containers_recover_exactly_or_fail_cleanly(bases, tmp_path, first):
    """A seeded slice of the fuzzer (tests/fuzz_small_containers.py): every mutated file of thousands of small
    containers is recovered exactly, or refused with an ftidask error that leaves the arrays as they were."""
    for p, held in bases:
        assert fuzz.run_case(p, held) == ("ok", fuzz._digest_arrays(fuzz.expected_bytes(held)))
    outcomes: dict[str, int] = {}
    for seed in range(first, first + 150):
        outcome, detail, kinds = fuzz.case(bases, seed, tmp_path)
        assert outcome != "BUG", (seed, detail, kinds)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("error", 0) > 50


MPI_CODE = r"""
import sys
import numpy as np
from mpi4py import MPI
import ftidask
from ftidask.engine import pending as pending_module, writing as writing_module
from ftidask.model.errors import CheckpointError

base, level = sys.argv[1], int(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.rank
kw = dict(comm=comm, local_test=1, enable_dcp=1, group_size=3, ckpt_dir=base + "/L", glbl_dir=base + "/G",
          meta_dir=base + "/M", verbosity=4)
data = [np.full(8 + i % 5, float(i + 1000 * rank)) for i in range(1500)]
ctx = ftidask.init(**kw)
for i, a in enumerate(data):
    ctx.protect(i, a)
ctx.checkpoint(1, level)
for a in data:
    a += 0.5
real_p, real_w = pending_module.ArrayBytes, writing_module.ArrayBytes

def failing(real):
    def make(array, *args):
        if rank == 1 and array is data[900]:
            raise MemoryError("injected")
        return real(array, *args)
    return make

pending_module.ArrayBytes, writing_module.ArrayBytes = failing(real_p), failing(real_w)
try:
    ctx.checkpoint(2, level)
except CheckpointError as exc:
    said = "FAILED " + str(exc)
else:
    said = "COMMITTED"
pending_module.ArrayBytes, writing_module.ArrayBytes = real_p, real_w
ctx._close()
ctx = ftidask.init(**kw)
out = [np.zeros_like(a) for a in data]
for i, a in enumerate(out):
    ctx.protect(i, a)
ctx.recover()
ok = all((a == float(i + 1000 * rank)).all() for i, a in enumerate(out))
for a in out:  # the next checkpoint, on the recovered file's containers, commits and recovers
    a += 2
ctx.checkpoint(3, level)
ctx._close()
ctx = ftidask.init(**kw)
again = [np.zeros_like(a) for a in data]
for i, a in enumerate(again):
    ctx.protect(i, a)
ctx.recover()
ok = ok and all((a == float(i + 1000 * rank) + 2).all() for i, a in enumerate(again))
with open(f"{base}/out{rank}.txt", "w") as fh:  # a file each: the ranks' output would interleave
    fh.write(f"{said}\nRECOVERED {ctx.recovered_from} {ok}\n")
ctx.finalize()
"""


@need_mpi()[0]
@need_mpi()[1]
@pytest.mark.parametrize("level", [1, 2, 3, 5])
def test_one_ranks_variable_failing_midway_fails_the_checkpoint_on_every_rank(tmp_path, level):
    """Three MPI ranks of 1,500 small arrays; one variable of rank 1 fails while the variables are written in their
    one local step: every rank reports the same failed checkpoint, each recovers the previous one exactly, and
    the next checkpoint (planned on the recovered files) commits and recovers."""
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-c", MPI_CODE, str(tmp_path), str(level)], env=env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [(tmp_path / f"out{rank}.txt").read_text().splitlines() for rank in range(3)]
    assert len({lines[0] for lines in said}) == 1, said  # the same failure on every rank
    assert said[0][0].startswith(f"FAILED checkpoint 2 at level {level} failed; the previous checkpoint is kept: "
                                 "rank 1: MemoryError: injected"), said
    assert all(re.fullmatch(r"RECOVERED \(3, \d\) True", lines[1]) for lines in said), said


@pytest.mark.parametrize("inline", [True, False])
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 64, 1000, 65535, 65536, 65537, 300_000]), min_size=2, max_size=60),
       damaged=st.lists(st.integers(0, 59), max_size=3), hash_id=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_small_containers_read_at_once_name_the_first_damaged_one(tmp_path_factory, monkeypatch, inline, sizes,
                                                                  damaged, hash_id, seed):
    """Containers of sizes about the small and the run limits (64 KiB, 1 MiB), some shrunk so that unused container
    space lies inside a run, some damaged: the verification names the first damaged one in file order, as a check
    of each container on its own does, inline and on the verifying threads."""
    from ftidask.ftiff import reader, verify
    from ftidask.ftiff.writer import write_ftiff
    from ftidask.model.arrays import ArrayBytes
    from ftidask.model.errors import FormatError

    if not inline:
        monkeypatch.setattr(verify, "INLINE_BYTES", 0)
        monkeypatch.setattr(verify, "BATCH_BYTES", 200_000)
    rng = np.random.default_rng(seed)
    layout = plan_layout(None, [(v, n) for v, n in enumerate(sizes)])
    now = {v: n // 2 if v % 3 == 1 else n for v, n in enumerate(sizes)}  # shrunk: unused space in their containers
    layout = plan_layout(layout, list(now.items()))
    arrays = {v: np.frombuffer(rng.bytes(n), np.uint8).copy() for v, n in now.items()}
    path = tmp_path_factory.mktemp("runs") / "f.fti"
    with open(path, "w+b") as fh:
        write_ftiff(fh, layout, {v: ArrayBytes(a) for v, a in arrays.items()}, hash_id=hash_id,
                    trailer={"vars": []}, timestamp=1)
    slots = [(bi, ci, s) for bi, b in enumerate(layout.blocks) for ci, s in enumerate(b.slots)]
    hit = sorted({i % len(slots) for i in damaged if slots[i % len(slots)][2].chunksize})
    raw = bytearray(path.read_bytes())
    for i in hit:
        s = slots[i][2]
        raw[s.fptr + int(rng.integers(s.chunksize))] ^= 0x40
    for s in layout.slots():  # unused container space changed: no container's bytes, never a problem
        if s.containersize > s.chunksize:
            raw[s.fptr + s.chunksize] ^= 0xFF
    path.write_bytes(bytes(raw))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, str(path))
        if not hit:
            reader.verify_data(fh, parsed)
            return
        bi, ci, s = slots[hit[0]]
        with pytest.raises(FormatError, match=rf"block {bi}, container {ci} \(var id {s.var_id}, containerid "
                                              rf"{s.containerid}\): data hash does not match"):
            reader.verify_data(fh, parsed)


def test_a_structured_dtype_of_one_table_is_never_shared_with_the_next():
    """The checked table dtypes are cached by their string: a structured dtype written as a string ('i4,f8', which
    only a forged or foreign table holds) was one object for every file after, and NumPy lets its field names be
    changed in place (``array.dtype.names = ...``, on an array recovered from one file), so the next file's table
    said other names. A dtype with fields is made afresh for each table; plain ones stay cached (immutable)."""
    from ftidask.model.arrays import VarInfo

    entry = {"id": 1, "name": "a", "dtype": "i4,f8", "shape": [2], "order": "C", "nbytes": 24}
    first = VarInfo.from_json(entry)
    first.dtype.names = ("x", "y")  # what a user may do to an array recovered with this dtype
    assert VarInfo.from_json(entry).dtype.names == ("f0", "f1")
    plain = {**entry, "dtype": "<f8", "nbytes": 16}
    assert VarInfo.from_json(plain).dtype is VarInfo.from_json(plain).dtype
