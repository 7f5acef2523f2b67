"""A restart on another number of ranks (3 -> 2) into arrays of restart size: bit for bit, the fresh array's
verified pages moved under it (no copy after the verification), arrays that cannot take pages copied; a damaged
container refused on every rank with the fresh array's pages never touched and the array in use as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_util import need_mpi, run

from ftidask.ftiff.reader import parse_ftiff
from ftidask.storage.files import find_paths

pytestmark = need_mpi()


def _results(base: Path) -> list[dict]:
    return [json.loads((base / f"result-{r}.json").read_text()) for r in range(2)]


@pytest.fixture
def written(tmp_path: Path) -> Path:
    run(3, "reshard_pages_job.py", "write", str(tmp_path), timeout=240)
    return tmp_path


def test_fresh_arrays_take_the_verified_pages(written: Path) -> None:
    run(2, "reshard_pages_job.py", "recover", str(written), timeout=240)
    for r in _results(written):
        assert r["fresh_before"] and "error" not in r, r
        assert r["equal"] == {"1": True, "2": True, "3": True}, r
        assert r["moved"] >= (3 << 20) * 8 - 8192, r  # variable 1's whole pages (24 MiB a rank) moved, not copied


def test_a_damaged_container_touches_no_array(written: Path) -> None:
    path = next(iter(find_paths(written, "Ckpt1-Rank2.fti")))  # old rank 2: the second new rank reads it
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    meta = next(m for _b, _c, m in parsed.containers() if m.id == 1 and m.chunksize)
    with open(path, "r+b") as fh:
        fh.seek(meta.fptr + meta.chunksize - 5)  # the last bytes: read after most of the pieces
        fh.write(b"\xff\xfe\xfd\xfc\xfb")
    run(2, "reshard_pages_job.py", "recover", str(written), timeout=240)
    for r in _results(written):
        assert "damaged data" in r["error"] or "hash" in r["error"], r
        assert r["fresh_untouched"] and r["in_use_untouched"], r
