"""L1-L4 over real mpiexec jobs: checkpoint, die, damage files, restart, recover, compare bit for bit.

One checkpoint per level; each damage case works on a copy of it; one recovery job runs every
case of a level in turn. 4 ranks = 4 simulated nodes of 1 rank (one group of 4), with asynchronous
checkpoints, and two groups of two; the 16-rank variant (4 nodes of 4 ranks) is marked slow. The
synchronous 4-rank matrix is the conformance suite's (tests/conformance/).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from campaign import kept
from mpi_util import need_mpi, run

from ftidask.storage.files import find_paths

pytestmark = need_mpi()

OK, FAIL = "ok", "fail"


def _files(base: Path, nodes: list[int], pattern: str) -> list[Path]:
    out = []
    for n in nodes:
        out += sorted((base / "Local" / f"node{n}").glob(f"*/l*/*/{pattern}"))
    return out


def erase(nodes: list[int], pattern: str) -> Callable[[Path], None]:
    def damage(base: Path) -> None:
        found = _files(base, nodes, pattern)
        assert found, f"nothing matches {pattern} on nodes {nodes}"
        for path in found:
            path.unlink()
    return damage


def corrupt(nodes: list[int], pattern: str) -> Callable[[Path], None]:
    def damage(base: Path) -> None:
        found = _files(base, nodes, pattern)
        assert found, f"nothing matches {pattern} on nodes {nodes}"
        for path in found:
            size = path.stat().st_size
            with open(path, "r+b") as fh:  # first bytes overwritten in place, size kept
                fh.write(b"\xa5" * 200)
            assert path.stat().st_size == size
    return damage


def erase_nodes(nodes: list[int]) -> Callable[[Path], None]:
    def damage(base: Path) -> None:
        for n in nodes:
            shutil.rmtree(base / "Local" / f"node{n}", ignore_errors=True)  # L4 keeps no local files
    return damage


def erase_global(base: Path) -> None:
    shutil.rmtree(base / "Global", ignore_errors=True)  # L1-L3 write nothing there


def both(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(base: Path) -> None:
        for fn in fns:
            fn(base)
    return damage


RANK, PCOF, RSED = "Ckpt*-Rank*.fti", "Ckpt*-Pcof*.fti", "Ckpt*-RSed*.fti"
# name -> (damage, expected outcome at levels 1, 2, 3, 4; None = not applicable)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str | None, ...]]] = {
    "rank_file_erased_node0": (erase([0], RANK), (FAIL, OK, OK, None)),
    "rank_file_corrupted_node0": (corrupt([0], RANK), (FAIL, OK, OK, None)),
    "rank_files_corrupted_nodes0_2": (corrupt([0, 2], RANK), (FAIL, OK, OK, None)),
    "partner_erased_node1": (erase([1], PCOF), (None, OK, None, None)),
    "partner_corrupted_node1": (corrupt([1], PCOF), (None, OK, None, None)),
    "rank_node0_and_its_copy_node1": (both(erase([0], RANK), corrupt([1], PCOF)), (None, FAIL, None, None)),
    "parity_erased_node0": (erase([0], RSED), (None, None, OK, None)),
    "parity_corrupted_node0": (corrupt([0], RSED), (None, None, OK, None)),
    "parity_and_rank_nodes0_1": (both(corrupt([0], RSED), erase([1], RANK)), (None, None, OK, None)),
    "node0_erased": (erase_nodes([0]), (FAIL, OK, OK, OK)),
    "nodes0_1_erased": (erase_nodes([0, 1]), (FAIL, FAIL, OK, OK)),
    "nodes0_2_erased": (erase_nodes([0, 2]), (FAIL, OK, OK, OK)),
    "nodes0_1_2_erased": (erase_nodes([0, 1, 2]), (FAIL, FAIL, FAIL, OK)),
    "global_erased": (erase_global, (OK, OK, OK, FAIL)),
    "global_and_node2_erased": (both(erase_global, erase_nodes([2])), (FAIL, OK, OK, FAIL)),
}

# Only redundancy damaged, every own file sound: recovery reads the own files only (a restart reads each byte
# once), so the damaged partner copy / parity stays as it was until the next checkpoint at that level rewrites
# it. A later loss that needs it finds it damaged (rank_node0_and_its_copy_node1: a clean failure everywhere).
REDUNDANCY_ONLY = {"partner_erased_node1", "partner_corrupted_node1", "parity_erased_node0", "parity_corrupted_node0"}


def _config(nranks: int) -> dict:
    return {"local_test": 1, "node_size": nranks // 4, "group_size": 4, "block_size": 256, "transfer_size": 1}


def _check_level(tmp: Path, nranks: int, level: int, timeout: float, config: dict | None = None,
                 table: dict | None = None) -> None:
    cfg = json.dumps(config or _config(nranks))
    base = tmp / f"l{level}"
    run(nranks, "levels_job.py", "write", cfg, str(base), str(level), timeout=timeout)
    cases = {name: spec for name, spec in (table or CASES).items() if spec[1][level - 1] is not None}
    left: dict[str, dict[Path, bytes | None]] = {}
    for name, (damage, _expected) in cases.items():
        shutil.copytree(base, tmp / name)
        damage(tmp / name)
        if name in REDUNDANCY_ONLY:
            left[name] = {p.relative_to(base): _bytes(tmp / name / p.relative_to(base))
                          for p in find_paths(base / "Local", "Ckpt*.fti") if "-Rank" not in p.name}
    run(nranks, "levels_job.py", "recover", cfg, *(str(tmp / name) for name in cases), timeout=timeout)
    problems = []
    for name, (_damage, expected) in cases.items():
        want = expected[level - 1]
        results = [json.loads((tmp / name / f"result-{r}.json").read_text()) for r in range(nranks)]
        statuses = {r["status"] for r in results}
        if statuses != {want}:
            problems.append(f"{name}: expected {want} on every rank, got {[r['status'] for r in results]} "
                            f"{results[0].get('message', '')[:300]}")
        elif want == FAIL:
            # The same clear error everywhere, and the arrays untouched.
            if {r["error"] for r in results} != {"NoCheckpointError"} or len({r["message"] for r in results}) != 1:
                problems.append(f"{name}: ranks disagree on the error: {results}")
            if not all(r["untouched"] for r in results):
                problems.append(f"{name}: a failed recovery wrote into the arrays")
        elif want == OK and level in (2, 3) and name in REDUNDANCY_ONLY and "erased" not in name:
            # Damaged in place: neither read nor repaired (erased, a stat finds it and it is rebuilt, below).
            problems += _check_rebuilt(base, tmp / name, name, pattern="Ckpt*-Rank*.fti")
            problems += [f"{name}: {rel} was touched by a recovery that needed no redundancy"
                         for rel, before in left[name].items() if _bytes(tmp / name / rel) != before]
        elif want == OK and level in (2, 3):
            problems += _check_rebuilt(base, tmp / name, name)
    assert not problems, "\n".join(problems)


def _bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def _check_rebuilt(original: Path, damaged: Path, name: str, pattern: str = "Ckpt*.fti") -> list[str]:
    """After an L2/L3 recovery, every lost or damaged file (matching ``pattern``) is back, byte for byte."""
    out = []
    for path in sorted(find_paths(original / "Local", pattern)):
        twin = damaged / path.relative_to(original)
        if not twin.exists() or twin.read_bytes() != path.read_bytes():
            out.append(f"{name}: {path.relative_to(original)} was not rebuilt identically")
    return out


def _flip_slack(path: Path) -> None:
    """A byte flipped in a container's slack (past its variable's bytes: no hash covers it); the file still verifies."""
    from ftidask.ftiff.reader import parse_ftiff, verify_data

    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    slack = [meta for _, _, meta in parsed.containers() if meta.containersize > meta.chunksize]
    assert slack, f"{path}: no container with slack"
    at = slack[0].fptr + (slack[0].chunksize + slack[0].containersize) // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(path, "rb") as fh:
        verify_data(fh, parse_ftiff(fh, str(path)))


@pytest.mark.slow
def test_l3_slack_byte_flipped_beside_a_lost_parity_and_a_lost_file(tmp_path: Path, capsys) -> None:
    """A group of 4: rank 1's parity and rank 2's file lost, a byte of rank 0's file flipped in a container's slack
    (its variable shrank since the container was made: no hash covers those bytes, its file still verifies). Three
    parity files are left: the decoding needs one data file, and rank 0's came first. Its whole-file hash, kept by
    every parity's record (as FTI's L3 metadata keeps each rank's checksum), tells it apart: rank 0's and rank 2's
    files are rebuilt from the others and the L3 checkpoint comes back bit for bit on every rank. Before, rank 0's
    file spoiled rank 2's rebuild and the checkpoint was lost. `ftidask verify` reports rank 0's file."""
    cfg = json.dumps(_config(4))
    base = tmp_path / "run"
    run(4, "levels_job.py", "shrink", cfg, str(base), "3", timeout=120)
    original = tmp_path / "original"
    shutil.copytree(base, original)
    l3 = lambda nodes, pattern: [p for p in _files(base, nodes, pattern) if p.parent.parent.name == "l3"]  # noqa: E731
    assert len(l3([0, 1, 2, 3], RANK)) == 4 and len(l3([0, 1, 2, 3], RSED)) == 4
    from ftidask.tools.cli import main

    assert main(["verify", str(l3([0], RANK)[0])]) == 0
    _flip_slack(l3([0], RANK)[0])
    capsys.readouterr()
    assert main(["verify", str(l3([0], RANK)[0])]) == 1  # its variables verify, its whole-file hash does not
    assert "whole-file hash" in capsys.readouterr().out
    l3([1], RSED)[0].unlink()
    l3([2], RANK)[0].unlink()
    run(4, "levels_job.py", "recover", cfg, str(base), timeout=120)
    results = [json.loads((base / f"result-{r}.json").read_text()) for r in range(4)]
    assert [(r["status"], r.get("source")) for r in results] == [("ok", [2, 3])] * 4, results
    assert len(list(find_paths(original, "Ckpt2-*.fti"))) == 8 and not _check_rebuilt(original, base, "slack", pattern="Ckpt2-*.fti")


# Copy-on-write at every level in the default run; the copy and blocking snapshots (the same background work,
# another snapshot) at every level with the slow tests, at L1 and L3 in the default run too.
@pytest.mark.parametrize(("level", "mechanism"), [
    pytest.param(level, mechanism, marks=[pytest.mark.slow] if mechanism != "cow" and level in (2, 4) else [])
    for mechanism in ("cow", "copy", "blocking") for level in (1, 2, 3, 4)])
def test_levels_4_ranks_async(tmp_path: Path, level: int, mechanism: str) -> None:
    """The checkpoint returns after its snapshot, taken by each mechanism in turn (the job checks the handle
    names it); the ranks overwrite their arrays at once: the same matrix."""
    config = {**_config(4), "async_ckpt": 1, "async_snapshot": mechanism}
    _check_level(tmp_path, 4, level, timeout=180, config=config)


@pytest.mark.parametrize("level", [2, 3])
def test_rank_killed_with_an_async_checkpoint_in_flight(tmp_path: Path, level: int) -> None:
    """SIGKILL of a rank while checkpoint 3 is in flight, its node's files lost: the restart recovers
    checkpoint 2 or 3 whole on every rank (rebuilt by the level), never a mix."""
    proc = run(4, "async_kill_job.py", "run", str(tmp_path), str(level), "3", timeout=120, check=False)
    assert proc.returncode != 0, "the job should have been torn down by the killed rank"
    shutil.rmtree(tmp_path / "Local" / "node3", ignore_errors=True)
    run(4, "async_kill_job.py", "recover", str(tmp_path), str(level), timeout=120)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    assert all(r["status"] == "ok" for r in results), results
    values = {tuple(r["values"]) for r in results}
    assert values in ({(2.0,)}, {(3.0,)}), values


@pytest.mark.slow
@pytest.mark.timeout(1300)  # two jobs of up to 600 s each (16 ranks on a 2-core machine): not cut at pytest's 300
@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_levels_16_ranks(tmp_path: Path, level: int) -> None:
    _check_level(tmp_path, 16, level, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(1300)  # two jobs of up to 600 s each
@pytest.mark.parametrize("level", kept([1, 2, 3, 4], [3]))  # the others: -m campaign (CI's budget)
def test_levels_16_ranks_async(tmp_path: Path, level: int) -> None:
    _check_level(tmp_path, 16, level, timeout=600, config={**_config(16), "async_ckpt": 1})


# Two groups of two nodes (0-1 and 2-3): each group repairs itself, whatever happens to the other.
TWO_GROUPS = {
    "node0_erased": (erase_nodes([0]), (None, OK, OK, None)),
    "nodes0_2_erased": (erase_nodes([0, 2]), (None, OK, OK, None)),
    "nodes1_3_erased": (erase_nodes([1, 3]), (None, OK, OK, None)),
    "nodes0_1_erased": (erase_nodes([0, 1]), (None, FAIL, FAIL, None)),  # a whole group
    "rank_and_parity_node0": (both(erase([0], RANK), erase([0], RSED)), (None, None, OK, None)),
}


@pytest.mark.parametrize("level", [2, 3])
def test_two_groups_of_two(tmp_path: Path, level: int) -> None:
    config = {"local_test": 1, "node_size": 1, "group_size": 2, "block_size": 64, "transfer_size": 1}
    _check_level(tmp_path, 4, level, timeout=180, config=config, table=TWO_GROUPS)
