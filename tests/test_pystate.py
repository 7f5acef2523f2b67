"""Python state beside the arrays (ftidask.engine.pystate): JSON values in ftidask.State / ftidask.Value and
NumPy random generators, stored as hash-covered bytes, recovered in place, never pickled."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

import ftidask
from ftidask.ftiff.reader import parse_ftiff
from ftidask.model.errors import CheckpointError, NoCheckpointError, ProtectError, RecoveryError
from ftidask.storage.files import find_paths
from ftidask.tools.cli import main as cli_main


def _ctx(tmp: Path, **kw) -> ftidask.Context:
    return ftidask.init(ckpt_dir=tmp / "L", glbl_dir=tmp / "G", meta_dir=tmp / "M", verbosity=4, **kw)


def _files(tmp: Path) -> list[Path]:
    return sorted(p for p in find_paths(tmp, "Ckpt*-Rank0.fti") if ".spare" not in str(p) and "spare" not in p.name)


JSON_VALUE = {"step": 12, "name": "h\u00e9at \U0001f525", "lr": 1e-3, "neg": -7, "big": 2**80, "flag": True,
              "none": None, "nested": {"list": [1, 2.5, "x", [False, None], {}], "empty": []},
              "inf": math.inf, "ninf": -math.inf}


@pytest.mark.parametrize("level", [1, 4, 5, 8])
def test_round_trip_of_each_kind(tmp_path: Path, level: int) -> None:
    """A State, a plain dict, a Value, a Generator and BitGenerators of several kinds (MT19937 and Philox
    hold arrays in their state) come back in place, the very objects, at L1/L4 and differential L5/L8."""
    kw = {"enable_dcp": 1} if level > 4 else {}
    ctx = _ctx(tmp_path, **kw)
    st, plain, val = ftidask.State(JSON_VALUE), {"a": [1, 2]}, ftidask.Value("text")
    gens = {10: np.random.default_rng(1), 11: np.random.MT19937(2), 12: np.random.Philox(3),
            13: np.random.SFC64(4), 14: np.random.Generator(np.random.MT19937(5))}
    for g in gens.values():  # mid-stream, with buffered values (has_uint32, Philox's buffer)
        (g if isinstance(g, np.random.Generator) else np.random.Generator(g)).integers(0, 2**32, 3, dtype=np.uint32)
    ctx.protect(1, st)
    ctx.protect(2, plain)
    ctx.protect(3, val)
    for vid, g in gens.items():
        ctx.protect(vid, g)
    ctx.checkpoint(1, level)
    expected = {vid: (g if isinstance(g, np.random.Generator) else np.random.Generator(g)).random(4)
                for vid, g in gens.items()}
    st["step"] = 99
    st.pop("name")
    plain["b"] = 3
    val.value = None
    out = ctx.recover()
    assert out[1] is st and out[3] is val and out[10] is gens[10]
    assert json.dumps(st, sort_keys=True) == json.dumps(JSON_VALUE, sort_keys=True)
    assert list(st) == list(JSON_VALUE)  # the insertion order too
    assert plain == {"a": [1, 2]} and val.value == "text"
    for vid, g in gens.items():
        again = (g if isinstance(g, np.random.Generator) else np.random.Generator(g)).random(4)
        assert np.array_equal(again, expected[vid]), vid


def test_nan_round_trips(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    v = ftidask.Value([math.nan, 1.5])
    ctx.protect(1, v)
    ctx.checkpoint(1, 1)
    v.value = 0
    ctx.recover()
    assert math.isnan(v.value[0]) and v.value[1] == 1.5


@pytest.mark.parametrize("level", [1, 5])
def test_state_grows_and_shrinks_between_checkpoints(tmp_path: Path, level: int) -> None:
    """A dict's size changes between checkpoints (the path of arrays that grow): each recovers exactly."""
    ctx = _ctx(tmp_path, **({"enable_dcp": 1} if level > 4 else {}))
    st, a = ftidask.State({"k": 0}), np.arange(5.0)
    ctx.protect(1, a)
    ctx.protect(2, st)
    for i, size in enumerate([1, 3000, 10, 50_000, 0], start=1):
        st.clear()
        st.update({"k": i, "blob": "x" * size, "list": list(range(size // 100))})
        want = dict(st)
        ctx.checkpoint(i, level)
        st.clear()
        ctx.recover()
        assert st == want
        assert ctx.stored_size(2) == len(json.dumps(want, separators=(",", ":")).encode())
    assert np.array_equal(a, np.arange(5.0))


def test_restart_in_a_new_process_recovers_in_place(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    ctx.protect(1, ftidask.State({"epoch": 7, "history": [0.5, 0.25]}))
    ctx.protect(2, np.random.default_rng(11))
    ctx.checkpoint(1, 1)
    del ctx  # killed: no finalize, the checkpoint stays
    ctx = _ctx(tmp_path)
    assert ctx.status() == 1
    st, rng = ftidask.State(), np.random.default_rng(0)
    ctx.protect(1, st)
    ctx.protect(2, rng)
    ctx.recover()
    assert st == {"epoch": 7, "history": [0.5, 0.25]}
    assert rng.bit_generator.state == np.random.default_rng(11).bit_generator.state


@pytest.mark.parametrize("bad", [
    {1: "int key"}, {"t": (1, 2)}, {"s": {1, 2}}, {"b": b"bytes"}, {"n": np.float64(1.0)}, {"o": object()},
    {"a": np.zeros(2)}, {"sub": ftidask.State()},
])
def test_refused_values(tmp_path: Path, bad: dict) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(ProtectError, match="JSON|not a JSON"):
        ctx.protect(1, ftidask.State(bad))
    with pytest.raises(ProtectError, match="JSON|not a JSON"):
        ctx.protect(1, ftidask.Value([bad]))
    assert 1 not in ctx.protected


@pytest.mark.parametrize("bad", [[1, 2], {1, 2}, b"bytes", object(), np.random.RandomState(0), 3, "text"])
def test_refused_objects(tmp_path: Path, bad: object) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(ProtectError) as info:
        ctx.protect(1, bad)
    assert "Value" in str(info.value) or "Generator" in str(info.value)


def test_self_containing_value_is_refused(tmp_path: Path) -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(ProtectError, match="nested"):
        _ctx(tmp_path).protect(1, ftidask.Value(loop))


def test_value_made_invalid_after_protect_fails_the_checkpoint_and_keeps_the_previous(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    st = ftidask.State({"ok": 1})
    ctx.protect(1, st)
    ctx.checkpoint(1, 1)
    st["bad"] = {1, 2}
    with pytest.raises(CheckpointError, match="set"):
        ctx.checkpoint(2, 1)
    st.clear()
    ctx.recover()
    assert st == {"ok": 1} and ctx.recovered_from == (1, 1)


def _flip_state_byte(tmp: Path, vid: int) -> None:
    path = _files(tmp)[0]
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    meta = next(m for _b, _c, m in parsed.containers() if m.id == vid and m.chunksize)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize // 2)
        byte = fh.read(1)
        fh.seek(meta.fptr + meta.chunksize // 2)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("level", [1, 5])
def test_damaged_state_bytes_are_detected_and_nothing_is_touched(tmp_path: Path, level: int) -> None:
    ctx = _ctx(tmp_path, **({"enable_dcp": 1} if level > 4 else {}))
    a, st, rng = np.arange(8.0), ftidask.State({"step": 1234567, "pad": "y" * 200}), np.random.default_rng(5)
    ctx.protect(1, a)
    ctx.protect(2, st)
    ctx.protect(3, rng)
    ctx.checkpoint(1, level)
    a[:] = -1
    st["step"] = 0
    before = rng.bit_generator.state
    _flip_state_byte(tmp_path, 2)
    with pytest.raises(NoCheckpointError, match="hash"):
        ctx.recover()
    assert np.all(a == -1) and st == {"step": 0, "pad": "y" * 200} and rng.bit_generator.state == before


def test_generator_of_another_kind_is_refused_before_anything_is_touched(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    a = np.arange(4.0)
    ctx.protect(1, a)
    ctx.protect(2, np.random.default_rng(1))  # PCG64
    ctx.checkpoint(1, 1)
    a[:] = 0
    other = np.random.Generator(np.random.MT19937(3))
    before = other.bit_generator.state
    ctx.protect(2, other)
    with pytest.raises(RecoveryError, match="PCG64"):
        ctx.recover()
    assert np.all(a == 0)
    assert other.bit_generator.state["state"]["key"].tolist() == before["state"]["key"].tolist()


def test_array_and_state_kinds_must_match(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    ctx.protect(1, ftidask.Value(3))
    ctx.protect(2, np.zeros(3))
    ctx.checkpoint(1, 1)
    ctx.protect(1, np.zeros(1, np.uint8))
    with pytest.raises(RecoveryError, match="Python state"):
        ctx.recover()
    ctx.protect(1, ftidask.Value(0))
    ctx.protect(2, ftidask.Value(0))
    with pytest.raises(RecoveryError, match="array"):
        ctx.recover()
    v = ftidask.State()
    ctx.protect(1, v)  # a dict cannot take a stored int
    ctx.protect(2, np.zeros(3))
    with pytest.raises(RecoveryError, match="dict"):
        ctx.recover()


def test_realloc_of_a_state_keeps_the_object(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    st = ftidask.State({"a": 1})
    ctx.protect(1, st)
    ctx.checkpoint(1, 1)
    ctx = _ctx(tmp_path)
    st2 = ftidask.State()
    ctx.protect(1, st2)
    assert ctx.stored_size(1) == len(b'{"a":1}')
    assert ctx.realloc(1) is st2
    ctx.recover()
    assert st2 == {"a": 1} and ctx.protected[1] is st2


def test_compressed_state(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, compressor="zstd")
    st = ftidask.State({"text": "abc" * 5000})
    ctx.protect(1, st)
    ctx.checkpoint(1, 1)
    st.clear()
    ctx.recover()
    assert st == {"text": "abc" * 5000}


def test_inspect_shows_kind_and_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ctx = _ctx(tmp_path)
    ctx.protect(1, np.arange(3.0))
    ctx.protect(2, ftidask.State({"epoch": 41, "tag": "run-a"}), name="train_state")
    ctx.protect(3, np.random.default_rng(0), name="rng")
    ctx.checkpoint(1, 1)
    assert cli_main(["inspect", str(_files(tmp_path)[0])]) == 0
    out = capsys.readouterr().out
    assert "id 2 'train_state': Python state json = " in out and '{"epoch": 41, "tag": "run-a"}' in out
    assert "id 3 'rng': Python state numpy.random = " in out and "PCG64" in out
    assert cli_main(["inspect", "--json", str(_files(tmp_path)[0])]) == 0
    table = json.loads(capsys.readouterr().out)["table"]
    assert {v["id"]: v.get("extra", {}).get("pystate") for v in table["vars"]} == {1: None, 2: "json",
                                                                                    3: "numpy.random"}


# --- a real restart: the process is killed with SIGKILL, then started again -----------------------------

CHILD = r"""
import os, signal, sys
import numpy as np
import ftidask
base, kill_at = sys.argv[1], int(sys.argv[2])
ctx = ftidask.init(ckpt_dir=base + "/L", glbl_dir=base + "/G", meta_dir=base + "/M", verbosity=4)
rng = np.random.default_rng(2024)
params = ftidask.State({"drawn": []})
x = np.zeros(4)

@ftidask.resilient(ctx, arrays={1: x}, every=5, iterations=30, rng=rng, state=params)
def step(i):
    value = float(rng.random())
    params["drawn"].append(round(value, 6))
    x[:] += value
    print(i, repr(value), flush=True)
    if i == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

step()
print("sum", repr(float(x.sum())), len(params["drawn"]), flush=True)
ctx.finalize()
"""


def _child(base: Path, kill_at: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", CHILD, str(base), str(kill_at)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


def test_generator_continues_the_same_stream_after_sigkill(tmp_path: Path) -> None:
    ref = _child(tmp_path / "ref", -1)
    assert ref.returncode == 0, ref.stderr
    killed = _child(tmp_path / "run", 17)
    assert killed.returncode == -signal.SIGKILL
    resumed = _child(tmp_path / "run", -1)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0].startswith("15 ")  # resumed after the checkpoint of iteration 15, not from 0
    drawn = dict(line.split() for line in ref.stdout.splitlines()[:-1])
    for line in lines[:-1]:  # every number the restarted run draws is the uninterrupted run's
        i, value = line.split()
        assert drawn[i] == value
    assert lines[-1] == ref.stdout.splitlines()[-1]  # the arrays and the dict too (30 values drawn)


def test_python_states_survive_export_and_import(tmp_path: Path) -> None:
    """ftidask export --to-zarr, then import: a State, a Value and a generator come back as such
    (before, the import stored their bytes as a plain array, and recovering a State from it failed)."""
    from ftidask.tools.zarr_export import export_checkpoint, import_zarr

    old = {"ckpt_dir": tmp_path / "L", "glbl_dir": tmp_path / "G", "meta_dir": tmp_path / "M", "verbosity": 4}
    new = {"ckpt_dir": tmp_path / "L2", "glbl_dir": tmp_path / "G2", "meta_dir": tmp_path / "M2", "verbosity": 4}
    ctx = ftidask.init(**old)
    field, state, value = np.arange(50.0), ftidask.State({"step": 7, "tags": ["a", "b"]}), ftidask.Value(2.5)
    rng = np.random.default_rng(11)
    rng.random(3)
    ctx.protect(1, field)
    ctx.protect(2, state)
    ctx.protect(3, value)
    ctx.protect(4, rng)
    ctx.checkpoint(1, 1)
    expected_draws = np.random.Generator(type(rng.bit_generator)())
    expected_draws.bit_generator.state = rng.bit_generator.state
    ctx._close()
    export_checkpoint(None, tmp_path / "s.zarr", **old)
    import_zarr(tmp_path / "s.zarr", **new)
    ctx = ftidask.init(**new)
    f2, s2, v2, r2 = np.zeros(50), ftidask.State(), ftidask.Value(), np.random.default_rng(0)
    for vid, obj in enumerate((f2, s2, v2, r2), start=1):
        ctx.protect(vid, obj)
    ctx.recover()
    assert f2.tobytes() == field.tobytes()
    assert s2 == {"step": 7, "tags": ["a", "b"]} and v2.value == 2.5
    assert r2.random(5).tobytes() == expected_draws.random(5).tobytes()  # the same stream goes on
    ctx.finalize()


def test_forged_generator_states_are_refused_cleanly():
    """A stored state names its bit generator and holds JSON: one 600 dicts deep raised a raw RecursionError (two
    frames a level); one that names the base class BitGenerator a raw NotImplementedError at import."""
    from ftidask.engine import pystate
    from ftidask.model.errors import RecoveryError

    deep: dict = {"x": 1}
    for _ in range(600):
        deep = {"x": deep}
    forged = json.dumps({"bit_generator": "PCG64", "state": deep, "has_uint32": 0, "uinteger": 0}).encode()
    with pytest.raises(RecoveryError, match="deep"):
        pystate.from_stored(pystate.KIND_RNG, forged, "variable 3")
    with pytest.raises(RecoveryError, match="deep"):
        pystate.holder_of(np.random.default_rng(0)).decode(forged, "variable 3")
    base = json.dumps({"bit_generator": "BitGenerator", "state": {}}).encode()
    with pytest.raises(RecoveryError, match="not the state of a NumPy bit generator"):
        pystate.from_stored(pystate.KIND_RNG, base, "variable 3")
