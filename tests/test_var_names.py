"""Variables found by name: ``ctx.var_id`` (FTI_setIDFromString, FTI_getIDFromString).

FTI's recoverName suite: each rank gives ids to ten names in a random order of its own, protects and
checkpoints; the restart asks for the names in another random order, protects what it is given and
recovers each variable alone: every array must come back with its own values.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.ftiff.reader import parse_ftiff
from ftidask.model.config import load_config
from ftidask.storage.files import find_paths

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZES = [42, 85, 8, 19, 95, 26, 66, 33, 65, 83]


def _write(ctx, order: list[int]) -> dict[str, int]:
    ids = {}
    for i in order:
        ids[NAMES[i]] = ctx.var_id(NAMES[i])
        ctx.protect(ids[NAMES[i]], np.full(SIZES[i], i, np.int32))
    ctx.checkpoint(1, 1)
    return ids


def _recover(ctx, order: list[int]) -> tuple[dict[str, int], list[np.ndarray]]:
    ids, arrays = {}, [np.zeros(s, np.int32) for s in SIZES]
    for i in order:
        ids[NAMES[i]] = ctx.var_id(NAMES[i], create=False)
        ctx.protect(ids[NAMES[i]], arrays[i])
        ctx.recover_var(ids[NAMES[i]])
    return ids, arrays


def test_ids_given_by_name_are_found_again_in_another_order(dirs):
    ctx = ftidask.init(**dirs)
    given = _write(ctx, random.Random(1).sample(range(10), 10))
    assert sorted(given.values()) == list(range(10))  # one after another, in the order asked
    ctx._close()  # the job ends without finalize: the checkpoint stays
    restart = ftidask.init(**dirs)
    assert restart.status() == 1
    found, arrays = _recover(restart, random.Random(2).sample(range(10), 10))
    assert found == given
    assert all((a == i).all() for i, a in enumerate(arrays))
    assert restart.var_id("ten", create=False) is None
    assert restart.var_id("ten") == 10 and restart.var_id("ten", create=False) == 10


def test_the_name_is_recorded_in_the_file(dirs):
    ctx = ftidask.init(**dirs)
    ctx.protect(ctx.var_id("pressure"), np.arange(5.0))
    ctx.protect(ctx.var_id("velocity"), np.arange(3.0), name="v")  # a name given to protect wins
    assert ctx.var_id("pressure") == 0 and ctx.var_id("v", create=False) == 1
    ctx.checkpoint(1, 1)
    (path,) = find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti")
    with open(path, "rb") as fh:
        assert {i: v.name for i, v in parse_ftiff(fh, str(path)).vars.items()} == {0: "pressure", 1: "v"}
    ctx.finalize()


def test_a_fresh_start_after_ids_given_by_number(dirs):
    ctx = ftidask.init(**dirs)
    ctx.protect(7, np.zeros(2), name="seven")
    assert ctx.var_id("seven") == 7 and ctx.var_id("eight") == 8 and ctx.var_id("eight") == 8
    assert ctx.var_id("nine", create=False) is None
    ctx.finalize()


@pytest.mark.parametrize("name", ["", 3, None, b"x"])
def test_a_name_that_is_not_a_str_is_refused(dirs, name):
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ProtectError, match="non-empty str"):
        ctx.var_id(name)
    ctx.finalize()


def test_a_restart_with_no_checkpoint_that_verifies_finds_no_name(dirs):
    ctx = ftidask.init(**dirs)
    _write(ctx, list(range(10)))
    ctx._close()
    for path in find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti"):
        path.unlink()
    restart = ftidask.init(**dirs)
    assert restart.status() == 1 and restart.var_id("three", create=False) is None
    restart.protect(0, np.zeros(SIZES[0], np.int32))
    with pytest.raises(ftidask.NoCheckpointError):
        restart.recover()


def test_ranks_each_with_their_own_order(tmp_path):
    """Four ranks (threads), each giving ids in a random order of its own, as FTI's test does."""
    cfg = load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                      meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, group_size=4)

    def first(t):
        ctx = Context(cfg, t)
        ids = _write(ctx, random.Random(10 + t.rank).sample(range(10), 10))
        ctx._close()
        return ids

    def again(t):
        ctx = Context(cfg, t)
        ids, arrays = _recover(ctx, random.Random(20 + t.rank).sample(range(10), 10))
        ctx.finalize()
        return ids, [bool((a == i).all()) for i, a in enumerate(arrays)]

    given, errors = run_ranks(cfg, 4, first, wait=60)
    assert errors == [] and given[0] != given[1]  # each rank its own ids
    found, errors = run_ranks(cfg, 4, again, wait=60)
    assert errors == []
    assert [ids for ids, _ in found] == given and all(all(ok) for _, ok in found)


@pytest.mark.dask
@pytest.mark.timeout(240)
def test_dask_ids_given_by_name_are_found_again(dask_client, dirs):
    da = pytest.importorskip("dask.array")
    ctx = ftidask.init(client=dask_client, **dirs)
    given = {}
    for i in random.Random(3).sample(range(4), 4):
        given[NAMES[i]] = ctx.var_id(NAMES[i])
        ctx.protect(given[NAMES[i]], da.full((SIZES[i],), i, chunks=10, dtype=np.int32))
    ctx.checkpoint(1, 1)
    ctx._close()
    restart = ftidask.init(client=dask_client, **dirs)
    assert restart.status() == 1
    found = {NAMES[i]: restart.var_id(NAMES[i], create=False) for i in random.Random(4).sample(range(4), 4)}
    assert found == given and restart.var_id("ten", create=False) is None
    out = restart.recover()
    assert all((out[given[NAMES[i]]].compute() == i).all() for i in range(4))
    restart.finalize()


@pytest.mark.mpi
@pytest.mark.parametrize("level", [1, 3])
def test_mpi_each_rank_its_own_order(tmp_path, level):
    """Over mpiexec (4 ranks, 4 simulated nodes): the restart finds each rank's ids, recover_var by recover_var."""
    import json

    from mpi_util import mpiexec, run

    if mpiexec() is None:
        pytest.skip("needs mpiexec")
    pytest.importorskip("mpi4py")
    # The ranks die (os._exit, no finalize) once every rank's ids are written: mpiexec may report a rank
    # killed when another one's end came first.
    run(4, "names_job.py", "write", str(tmp_path), str(level), check=False)
    given = [json.loads((tmp_path / f"ids-{r}.json").read_text()) for r in range(4)]
    assert given[0] != given[1]
    run(4, "names_job.py", "recover", str(tmp_path), str(level))
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    assert [r["ids"] for r in results] == given
    assert all(r["status"] == 1 and all(r["exact"]) for r in results)


def test_a_context_dropped_after_var_id_holds_no_lock(dirs):
    """A context keeps no reference to itself through its names (a cycle kept a dropped context, and its run
    lock, alive until the garbage collector ran: a program restarted meanwhile started a run of its own)."""
    import gc
    import json

    from conftest import run_python

    child = ("import json, sys, ftidask; ctx = ftidask.init(**json.loads(sys.argv[1])); "
             "print(ctx.exec_id, ctx.status()); ctx.finalize()")
    gc.disable()
    try:
        ctx = ftidask.init(**dirs)
        ctx.protect(ctx.var_id("u"), np.arange(3.0))
        ctx.checkpoint(1, 1)
        exec_id = ctx.exec_id
        del ctx  # as a notebook cell that drops it: the run is no longer written by this process
        assert run_python(child, json.dumps(dirs)).stdout.split() == [exec_id, "1"]
    finally:
        gc.enable()


def test_a_resharded_restart_finds_the_names_of_the_old_files(tmp_path):
    """Written by 2 ranks, recovered on 1 (declared blocks): the names are in the old files' tables. They were
    not read there (no file of this layout verifies): var_id gave new ids in the order asked, and the
    redistribution filled each array with another variable's data, silently."""
    def cfg(n):
        return load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                           meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, group_size=n)

    def first(t):
        ctx = Context(cfg(2), t)
        ids = {name: ctx.var_id(name) for name in ("a", "b")}
        for k, name in enumerate(("a", "b")):
            ctx.protect(ids[name], np.arange(4.0) + 4 * t.rank + 100 * k, global_shape=(8,), offset=(4 * t.rank,))
        ctx.checkpoint(1, 4)
        ctx._close()
        return ids

    def again(t):
        ctx = Context(cfg(1), t)
        ids = {name: ctx.var_id(name, create=False) for name in ("b", "a")}
        out = {}
        for name in ("b", "a"):
            out[name] = np.zeros(8)
            ctx.protect(ids[name], out[name], global_shape=(8,), offset=(0,))
        ctx.recover()
        ctx.finalize()
        return ids, out

    given, errors = run_ranks(cfg(2), 2, first, wait=60)
    assert errors == [] and given[0] == {"a": 0, "b": 1}
    found, errors = run_ranks(cfg(1), 1, again, wait=60)
    assert errors == []
    ids, out = found[0]
    assert ids == given[0]
    assert (out["a"] == np.arange(8.0)).all() and (out["b"] == np.arange(8.0) + 100).all()


def test_the_first_var_id_of_a_restart_waits_for_the_checkpoints_in_flight(dirs, monkeypatch):
    """Its read of the checkpoint's names is a recovery's search (every file verified, L2/L3 rebuilt): it ran while
    a background checkpoint committed and retired files under it, which every other recovery call waits for."""
    import threading

    from ftidask.engine.asyncckpt import AsyncCheckpoints
    from ftidask.engine.commit import Committer
    from ftidask.engine.recovering import Recovery

    ctx = ftidask.init(**dirs)
    ctx.protect(ctx.var_id("u"), np.arange(4096.0))
    ctx.checkpoint(1, 1)
    ctx._close()
    restart = ftidask.init(**dirs)
    assert restart.status() == 1
    restart.protect(0, np.zeros(4096), name="u")
    restart.recover()
    held, committed, seen = threading.Event(), threading.Event(), []
    real_checkpoint, real_find = Committer.checkpoint, Recovery.find

    def checkpoint(self, *args, **kwargs):  # the background's commit waits for the search or a wait (30 s at most)
        held.wait(30)
        try:
            return real_checkpoint(self, *args, **kwargs)
        finally:
            committed.set()

    def find(self, *args, **kwargs):
        seen.append(committed.is_set())
        held.set()
        return real_find(self, *args, **kwargs)

    def quiesce(self):  # waiting for it lets it go on, too (the wait of a recovery's search: drain, then the heads)
        held.set()
        return real_quiesce(self)

    real_quiesce = AsyncCheckpoints.quiesce
    monkeypatch.setattr(Committer, "checkpoint", checkpoint)
    monkeypatch.setattr(Recovery, "find", find)
    monkeypatch.setattr(AsyncCheckpoints, "quiesce", quiesce)
    handle = restart.checkpoint(2, 1, wait=False)
    assert restart.var_id("u", create=False) == 0
    handle.result()
    assert seen == [True]
    restart.finalize()


@pytest.mark.parametrize("call, bad, good, found", [("var_id", "", "three", 3),
                                                    ("stored_size", "three", 3, 4 * SIZES[3])])
def test_an_argument_refused_on_one_rank_does_not_hang_the_others(tmp_path, call, bad, good, found):
    """On a restart the first var_id (the names) and stored_size (the sizes) read the checkpoint together on
    every rank: a rank whose argument is refused (an empty name, an id that is not an int) takes part in that
    read before raising, so the others get their answer and do not wait for it forever."""
    cfg = load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                      meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, group_size=4)

    def first(t):
        ctx = Context(cfg, t)
        _write(ctx, list(range(10)))
        ctx._close()

    def again(t):
        ctx = Context(cfg, t)
        ask = (lambda x: ctx.var_id(x, create=False)) if call == "var_id" else ctx.stored_size
        try:
            return ask(bad if t.rank == 2 else good)
        except ftidask.ProtectError:
            return "refused"
        finally:
            ctx._close()

    assert run_ranks(cfg, 4, first, wait=60)[1] == []
    answers, errors = run_ranks(cfg, 4, again, wait=30)
    assert errors == [] and answers == [found, found, "refused", found]


def test_stored_size_of_a_bad_id_on_a_fresh_start_says_so(dirs):
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ProtectError, match="must be an int"):
        ctx.stored_size("three")
    ctx.finalize()


@pytest.mark.parametrize("newest_here", [False, True])
def test_var_id_finds_the_names_of_the_checkpoint_that_recover_loads(tmp_path, newest_here):
    """Names a and b given in the order b, a (ids 1, 0 then), checkpoint 1 at L4 written by 1 rank; a restart on 2
    ranks redistributes it and writes checkpoint 2 at L1 (``newest_here``: at L4, then a restart on 1 rank writes
    checkpoint 3 at L1). The newest checkpoint's files are lost: recover() on 1 rank loads the newest that it can (1, of
    this layout, or 2 redistributed), and var_id finds the names there. Before, var_id read the names of the newest
    checkpoint's layout only: none (the files of 2 lost), or none at all (the newest, of this layout, lost)."""
    def cfg(n):
        return load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                           meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, group_size=n)

    def block(ctx, t, n, ids, out=None):
        for k, name in enumerate(("a", "b")):
            a = np.zeros(8 // n) if out is None else out.setdefault(name, np.zeros(8 // n))
            ctx.protect(ids[name], a, global_shape=(8,), offset=(8 // n * t.rank,))

    def write(n, ckpt, level, recover=True):
        def job(t):
            ctx = Context(cfg(n), t)
            ids = {name: ctx.var_id(name) for name in ("b", "a")}
            out: dict = {}
            block(ctx, t, n, ids, out)
            if recover:
                ctx.recover()
            else:
                for k, name in enumerate(("a", "b")):
                    out[name][:] = np.arange(8.0) + 100 * k
            ctx.checkpoint(ckpt, level)
            ctx._close()
            return ids

        results, errors = run_ranks(cfg(n), n, job, wait=60)
        assert errors == [], errors
        return results[0]

    given = write(1, 1, 4, recover=False)
    write(2, 2, 4 if newest_here else 1)
    if newest_here:
        write(1, 3, 1)
    for f in tmp_path.glob(f"L/node*/*/l1/ckpt{3 if newest_here else 2}.*/*.fti"):
        f.unlink()

    def again(t):
        ctx = Context(cfg(1), t)
        ids = {name: ctx.var_id(name, create=False) for name in ("a", "b")}
        out: dict = {}
        block(ctx, t, 1, ids, out)
        ctx.recover()
        ctx._close()
        return ids, ctx.recovered_from, out

    found, errors = run_ranks(cfg(1), 1, again, wait=60)
    assert errors == [], errors
    ids, recovered_from, out = found[0]
    assert ids == given and recovered_from == ((2, 4) if newest_here else (1, 4))
    assert (out["a"] == np.arange(8.0)).all() and (out["b"] == np.arange(8.0) + 100).all()


def test_a_default_name_that_is_another_variables_name_is_refused(tmp_path):
    """protect(3, name="var5") then protect(5) (named var5 by default) made two variables of one name (var_id found
    variable 3, a Zarr export keeps one of them); the other order was refused. Both are refused now."""
    dirs = dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m")
    with ftidask.init(**dirs) as ctx:
        ctx.protect(3, np.zeros(2), name="var5")
        with pytest.raises(ftidask.ProtectError, match="variable 3's"):
            ctx.protect(5, np.zeros(2))
        assert 5 not in ctx.protected
        ctx.protect(3, np.zeros(2), name="u")  # renamed: var5 is free again
        ctx.protect(5, np.zeros(2))
        given = ctx.var_id("var9")  # var_id gives var9 a new id: 6
        with pytest.raises(ftidask.ProtectError, match=f"variable {given}'s"):
            ctx.protect(9, np.zeros(2))
        ctx.protect(given, np.zeros(2))
        assert {vid: p.name for vid, p in ctx.variables.items()} == {3: "u", 5: "var5", given: "var9"}


def test_an_interrupt_while_the_stored_names_are_indexed_swaps_no_variable(tmp_path, monkeypatch):
    """A Ctrl-C while var_id() indexed the checkpoint's names left them marked read but half indexed: the cell run
    again gave a stored name a new id, another stored variable's, and recover() filled it with that one's values."""
    import subprocess
    import sys

    from ftidask.api import context as context_module

    cfg = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
           "verbosity": 4}
    code = (f"import os, numpy as np, ftidask\nctx = ftidask.init(**{cfg!r})\n"
            "for name, v in (('b', 2.0), ('a', 1.0), ('c', 3.0)):\n"
            "    ctx.protect(ctx.var_id(name), np.full(4, v), name=name)\nctx.checkpoint(1, 1)\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    class Interrupting(dict):  # the signal landing at the second name indexed
        seen = 0

        def __getitem__(self, key):
            Interrupting.seen += 1
            if Interrupting.seen == 2:
                raise KeyboardInterrupt("Ctrl-C")
            return dict.__getitem__(self, key)

    real = context_module.restart_names
    monkeypatch.setattr(context_module, "restart_names", lambda *a: Interrupting(real(*a)))
    ctx = ftidask.init(**cfg)
    with pytest.raises(KeyboardInterrupt):
        ctx.var_id("a")
    monkeypatch.undo()
    arrays = {}
    for name in ("a", "b", "c"):  # the cell run again
        arrays[name] = np.zeros(4)
        ctx.protect(ctx.var_id(name), arrays[name], name=name)
    ctx.recover()
    assert {name: float(a[0]) for name, a in arrays.items()} == {"a": 1.0, "b": 2.0, "c": 3.0}
    ctx.finalize()
