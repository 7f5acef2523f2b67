"""I/O faults at the write and read sites that the other tests leave out (disk full, a file replaced by a
directory, a read error), injected for real: a small full tmpfs (root only, see ``diskfull``), a directory
planted at a file's name, or a read error on one file's inode (a seam on :func:`storage.open_regular`).

Each fault must end in a clear ftidask error that says what and where, or be repaired by the level's
redundancy; the previous checkpoint stays recoverable and the context works once the fault is gone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from diskfull import fill, tmpfs

from ftidask.levels import multilevel
from ftidask.model.config import Config
from ftidask.storage import files as storage
from ftidask.transport.threads import run_group

CKPT = 1
CFG = Config(block_size=1, transfer_size=1)  # 1 KiB stripes, 1 MiB pieces


# --- L2/L3 rebuild, in one process (the level code over a group of threads) -------------------------------


def _own(base: Path, i: int) -> Path:
    return base / f"node{i}" / storage.rank_file(CKPT, i)


def _group(base: Path, level: int, sizes: list[int]) -> dict[int, bytes]:
    """Every member's file and the level's redundancy; the files' bytes."""
    rng = np.random.default_rng(7)
    data = {}
    for i, n in enumerate(sizes):
        _own(base, i).parent.mkdir(parents=True, exist_ok=True)
        data[i] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        _own(base, i).write_bytes(data[i])

    def protect(ch):
        return multilevel.protect(ch, CFG, level, CKPT, ch.index, _own(base, ch.index), _own(base, ch.index).parent,
                                  sizes)

    results, errors = run_group(len(sizes), protect)
    assert errors == [] and not any(results), (errors, results)
    return data


def _rebuild(base: Path, level: int, sizes: list[int], data: dict[int, bytes], errors: list[list[str]] | None = None):
    def sound(i: int):
        digest = hashlib.sha256(data[i]).digest()
        return lambda p: p.is_file() and hashlib.sha256(p.read_bytes()).digest() == digest

    def step(ch):
        i, g = ch.index, ch.size
        found = {} if errors is None else {"errors": errors[i]}
        return multilevel.rebuild(ch, CFG, level, CKPT, i, _own(base, i), _own(base, i).parent, sizes,
                                  sound(i)(_own(base, i)), verify_own=sound(i), verify_partner=sound((i - 1) % g),
                                  **found)

    results, failures = run_group(len(sizes), step)
    assert failures == []
    return results


@pytest.mark.parametrize("level", [2, 3])
def test_a_directory_in_place_of_a_rank_file_is_rebuilt_over(tmp_path, level):
    """A rank file replaced by a directory (a node's file system damaged, or a wrong copy) is a lost file:
    the level brings it back, the directory moved out of its way."""
    sizes = [3000, 5000, 4000]
    data = _group(tmp_path, level, sizes)
    victim = _own(tmp_path, 1)
    victim.unlink()
    victim.mkdir()
    (victim / "inside").write_bytes(b"x")
    assert _rebuild(tmp_path, level, sizes, data) == [True, True, True]
    assert victim.read_bytes() == data[1]
