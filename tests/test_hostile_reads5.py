"""Hostile reads, fifth campaign: the readers changed for thousands of variables (a Zarr store's manifest grouped by
array, a parsed file's per-variable index and memo, a Dask worker's per-container read of a differential file's
block-hash section) given hostile input.
"""

from __future__ import annotations

import random

import pytest

from ftidask.zarrfmt.checks import _files_by_array


def _by_prefix(files: list[str], names: set[str]) -> dict[str, list[str]]:
    """What each array's check took before: the files whose path starts with the array's name and a slash."""
    out: dict[str, list[str]] = {}
    for name in sorted(names):
        found = [rel for rel in files if rel.startswith(f"{name}/")]
        if found:
            out[name] = found
    return out


@pytest.mark.timeout(120)  # the quadratic grouping took hours here: a hang, not a failure, without it
def test_a_manifest_path_of_a_million_slashes_is_grouped_in_one_pass():
    """A manifest (trusted by no commit record: 'ftidask verify STORE') lists a path of many slashes under an array:
    the grouping of the files by array sliced and hashed the path at each slash, O(n^2) for one path of n bytes
    (4,000 slashes, the most a file system opens: 8 ms a path, and 256 MiB of such paths a hang of minutes)."""
    hostile = "a" + "/" * 2_000_000 + "c/0"
    files = {"a/c/0": [8, "x"], hostile: [8, "x"], "zarr.json": [1, "y"], "a/zarr.json": [1, "z"]}
    got = _files_by_array({"files": files}, {"a"})
    assert got == {"a": ["a/c/0", hostile, "a/zarr.json"]}


def test_files_are_grouped_under_every_array_whose_name_prefixes_them():
    rng = random.Random(5)
    parts = ["a", "b", "a/b", "c", "", ".", "x y", "é"]
    names = {"a", "a/b", "b/c", "é", "c/a/b"}
    files = ["/".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(3000)]
    files = list(dict.fromkeys(files))  # a manifest's keys: each once, in its order
    assert _files_by_array({"files": {rel: [0, ""] for rel in files}}, names) == _by_prefix(files, names)


@pytest.mark.parametrize("rel", ["a/" + "x" * 300, "x" * 5000, "a/" + "y/" * 3000 + "0"])
def test_a_manifest_entry_no_file_system_can_name_is_a_format_error(tmp_path, rel):
    """A manifest listing a path with a component of more than 255 bytes (or longer than any path): looking for the
    file raised OSError (ENAMETOOLONG) raw out of verify_store, so read_zarr of such a store gave a traceback."""
    pytest.importorskip("zarr")
    import json

    import numpy as np

    from ftidask.model.arrays import VarInfo
    from ftidask.model.errors import FormatError
    from ftidask.zarr_export import read_zarr
    from ftidask.zarrfmt import store

    info = VarInfo.from_json({"id": 1, "name": "a", "dtype": "<f8", "shape": [4], "order": "C", "nbytes": 32})
    path = tmp_path / "s.zarr"
    store.write_store(path, {1: np.arange(4.0)}, [info], {})
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"][rel] = [8, "00" * 16]
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="s.zarr"):
        store.verify_store(path)
    with pytest.raises(FormatError):
        read_zarr(path)
