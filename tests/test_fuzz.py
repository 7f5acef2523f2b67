"""Fuzzing the reader: any damage gives the exact data back or a FormatError, nothing else.

Over ftidask's own files (plain, differential, compressed), a file of FTI 1.1's layout built from the
format's description, files written by FTI's own C code (metadata at the end: tests/data/fti_written), and
one of FTI 1.6/master's layout built from its sources (ftiff_builders.fti_master_file).
"""

import json
import struct
from pathlib import Path

import numpy as np
from ftiff_builders import fti11_file, fti_master_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.ftiff.reader import parse_ftiff, read_into, verify_data
from ftidask.model.arrays import ArrayBytes
from ftidask.storage.files import find_paths

_FILES: dict[str, bytes] = {}


_FTI_WRITTEN = Path(__file__).parent / "data" / "fti_written"
KINDS = ["plain", "dcp", "zstd", "fti11", "fti_196f77d2", "fti_8e2e72fc", "fti_master_built"]


def _sample(tmp_path_factory, kind):
    if kind == "fti11" and kind not in _FILES:  # var 1 grew (two containers), var 2 shrank (partly filled)
        a, b = np.arange(1000, dtype=np.int32), np.linspace(0, 1, 300)
        _FILES[kind] = fti11_file({1: a.tobytes(), 2: b.tobytes()},
                                  [[(1, 0, 0, 0, 2400), (2, 1, 0, 0, 3200)], [(1, 0, 1, 2400, 1600)]])
    elif kind == "fti_master_built" and kind not in _FILES:  # FTI 1.6/master, from its sources: grown, shrunk, empty
        blocks = [[(1, 0, 0, 160), (2, 0, 0, 40), (3, 0, 0, 48)], [(1, 1, 160, 40), (3, 1, 48, 8)]]
        _FILES[kind] = fti_master_file({1: bytes(range(200)), 2: b"x" * 24, 3: bytes(48)}, blocks)
    elif kind.startswith("fti_") and kind not in _FILES:
        # 196f77d2: its third checkpoint (three blocks, an empty container); 8e2e72fc: its first, the one of its
        # files its own writer leaves sound (README there)
        name = "r2/Ckpt3-Rank1.fti" if kind == "fti_196f77d2" else "c8e2e72f/r2/Ckpt1-Rank1.fti"
        _FILES[kind] = (_FTI_WRITTEN / name).read_bytes()
    if kind not in _FILES:
        root = tmp_path_factory.mktemp(kind)
        cfg = dict(ckpt_dir=str(root / "L"), glbl_dir=str(root / "G"), meta_dir=str(root / "M"), verbosity=4)
        if kind == "dcp":
            cfg.update(enable_dcp=1, dcp_block_size=512)
        if kind == "zstd":
            cfg.update(compressor="zstd")
        ctx = ftidask.init(**cfg)
        ctx.protect(1, np.arange(700, dtype=np.float64))
        ctx.protect(2, np.zeros(5, dtype=[("a", "<i2"), ("b", "<f4", (2,))]))
        ctx.checkpoint(1, 5 if kind == "dcp" else 1)
        ctx.protect(2, np.ones(40, dtype=[("a", "<i2"), ("b", "<f4", (2,))]))
        info = ctx.checkpoint(2, 5 if kind == "dcp" else 1)
        (path,) = find_paths(root / "L", f"ckpt2.s{info.seq}/*.fti")  # ckpt 1 may be being deleted
        _FILES[kind] = path.read_bytes()
    return _FILES[kind]


def _read(path):
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
        out = {vid: info.empty() for vid, info in parsed.vars.items()}
        if not parsed.vars:  # FTI's files have no variable table: their bytes
            out = {vid: np.empty(n, np.uint8) for vid, n in parsed.var_nbytes().items()}
        read_into(fh, parsed, {vid: ArrayBytes(a) for vid, a in out.items()})
    return out


mutations = st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "grow", "json"]), st.integers(0, 2**31),
                               st.integers(0, 255)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), ops=mutations)
def test_any_damage_is_detected_or_harmless(tmp_path_factory, kind, ops):
    good = _sample(tmp_path_factory, kind)
    raw = bytearray(good)
    for op, pos, val in ops:
        pos %= len(raw) if raw else 1
        if op == "flip" and raw:
            raw[pos] ^= (val or 1)
        elif op == "set" and raw:
            raw[pos:pos + 8] = struct.pack("<q", (val << 40) - 1)[: len(raw[pos:pos + 8])]
        elif op == "cut":
            del raw[pos:]
        elif op == "grow":
            raw += bytes([val]) * (pos % 5000)
        elif op == "json":  # a lying table with valid-looking structure
            raw = raw.replace(b'"shape":[', b'"shape":[' + str(val).encode() + b",", 1)
    path = tmp_path_factory.mktemp("f") / "Ckpt2-Rank0.fti"
    path.write_bytes(bytes(raw))
    try:
        out = _read(path)
    except ftidask.FormatError:
        return
    # Accepted: it must be exactly the original content.
    ref_path = path.with_name("ref.fti")
    ref_path.write_bytes(good)
    ref = _read(ref_path)
    if kind.startswith("fti_"):
        # FTI's container records carry no hash (its format; tailmeta's docstring): a changed id cannot be told
        # from a real one (an empty container's id included). Every variable's bytes must still be one of the
        # original variables', whole.
        assert sorted(a.tobytes() for a in out.values() if a.nbytes) == sorted(a.tobytes() for a in ref.values())
        return
    assert set(out) == set(ref)
    for vid in ref:
        assert out[vid].tobytes() == ref[vid].tobytes() and out[vid].dtype == ref[vid].dtype


def test_deeply_nested_table_is_a_format_error(tmp_path, dirs):
    from ftidask.ftiff.trailer import parse_trailer

    payload = ("[" * 100000 + "]" * 100000).encode()
    try:
        parse_trailer(payload)
    except ftidask.FormatError:
        pass
    deep = {"vars": [{"id": 1, "name": "x", "dtype": json.loads('{"base":' * 50 + '"<f8"' + ',"shape":[1]}' * 50),
                      "shape": [1], "order": "C", "nbytes": 8}]}
    from ftidask.model.arrays import VarInfo

    try:
        VarInfo.from_json(deep["vars"][0])
    except ftidask.FormatError:
        pass


def test_every_sample_reads_whole_before_damage(tmp_path_factory, tmp_path):
    """The fuzzed samples are sound to begin with, and hold data (a sample read as empty would test nothing)."""
    for kind in KINDS:
        path = tmp_path / f"{kind}.fti"
        path.write_bytes(_sample(tmp_path_factory, kind))
        out = _read(path)
        assert out and sum(a.nbytes for a in out.values()) > 0, kind
