"""Hostile reads, fifth campaign: the readers changed for thousands of variables (a Zarr store's manifest grouped by
array, a parsed file's per-variable index and memo, a Dask worker's per-container read of a differential file's
block-hash section) given hostile input.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def _two_checkpoints(dirs: dict, n: int = 40, **cfg) -> None:
    """Checkpoints 1 and 2 of ``n`` small variables (2 holds 1's values + 1000), the run closed as a job ends."""
    import numpy as np

    import ftidask

    ctx = ftidask.init(**dirs, **cfg)
    arrays = {i: np.arange(1 + i % 9, dtype=np.float64) + i for i in range(n)}
    for i, a in arrays.items():
        ctx.protect(i, a)
    dcp = 4 if cfg.get("enable_dcp") else 0
    ctx.checkpoint(1, 4 + dcp)  # kept when checkpoint 2 (level 1) is written
    for a in arrays.values():
        a += 1000
    ctx.checkpoint(2, 1 + dcp)
    ctx._close()


def _swap_same_size(path, data: bytes) -> None:
    """``path`` replaced by a file of ``data`` (its size), renamed over it with the old modification time."""
    import os

    stat = os.stat(path)
    new = path.with_name(path.name + ".swap")
    new.write_bytes(data)
    os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.rename(new, path)


@pytest.mark.parametrize("how", ["flip_mtime_restored", "swapped_same_size", "truncated", "swapped_same_bytes"])
@pytest.mark.parametrize("cfg", [{}, {"enable_dcp": 1, "dcp_block_size": 512}, {"compressor": "zstd"}],
                         ids=["plain", "dcp", "zstd"])
def test_recover_var_notices_the_verified_file_changed_since(dirs, how, cfg):
    """recover_var() loads the newest checkpoint the last recovery verified as it is while its file is unchanged
    (ee8b748): a file changed since, even at the same size with its modification time put back, or replaced by a
    rename, must be verified again; a damaged one is passed over for the older checkpoint, never read into an array."""
    import os

    import numpy as np

    import ftidask
    from ftidask.ftiff.reader import parse_ftiff
    from ftidask.storage.files import find_paths

    _two_checkpoints(dirs, **cfg)
    (path,) = [p for p in find_paths(Path(dirs["ckpt_dir"]), "Ckpt2-Rank0.fti")]
    ctx = ftidask.init(**dirs, **cfg)
    out = {i: np.full(1 + i % 9, -7.0) for i in range(40)}
    for i, a in out.items():
        ctx.protect(i, a)
    ctx.recover_var(3)
    assert (out[3] == np.arange(4) + 1003).all()
    raw = path.read_bytes()
    with open(path, "rb") as fh:  # the first byte of variable 7's data
        at = next(m.fptr for _b, _c, m in parse_ftiff(fh, str(path)).containers() if m.id == 7 and m.chunksize)
    if how == "flip_mtime_restored":
        stat = os.stat(path)
        with open(path, "r+b") as fh:
            fh.seek(at)
            fh.write(bytes([raw[at] ^ 0xFF]))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    elif how == "swapped_same_size":
        _swap_same_size(path, raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:])
    elif how == "truncated":
        os.truncate(path, len(raw) - 1)
    else:
        _swap_same_size(path, raw)
    ctx.recover_var(7)
    want = np.arange(8, dtype=np.float64) + 7 + (1000 if how == "swapped_same_bytes" else 0)
    assert out[7].tobytes() == want.tobytes()
    ctx._close()


_DCP: dict[str, tuple] = {}


def _dcp_file(tmp_path_factory) -> tuple:
    """A differential file of 60 small variables (some grown: two containers, some empty), its parse, and every
    container's bytes as a Dask worker reads them."""
    if not _DCP:
        import numpy as np

        import ftidask
        from ftidask.backends.dask import tasks
        from ftidask.ftiff.blockhash import DcpInfo
        from ftidask.ftiff.reader import parse_ftiff
        from ftidask.model.arrays import dtype_to_json
        from ftidask.storage.files import find_paths

        root = tmp_path_factory.mktemp("dcp")
        ctx = ftidask.init(ckpt_dir=str(root / "L"), glbl_dir=str(root / "G"), meta_dir=str(root / "M"), verbosity=4,
                           enable_dcp=1, dcp_block_size=512)
        arrays = {i: np.arange((i * 7) % 23 * (i % 11 != 0), dtype=np.float64) + i for i in range(60)}
        for i, a in arrays.items():
            ctx.protect(i, a)
        ctx.checkpoint(1, 5)
        for i in range(0, 60, 5):  # grown: a second container each
            arrays[i] = np.arange(100 + i, dtype=np.float64) - i
            ctx.protect(i, arrays[i])
        info = ctx.checkpoint(2, 5)
        (path,) = find_paths(root / "L", f"ckpt2.s{info.seq}/*.fti")
        raw = path.read_bytes()
        ctx.finalize()
        path = root / "Ckpt2-Rank0.fti"
        path.write_bytes(raw)
        with open(path, "rb") as fh:
            parsed = parse_ftiff(fh, str(path))
        fb = parsed.fb.hash.hex()
        chunks = {}
        for bi, ci, m in parsed.containers():
            if m.hascontent and m.chunksize:
                chunks[bi, ci] = (m, tasks.read_chunk(str(path), m.id, m.dptr, dtype_to_json(np.dtype("<f8")),
                                                      [m.chunksize // 8], fb).tobytes())
        _DCP.update(raw=raw, fb=fb, info=DcpInfo(parsed), chunks=chunks)
    return _DCP["raw"], _DCP["fb"], _DCP["info"], _DCP["chunks"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10**6), at=st.integers(0, 10**6), bit=st.integers(0, 7), section=st.booleans())
def test_a_dask_read_of_a_differential_chunk_checks_only_its_own_digests(tmp_path_factory, which, at, bit, section):
    """A Dask worker reads one chunk of a differential file with that container's digests only (0deab17): a bit of a
    container's data, or of its digests in the block-hash section, flipped: that chunk is refused (FormatError), every
    other chunk of the file reads exactly as before."""
    import numpy as np

    from ftidask.backends.dask import parsecache, tasks
    from ftidask.model.arrays import dtype_to_json
    from ftidask.model.errors import FormatError

    raw, fb, info, chunks = _dcp_file(tmp_path_factory)
    keys = sorted(chunks)
    key = keys[which % len(keys)]
    meta = chunks[key][0]
    data = bytearray(raw)
    if section:
        start, count = info.spans[key]
        data[info.offset + start + at % (count * info.digest_size)] ^= 1 << bit
    else:
        data[meta.fptr + at % meta.chunksize] ^= 1 << bit
    path = tmp_path_factory.mktemp("damaged") / "Ckpt2-Rank0.fti"
    path.write_bytes(bytes(data))
    parsecache.forget()
    for other in keys:
        m, want = chunks[other]
        read = lambda m=m: tasks.read_chunk(str(path), m.id, m.dptr, dtype_to_json(np.dtype("<f8")),  # noqa: E731
                                            [m.chunksize // 8], fb).tobytes()
        if other == key:
            with pytest.raises(FormatError):
                read()
        else:
            assert read() == want


@pytest.mark.parametrize("codec", ["zstd", "blosc"])
def test_a_compressed_chunk_file_larger_than_any_chunk_compresses_to_is_refused_unread(tmp_path, codec):
    """A store (its manifest resealed) whose compressed chunk file is 256 MiB of holes, its codec header intact: the
    file was hashed, then read whole to be decoded, twice over (512 MiB allocated for a chunk of 32 bytes; a sparse
    file of terabytes costs its forger nothing). A chunk file larger than its codec can make a chunk is refused before
    it is read."""
    pytest.importorskip("zarr")
    import json

    import numpy as np

    from ftidask.model.arrays import VarInfo
    from ftidask.zarrfmt import store

    info = VarInfo.from_json({"id": 1, "name": "a", "dtype": "<f8", "shape": [4], "order": "C", "nbytes": 32,
                              "extra": {"codec": {"id": codec}}})
    path = tmp_path / "s.zarr"
    store.write_store(path, {1: np.arange(4.0)}, [info], {})
    manifest = json.loads((path / store.MANIFEST).read_text())
    (chunk,) = [rel for rel in manifest["files"] if rel.startswith("a/c")]
    _padded_is_refused_unread(path, chunk, 256 << 20)


@pytest.mark.parametrize("meta", ["zarr.json", "a/zarr.json"])
def test_a_zarr_metadata_file_larger_than_any_record_is_refused_unread(tmp_path, meta):
    """A store (its manifest resealed) whose zarr.json is 300 MiB of holes after its JSON: Zarr read it whole to open
    the array, three times over (900 MiB allocated; a sparse file of terabytes costs its forger nothing). A metadata
    file larger than any record ftidask reads back (the manifest's own limit) is refused before it is read."""
    pytest.importorskip("zarr")

    import numpy as np

    from ftidask.model.arrays import VarInfo
    from ftidask.zarrfmt import store

    info = VarInfo.from_json({"id": 1, "name": "a", "dtype": "<f8", "shape": [4], "order": "C", "nbytes": 32})
    path = tmp_path / "s.zarr"
    store.write_store(path, {1: np.arange(4.0)}, [info], {})
    _padded_is_refused_unread(path, meta, 300 << 20)


def test_a_store_whose_metadata_no_reader_would_take_is_not_written(tmp_path, monkeypatch):
    """What verify_store refuses is never written: a zarr.json larger than any record (here made 1 KiB) fails the
    write, and nothing is left at the store's path."""
    pytest.importorskip("zarr")
    import numpy as np

    from ftidask.model.arrays import VarInfo
    from ftidask.storage import files
    from ftidask.zarrfmt import store

    monkeypatch.setattr(files, "MAX_RECORD", 1024)
    info = VarInfo.from_json({"id": 1, "name": "a", "dtype": "<f8", "shape": [4], "order": "C", "nbytes": 32})
    with pytest.raises(OSError, match="zarr.json"):
        store.write_store(tmp_path / "s.zarr", {1: np.arange(4.0)}, [info], {})
    assert not (tmp_path / "s.zarr").exists()


def _padded_is_refused_unread(path, rel: str, size: int) -> None:
    """File ``rel`` of store ``path`` padded with holes to ``size`` bytes and the manifest resealed for it: the store
    is refused ("larger than") while under 48 MiB is allocated."""
    import json
    import os
    import tracemalloc

    from ftidask.model.errors import FormatError
    from ftidask.zarrfmt import store

    manifest = json.loads((path / store.MANIFEST).read_text())
    os.truncate(path / rel, size)
    manifest["files"][rel] = list(store._file_digest(path / rel))
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="larger than"):
            store.verify_store(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 48 << 20, peak
