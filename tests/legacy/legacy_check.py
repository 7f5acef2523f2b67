"""Helpers of tests/test_legacy_fixtures.py and tests/mpi_scripts/legacy_recover.py.

They read a legacy case (tests/data/legacy/<case>/case.json and expected/*.npy), copy it somewhere
else, build the variables a restarted program would protect, and compare what ``recover()`` gave
with the expected values, bit for bit. Only ftidask's public API is used (``ftidask.init``, the
Context's methods, ``ftidask.State``, ``ftidask.Value``), so that these tests keep working whatever
the package's internal modules become.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

import ftidask

DATA = Path(__file__).resolve().parents[1] / "data" / "legacy"


def case_names(backend: str) -> list[str]:
    return sorted(p.parent.name for p in DATA.glob("*/case.json")
                  if json.loads(p.read_text())["backend"] == backend)


def load(case_dir: Path) -> dict[str, Any]:
    return json.loads((Path(case_dir) / "case.json").read_text())


def copy_case(name: str, dest: Path, lose_node: int | None = None) -> Path:
    """Copy the case to ``dest/name`` (another absolute path than the one that wrote it), make the copy
    private (ftidask refuses run directories that others could write), and erase ``Local/node{lose_node}``."""
    target = Path(dest) / name
    shutil.copytree(DATA / name, target)
    for root, dirs, files in os.walk(target):
        for entry in [root, *(os.path.join(root, f) for f in files)]:
            os.chmod(entry, os.stat(entry).st_mode & ~0o077)
    if lose_node is not None:
        node = target / "Local" / f"node{lose_node}"
        assert node.is_dir(), node
        shutil.rmtree(node)
    return target


def plain(x: Any) -> Any:
    """A BitGenerator state as JSON values (arrays as lists), as case.json holds it."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    return x


def recovered_from_problems(recovered_from: Any, checkpoint: list[int]) -> list[str]:
    """``ctx.recovered_from`` names the checkpoint (id, level); for a differential checkpoint (levels 5-8)
    ftidask 48fdead reports its base level (1-4), which is accepted too."""
    ckpt_id, level = checkpoint
    if recovered_from is None or list(recovered_from)[0] != ckpt_id or \
            list(recovered_from)[1] not in (level, level - 4 if level > 4 else level):
        return [f"recovered from {recovered_from}, expected checkpoint {ckpt_id} at level {level}"]
    return []


def expected_array(case_dir: Path, entry: dict) -> np.ndarray:
    return np.load(Path(case_dir) / entry["file"], allow_pickle=False)


def make_target(case_dir: Path, entry: dict) -> Any:
    """What a restarted program protects for this variable: an array of the right dtype, shape and
    order (zeros), an empty State/dict/Value, a generator of the right kind at another state."""
    kind = entry["kind"]
    if kind == "array":
        return np.zeros_like(expected_array(case_dir, entry))
    if kind == "state":
        return ftidask.State()
    if kind == "dict":
        return {}
    if kind == "value":
        return ftidask.Value(None)
    bitgen = getattr(np.random, entry["bit_generator"])(12345)
    return np.random.Generator(bitgen) if kind == "generator" else bitgen


def targets_for(case_dir: Path, entries: list[dict]) -> dict[int, Any]:
    return {e["id"]: make_target(case_dir, e) for e in entries}


def protect_all(ctx: Any, targets: dict[int, Any], entries: list[dict]) -> None:
    for e in entries:
        kw: dict[str, Any] = {}
        if "global_shape" in e:
            kw = {"global_shape": tuple(e["global_shape"]), "offset": tuple(e["offset"])}
        elif e.get("replicated"):
            kw = {"replicated": True}
        if e["kind"] == "array":
            kw["name"] = e.get("name")
        ctx.protect(e["id"], targets[e["id"]], **kw)


def compare(case_dir: Path, entries: list[dict], targets: dict[int, Any], out: Any = None) -> list[str]:
    """What differs between the recovered variables and the expected ones (an empty list: all equal)."""
    problems = []
    for e in entries:
        vid, kind, got = e["id"], e["kind"], targets[e["id"]]
        if out is not None and out.get(vid) is not got:
            problems.append(f"variable {vid}: recover() did not return the protected object")
        if kind == "array":
            want = expected_array(case_dir, e)
            problems += compare_array(f"variable {vid}", got, want)
        elif kind in ("state", "dict"):
            if json.dumps(got) != e["json"]:
                problems.append(f"variable {vid}: {json.dumps(got)[:200]} != {e['json'][:200]}")
        elif kind == "value":
            if json.dumps(got.value) != e["json"]:
                problems.append(f"variable {vid}: {json.dumps(got.value)[:200]} != {e['json'][:200]}")
        else:
            bitgen = got.bit_generator if isinstance(got, np.random.Generator) else got
            if type(bitgen).__name__ != e["bit_generator"] or plain(bitgen.state) != e["state"]:
                problems.append(f"variable {vid}: generator state {plain(bitgen.state)} != {e['state']}")
    return problems


def compare_array(what: str, got: Any, want: np.ndarray) -> list[str]:
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{what}: {got.dtype} {got.shape} != {want.dtype} {want.shape}"]
    if np.isfortran(got) != np.isfortran(want):
        return [f"{what}: memory order differs"]
    if got.tobytes(order="A") != want.tobytes(order="A"):
        return [f"{what}: the bytes differ"]
    return []


def scribble(targets: dict[int, Any]) -> None:
    """Change every protected variable (before a second recovery)."""
    for obj in targets.values():
        if isinstance(obj, np.ndarray):
            if obj.size:
                obj[...] = np.frombuffer(b"\xa5" * obj.nbytes, dtype=obj.dtype).reshape(obj.shape)
        elif isinstance(obj, ftidask.Value):
            obj.value = "scribbled"
        elif isinstance(obj, dict):
            obj.clear()
            obj["scribbled"] = 1
        elif isinstance(obj, np.random.Generator):
            obj.random(7)
        else:
            np.random.Generator(obj).random(7)
