"""Checkpoints written by an older ftidask restart with this one.

tests/data/legacy holds runs checkpointed by commit 48fdead (tests/legacy/make_fixtures.py wrote
them once; their bytes are never regenerated: see tests/data/legacy/README.md). Each test copies a
case to tmp_path (another absolute path than the one that wrote it), erases one node's files for the
L2/L3 cases (so that the rebuild path runs), restarts the run with its config file from the copy,
checks that ``status()`` says a restart, protects variables of the right shape, recovers them and
compares bit for bit; then it writes one more checkpoint at the same level on top of the legacy
one and recovers that too.

Only the public API is used (``ftidask.init``, the Context's methods, ``ftidask.State``...), so that
these tests survive the package's restructuring.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import need_mpi, run

sys.path.insert(0, str(Path(__file__).resolve().parent / "legacy"))
import legacy_check  # noqa: E402

import ftidask  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

SINGLE = legacy_check.case_names("single")
MPI_CASES = legacy_check.case_names("mpi")
DASK_CASES = legacy_check.case_names("dask")
HAVE_DASK = importlib.util.find_spec("distributed") is not None and importlib.util.find_spec("dask") is not None
DASK_MARKS = [pytest.mark.dask, pytest.mark.timeout(240),
              pytest.mark.skipif(not HAVE_DASK, reason="needs dask.distributed")]


def test_the_fixtures_are_there() -> None:
    """Every backend has its cases (a checkout without them would make the tests below vanish)."""
    assert len(SINGLE) >= 9 and len(MPI_CASES) >= 7 and len(DASK_CASES) >= 6, (SINGLE, MPI_CASES, DASK_CASES)
    size = sum(p.stat().st_size for p in find_paths(legacy_check.DATA, "*") if p.is_file())
    assert size < 3 * 2**20, size


def _requires(case: dict) -> None:
    for module in case.get("requires", []):
        pytest.importorskip(module)


# --- one process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SINGLE)
def test_single_process_case(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case_dir = legacy_check.copy_case(name, tmp_path)
    case = legacy_check.load(case_dir)
    _requires(case)
    monkeypatch.chdir(case_dir)  # config.fti names ./Local, ./Global, ./Meta
    ctx = ftidask.init("config.fti")
    assert ctx.status() == case["status"]
    assert ctx.exec_id == case["exec_id"]
    targets = legacy_check.targets_for(case_dir, case["vars"])
    legacy_check.protect_all(ctx, targets, case["vars"])
    out = ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, case["checkpoint"]) == []
    assert legacy_check.compare(case_dir, case["vars"], targets, out) == []
    # The run goes on from the legacy checkpoint (a differential one patches the legacy spare file).
    ckpt_id, level = case["checkpoint"]
    ctx.checkpoint(ckpt_id + 1, level)
    legacy_check.scribble(targets)
    ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, [ckpt_id + 1, level]) == []
    assert legacy_check.compare(case_dir, case["vars"], targets) == []
    ctx.finalize()


def test_restart_by_exec_id_with_absolute_directories(tmp_path: Path) -> None:
    """The other way to restart: no config file, the directories as absolute overrides, the run named."""
    case_dir = legacy_check.copy_case("single_l1", tmp_path)
    case = legacy_check.load(case_dir)
    ctx = ftidask.init(None, ckpt_dir=str(case_dir / "Local"), glbl_dir=str(case_dir / "Global"),
                       meta_dir=str(case_dir / "Meta"), exec_id=case["exec_id"], verbosity=4)
    assert ctx.status() == 1
    targets = legacy_check.targets_for(case_dir, case["vars"])
    legacy_check.protect_all(ctx, targets, case["vars"])
    ctx.recover()
    assert legacy_check.compare(case_dir, case["vars"], targets) == []


def test_partial_recovery_of_a_legacy_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recover(ids=[...]) fills only those variables; the others stay as they were."""
    case_dir = legacy_check.copy_case("single_l4", tmp_path)
    case = legacy_check.load(case_dir)
    monkeypatch.chdir(case_dir)
    ctx = ftidask.init("config.fti")
    targets = legacy_check.targets_for(case_dir, case["vars"])
    legacy_check.protect_all(ctx, targets, case["vars"])
    ctx.recover(ids=[1, 10])
    wanted = [e for e in case["vars"] if e["id"] in (1, 10)]
    assert legacy_check.compare(case_dir, wanted, targets) == []
    assert not targets[2].any()


@pytest.mark.parametrize("lose_node", [None, 1], ids=["intact", "node1_lost"])
def test_mpi_reshard_case_recovered_by_one_process(lose_node: int | None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4-rank L3 checkpoint with declared blocks, recovered by one process (no MPI) into the whole
    global arrays; with node 1 lost, its files are rebuilt from the Reed-Solomon parity first."""
    case_dir = legacy_check.copy_case("mpi_reshard_l3", tmp_path, lose_node)
    case = legacy_check.load(case_dir)
    monkeypatch.chdir(case_dir)
    ctx = ftidask.init("config.fti")
    assert ctx.status() == 1
    want = {int(vid): np.load(case_dir / f, allow_pickle=False) for vid, f in case["globals"].items()}
    got = {vid: np.zeros_like(w) for vid, w in want.items()}
    ctx.protect(1, got[1], global_shape=got[1].shape, offset=(0, 0))
    ctx.protect(2, got[2], global_shape=ftidask.Block(got[2].shape, (0,)))
    ctx.protect(3, got[3], replicated=True)
    ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, case["checkpoint"]) == []
    for vid in want:
        assert legacy_check.compare_array(f"variable {vid}", got[vid], want[vid]) == []


# --- MPI: 4 ranks, one mpiexec job recovers every case ----------------------------------------------------


@pytest.fixture(scope="module")
def mpi_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("legacy_mpi")
    dirs = {}
    for name in MPI_CASES:
        dirs[name] = legacy_check.copy_case(name, base, legacy_check.load(legacy_check.DATA / name)["lose_node"])
    run(4, "legacy_recover.py", *(str(d) for d in dirs.values()), timeout=240)
    return {name: [json.loads((d / f"legacy-result-{r}.json").read_text()) for r in range(4)]
            for name, d in dirs.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=need_mpi()) for n in MPI_CASES])
def test_mpi_case(name: str, mpi_results: dict[str, list[dict]]) -> None:
    problems = [f"rank {r}: {p}" for r, res in enumerate(mpi_results[name]) for p in res["problems"]]
    assert problems == []


# --- Dask: a LocalCluster of 4 worker processes (others than those that wrote the checkpoints) ------------


@pytest.fixture(scope="module")
def dask_client():
    import distributed

    with distributed.LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(4, timeout=60)
        yield client


def _dask_check(case_dir: Path, case: dict, arrays: dict, numpy_targets: dict) -> list[str]:
    problems = []
    for e in case["vars"]:
        vid = e["id"]
        if e.get("numpy"):
            if arrays.get(vid) is not numpy_targets[vid]:
                problems.append(f"variable {vid}: the NumPy array was not filled in place")
            problems += legacy_check.compare_array(f"variable {vid}", numpy_targets[vid],
                                                   legacy_check.expected_array(case_dir, e))
            continue
        got = arrays[vid]
        if [list(c) for c in got.chunks] != e["chunks"]:
            problems.append(f"variable {vid}: chunks {got.chunks} != {e['chunks']}")
        problems += legacy_check.compare_array(f"variable {vid}", got.compute(),
                                               legacy_check.expected_array(case_dir, e))
    return problems


@pytest.mark.parametrize("name", [pytest.param(n, marks=DASK_MARKS) for n in DASK_CASES])
def test_dask_case(name: str, dask_client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = legacy_check.load(legacy_check.DATA / name)
    case_dir = legacy_check.copy_case(name, tmp_path, case["lose_node"])
    monkeypatch.chdir(case_dir)
    ctx = ftidask.init("config.fti", client=dask_client)
    assert ctx.status() == case["status"]
    assert ctx.exec_id == case["exec_id"]
    numpy_targets = {e["id"]: legacy_check.make_target(case_dir, e) for e in case["vars"] if e.get("numpy")}
    for vid, arr in numpy_targets.items():
        ctx.protect(vid, arr)
    arrays = ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, case["checkpoint"]) == []
    assert _dask_check(case_dir, case, arrays, numpy_targets) == []
    # The run goes on: the recovered arrays checkpointed again at the same level, and recovered.
    for vid, arr in arrays.items():
        if vid not in numpy_targets:
            ctx.protect(vid, arr)
    ckpt_id, level = case["checkpoint"]
    ctx.checkpoint(ckpt_id + 1, level)
    for arr in numpy_targets.values():
        arr[...] = 0
    arrays = ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, [ckpt_id + 1, level]) == []
    assert _dask_check(case_dir, case, arrays, numpy_targets) == []
    ctx.finalize()


@pytest.mark.parametrize("lose_node", [pytest.param(1, marks=DASK_MARKS)], ids=["node1_lost"])
def test_mpi_reshard_case_recovered_on_dask(lose_node: int, dask_client, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4-rank L3 checkpoint with declared blocks, stitched into global Dask arrays on a cluster."""
    case_dir = legacy_check.copy_case("mpi_reshard_l3", tmp_path, lose_node)
    case = legacy_check.load(case_dir)
    monkeypatch.chdir(case_dir)
    ctx = ftidask.init("config.fti", client=dask_client)
    assert ctx.status() == 1
    arrays = ctx.recover()
    assert legacy_check.recovered_from_problems(ctx.recovered_from, case["checkpoint"]) == []
    for vid, f in case["globals"].items():
        want = np.load(case_dir / f, allow_pickle=False)
        assert legacy_check.compare_array(f"variable {vid}", arrays[int(vid)].compute(), want) == []
