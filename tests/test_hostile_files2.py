"""Hostile checkpoint trees, second campaign: files replaced by what is not a regular file (a FIFO, a link
to a device), and fields that lie. Recovery gives the newest sound checkpoint, bit for bit, or a ftidask
error that touches no array; the command line gives a message and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.storage.files import find_paths

# A restart in a child process with little address space: a hang is a timeout of the child, an unbounded
# read (a link to /dev/zero) a MemoryError there, not a machine out of memory.
RESTART = """
import resource, sys
import numpy as np
import ftidask
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
root = sys.argv[1]
ctx = ftidask.init(ckpt_dir=root + "/Local", glbl_dir=root + "/Global", meta_dir=root + "/Meta")
a = np.full(1000, -1.0)
ctx.protect(1, a)
try:
    ctx.recover()
except ftidask.FTIError as exc:
    print("REFUSED", (a == -1).all(), type(exc).__name__, exc)
else:
    print("RECOVERED", ctx.recovered_from, a.tobytes() == (np.arange(1000.0) + ctx.recovered_from[0] - 1).tobytes())
"""


def two_checkpoints(root: Path) -> None:
    """Checkpoint 1 at level 4 (values 0..999), then checkpoint 2 at level 1 (values + 1); not finalized."""
    ctx = ftidask.init(ckpt_dir=str(root / "Local"), glbl_dir=str(root / "Global"), meta_dir=str(root / "Meta"))
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 1)
    ctx._close()


def restart(root: Path) -> str:
    """The child's one line: ``RECOVERED (id, level) exact`` or ``REFUSED untouched Error message``."""
    proc = run_python(RESTART, str(root), timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def replace(path: Path, how: str) -> None:
    """Put a FIFO (no writer ever comes), a link to an endless device, or a directory where ``path`` was."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


@pytest.mark.parametrize("how", ["fifo", "devzero", "dir"])
@pytest.mark.parametrize("which, recovered", [("record", "(1, 4)"), ("run.json", "(2, 1)"),
                                              ("current_exec_id", "(2, 1)")])
def test_a_json_file_that_is_not_a_regular_file_is_damage(tmp_path, which, recovered, how):
    """A commit record, ``run.json`` or ``current_exec_id`` that is a FIFO blocked the restart for ever in
    ``open``; a link to /dev/zero was read to the end of memory. They are damaged records now."""
    two_checkpoints(tmp_path)
    (run,) = (tmp_path / "Meta").glob("*/run.json")
    path = {"record": run.parent / "commits" / "s00000002.json", "run.json": run,
            "current_exec_id": tmp_path / "Meta" / "current_exec_id"}[which]
    replace(path, how)
    assert restart(tmp_path) == f"RECOVERED {recovered} True"


@pytest.mark.parametrize("how", ["fifo", "devzero", "dir"])
@pytest.mark.parametrize("which, recovered", [("Local", "(1, 4)"), ("Global", "(2, 1)")])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_damage(tmp_path, which, recovered, how):
    """A rank file replaced by a FIFO blocked ``open`` for ever; the recovery takes the other checkpoint."""
    two_checkpoints(tmp_path)
    (path,) = (tmp_path / which).glob("**/Ckpt*-Rank0.fti")
    replace(path, how)
    assert restart(tmp_path) == f"RECOVERED {recovered} True"


CLI = """
import resource, sys
from ftidask.tools.cli import main
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("how", ["fifo", "devzero"])
@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_cli_on_a_file_that_is_not_a_regular_file(tmp_path, command, how):
    """``inspect``/``verify``/``export`` of a FIFO named like a checkpoint blocked for ever."""
    path = tmp_path / "Ckpt1-Rank0.fti"
    path.touch()
    replace(path, how)
    args = [command, str(path)] + (["--to-zarr", str(tmp_path / "out.zarr")] if command == "export" else [])
    proc = run_python(CLI, *args, timeout=60, check=False)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ftidask: error" in proc.stderr or "DAMAGED" in proc.stdout


def test_a_forged_file_size_in_a_commit_record_drives_no_rebuild(tmp_path):
    """The sizes of a commit record (sealed, so its digest matches) drive the L2/L3 rebuilds: a size the file
    does not have made a sound rank file "verify" and be sent to its partner as that many bytes (64 MiB of
    zeros here; 2**62 would fill the disk). A file whose size differs from its record is now damage: the
    checkpoint is passed over and nothing is rebuilt from it."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.engine.runstate import seal_json
    from ftidask.model.config import load_config

    cfg = load_config(None, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                      meta_dir=str(tmp_path / "Meta"), local_test=1, node_size=1, group_size=4, block_size=1,
                      transfer_size=1)

    def write(t):
        ctx = Context(cfg, t)
        a = np.arange(1000.0) + t.rank
        ctx.protect(1, a)
        ctx.checkpoint(1, 4)
        a += 1
        ctx.checkpoint(2, 2)
        ctx._close()

    assert run_ranks(cfg, 4, write, wait=60)[1] == []
    (record,) = (tmp_path / "Meta").glob("*/commits/s00000002.json")
    raw = json.loads(record.read_text())
    raw["files"][0]["size"] += 64 << 20
    record.write_text(json.dumps(seal_json(raw)))
    (pcof,) = (tmp_path / "Local").glob("node1/**/Ckpt2-Pcof1.fti")  # rank 1 keeps rank 0's copy
    pcof.unlink()

    def recover(t):
        ctx = Context(cfg, t)
        a = np.full(1000, -1.0)
        ctx.protect(1, a)
        ctx.recover()
        exact = a.tobytes() == (np.arange(1000.0) + t.rank + ctx.recovered_from[0] - 1).tobytes()
        ctx._close()
        return ctx.recovered_from, exact

    results, errors = run_ranks(cfg, 4, recover, wait=60)
    assert errors == [] and all(r == ((1, 4), True) for r in results), (results, errors)
    assert max(p.stat().st_size for p in find_paths(tmp_path, "*") if p.is_file()) < 1 << 20


def test_a_commit_record_nested_hundreds_deep_is_damage(tmp_path):
    """A sealed commit record whose ``extra`` (or a file's hash) nests lists 500 deep: JSON parses it, but
    ``dataclasses.asdict`` (the record sent to the ranks) recursed past Python's limit, so the whole recovery failed
    with a logged RecursionError traceback although checkpoint 1 is sound. Such a record is now damage at its
    read: the restart recovers checkpoint 1 bit for bit, quietly, and ``ftidask list`` shows no traceback."""
    from ftidask.engine.runstate import seal_json

    two_checkpoints(tmp_path)
    (record,) = (tmp_path / "Meta").glob("*/commits/s00000002.json")
    raw = json.loads(record.read_text())
    deep = json.loads("[" * 500 + "]" * 500)
    raw["extra"]["forged"], raw["files"][0]["fb_hash"] = deep, deep
    record.write_text(json.dumps(seal_json(raw)))
    proc = run_python(RESTART, str(tmp_path), timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "RECOVERED (1, 4) True", proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr, proc.stderr[-2000:]
    listed = run_python("import sys; from ftidask.tools.cli import main; sys.exit(main(['list', sys.argv[1]]))",
                        str(tmp_path), timeout=60, check=False)
    assert listed.returncode in (0, 1) and "Traceback" not in listed.stderr, listed.stderr[-2000:]


def test_json_nesting_is_walked_without_recursion():
    """The depth check itself: a list nested 100 000 deep (no JSON parser makes one) is measured, not recursed."""
    from ftidask.storage.files import MAX_NESTING, nested_within

    value: list = []
    for _ in range(100_000):
        value = [value]
    assert not nested_within(value, MAX_NESTING)
    assert nested_within({"a": [[{"b": 1}]], "c": []}, 4) and not nested_within({"a": [[{"b": [1]}]]}, 4)


def test_a_partner_rebuild_never_sends_more_than_a_file_holds(tmp_path):
    """The level code on its own (as the Dask backend runs it, whose file check compares hashes only): a
    member's file sound by its hashes but shorter than the size the record gives was sent to its partner as
    that many bytes, zeros past its end. A file of another size than the record's is no source."""
    import hashlib

    from ftidask.levels import multilevel
    from ftidask.model.config import Config
    from ftidask.storage import files as storage
    from ftidask.transport.threads import run_group

    cfg = Config(block_size=1, transfer_size=1)
    sizes = [3000, 4000, 5000, 6000]
    own = [tmp_path / f"node{i}" / storage.rank_file(1, i) for i in range(4)]
    for i, path in enumerate(own):
        path.parent.mkdir()
        path.write_bytes(bytes([i + 1]) * sizes[i])
    digests = [hashlib.sha256(p.read_bytes()).digest() for p in own]

    def protect(ch):
        return multilevel.protect(ch, cfg, 2, 1, ch.index, own[ch.index], own[ch.index].parent, sizes)

    assert run_group(4, protect)[1] == []
    (own[1].parent / storage.partner_file(1, 1)).unlink()  # member 1 kept member 0's copy
    forged = [sizes[0] + (64 << 20)] + sizes[1:]

    def sound(i):
        return lambda p: p.is_file() and hashlib.sha256(p.read_bytes()).digest() == digests[i]

    def rebuild(ch):
        i = ch.index
        return multilevel.rebuild(ch, cfg, 2, 1, i, own[i], own[i].parent, forged, sound(i)(own[i]),
                                  verify_own=sound(i), verify_partner=sound((i - 1) % 4))

    results, errors = run_group(4, rebuild)
    assert errors == [] and results == [False, True, True, True]
    assert max(p.stat().st_size for p in find_paths(tmp_path, "*") if p.is_file()) == 6000


def test_a_spare_parity_replaced_by_a_link_is_never_written_through(tmp_path):
    """An L3 differential checkpoint patches the spare parity in place: a symbolic link planted there (to a
    copy of it outside the run's directories) had the file it names rewritten. The spare is opened without
    following links: that checkpoint fails (the previous one is kept), the next one is written whole."""
    import hashlib
    import shutil
    import threading

    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    outside = tmp_path / "outside"
    outside.mkdir()
    cfg = load_config(None, ckpt_dir=str(tmp_path / "Local"), glbl_dir=str(tmp_path / "Global"),
                      meta_dir=str(tmp_path / "Meta"), local_test=1, node_size=1, group_size=4, block_size=1,
                      transfer_size=1, enable_dcp=1, dcp_block_size=512)
    barrier = threading.Barrier(4)
    digest = {}

    def step(t):
        ctx = Context(cfg, t)
        a = np.arange(20000.0) + t.rank
        ctx.protect(1, a)
        ctx.checkpoint(1, 7)
        a[:10] += 1
        ctx.checkpoint(2, 7)
        barrier.wait()
        if t.rank == 0:
            (spare,) = (tmp_path / "Local").glob("node0/**/dcp/SpareRSed-Rank0.fti")
            copy = outside / spare.name
            shutil.copy(spare, copy)
            spare.unlink()
            spare.symlink_to(copy)
            digest["before"] = hashlib.sha256(copy.read_bytes()).hexdigest()
        barrier.wait()
        outcomes = []
        for ckpt_id in (3, 4):
            a[:10] += 1
            try:
                ctx.checkpoint(ckpt_id, 7)
                outcomes.append("ok")
            except ftidask.CheckpointError:
                outcomes.append("refused")
        ctx._close()
        return outcomes

    results, errors = run_ranks(cfg, 4, step, wait=60)
    assert errors == [] and all(r[1] == "ok" for r in results), (results, errors)
    assert hashlib.sha256((outside / "SpareRSed-Rank0.fti").read_bytes()).hexdigest() == digest["before"]


_ARRAY_META = {"zarr_format": 3, "node_type": "array", "shape": [1 << 40], "data_type": "float64",
               "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1 << 40]}},
               "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}, "fill_value": 0.0,
               "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}], "attributes": {}}


@pytest.mark.parametrize("how", ["torn metadata", "huge shape", "fifo chunk"])
def test_import_of_a_hostile_foreign_zarr_store_is_an_error(tmp_path, how):
    """``ftidask import`` of a Zarr store ftidask did not write (nothing in it hash-checked): torn metadata
    showed zarr's JSONDecodeError as a traceback, a shape of 2**40 elements numpy's MemoryError, and a chunk
    that is a FIFO blocked the import for ever."""
    pytest.importorskip("zarr")
    store = tmp_path / "s.zarr"
    (store / "a" / "c").mkdir(parents=True)
    (store / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    meta = dict(_ARRAY_META, shape=[8], chunk_grid={"name": "regular", "configuration": {"chunk_shape": [8]}})
    if how == "torn metadata":
        (store / "a" / "zarr.json").write_text(json.dumps(meta)[:40])
    elif how == "huge shape":
        (store / "a" / "zarr.json").write_text(json.dumps(_ARRAY_META))
    else:
        (store / "a" / "zarr.json").write_text(json.dumps(meta))
        os.mkfifo(store / "a" / "c" / "0")
    args = ["import", str(store), "--config", str(tmp_path / "none.fti")]
    proc = run_python(CLI, *args[:2], timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ftidask: error" in proc.stderr


_TREE: dict[str, Path] = {}


def _sample_tree(tmp_path_factory) -> Path:
    """One tree of three committed checkpoints, every kind of file of a one-process run (level 4, level 1,
    differential with its spare and fallback record, a Python state), built once for the examples below."""
    if "tree" not in _TREE:
        root = tmp_path_factory.mktemp("tree")
        ctx = ftidask.init(ckpt_dir=str(root / "Local"), glbl_dir=str(root / "Global"), meta_dir=str(root / "Meta"),
                           enable_dcp=1, dcp_block_size=512)
        a, state = np.arange(1000.0), ftidask.State({"k": 0})
        ctx.protect(1, a)
        ctx.protect(2, state)
        for k, level in enumerate([4, 1, 5, 5], 1):
            a[:] = np.arange(1000.0) + k
            state["k"] = k
            ctx.checkpoint(k, level)
        ctx._close()
        _TREE["tree"] = root
    return _TREE["tree"]


def _damage(path: Path, how: str, at: int) -> None:
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[:at % max(len(raw), 1)])
    elif how == "flip":
        damaged = bytearray(raw)
        if damaged:
            damaged[at % len(damaged)] ^= 1 << (at % 8)
        path.write_bytes(bytes(damaged))
    elif how == "sparse":  # a size of a terabyte costs nothing on disk: nothing may read it whole
        os.truncate(path, 1 << 40)
    elif how == "json-type" and path.suffix == ".json":
        path.write_text(json.dumps([raw.decode("utf-8", "replace")]))
    else:
        replace(path, {"json-type": "dir", "empty": "dir"}.get(how, how))
        if how == "empty":
            path.rmdir()
            path.touch()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_file_damaged_gives_exact_data_or_a_clear_error(tmp_path_factory, data):
    """Any file of the tree (commit and fallback records, run state, rank files, the spare and its record)
    truncated, flipped, emptied, of the wrong JSON type, made a sparse terabyte, or replaced by a directory or a
    FIFO: the restart
    recovers a committed checkpoint bit for bit, or raises a ftidask error that touches no array."""
    import shutil

    tree = _sample_tree(tmp_path_factory)
    files = sorted(p.relative_to(tree) for p in find_paths(tree, "*") if p.is_file() and p.suffix != ".lock")
    rel = data.draw(st.sampled_from(files))
    how = data.draw(st.sampled_from(["truncate", "flip", "empty", "json-type", "dir", "fifo", "sparse"]))
    root = tmp_path_factory.mktemp("case")
    shutil.copytree(tree, root, dirs_exist_ok=True)
    _damage(root / rel, how, data.draw(st.integers(0, 1 << 20)))
    ctx = ftidask.init(ckpt_dir=str(root / "Local"), glbl_dir=str(root / "Global"), meta_dir=str(root / "Meta"),
                       enable_dcp=1, dcp_block_size=512)
    a, state = np.full(1000, -1.0), ftidask.State({"k": -1})
    ctx.protect(1, a)
    ctx.protect(2, state)
    try:
        ctx.recover()
    except ftidask.FTIError:
        assert (a == -1).all() and state["k"] == -1
    else:
        k = state["k"]
        assert ctx.recovered_from[0] == k and a.tobytes() == (np.arange(1000.0) + k).tobytes()
    finally:
        ctx._close()
