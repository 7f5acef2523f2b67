"""Forged, not damaged: files whose every hash was recomputed after hostile values were put in their records.

A random flip is caught by a hash; a forger recomputes them. What stands then is the structure checks: FTI's
container records (which carry no hash in FTI's format) with sizes of terabytes, offsets pointing backwards,
overlapping containers, counts of 2**63; the file metadata record's sizes; FTI's parity record; ftidask's own
file with its FB hash and checksum recomputed; a commit record resealed. Each must give a clean ftidask error
(nothing else escapes), allocate no more than the file's real size, touch no array when refused, and when
accepted give exactly the bytes whose MD5 the file records (an id or dptr changed in an FTI record cannot be told
from a real one, by FTI's reader either: every variable must still be made of original chunks, whole).
"""

import copy
import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from ftiff_builders import RECORDS, fti_record, fti_rsed_file, fti_tail_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask
from ftidask.ftiff import hashing
from ftidask.ftiff.ftiparity import sniff_parity
from ftidask.ftiff.reader import parse_ftiff, read_into, verify_data
from ftidask.ftiff.structs import FB_SIZE, BlockMeta, ContainerMeta, FileBlock
from ftidask.ftiff.trailer import pack_trailer
from ftidask.model.arrays import ArrayBytes

HOSTILE = st.sampled_from([0, -1, 1, 7, 24, 64, 88, 2**31 - 1, -2**31, 2**40, 2**62, 2**63 - 1, -2**63])
SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
VARS = {0: bytes(range(64)), 1: bytes(range(100, 188)), 2: b"abc" * 8, 4: bytes(range(32))}
LAYOUT = [[(0, 0, 0, 64), (1, 0, 0, 64), (2, 0, 0, 40), (4, 0, 0, 32)], [(1, 1, 64, 24), (4, 1, 32, 16)]]
_FIELDS = {"id": 0, "containerid": 2, "hascontent": 3, "dptr": 5, "fptr": 6, "chunksize": 7, "containersize": 8}


def _read(path: Path) -> dict[int, bytes]:
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
        verify_data(fh, parsed)
        out = {vid: np.empty(n, np.uint8) for vid, n in parsed.var_nbytes().items()}
        read_into(fh, parsed, {vid: ArrayBytes(a) for vid, a in out.items()})
    return {vid: a.tobytes() for vid, a in out.items()}


def _checked(path: Path, size: int) -> dict[int, bytes] | None:
    """The file's variables, or None when refused with a FormatError; nothing else escapes, nothing large is
    allocated."""
    tracemalloc.start()
    try:
        return _read(path)
    except ftidask.FormatError:
        return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < (40 << 20) + 4 * size, peak  # fixed read buffers (16 MiB), nothing of a claimed size


def _pieces(variables: dict[int, bytes]) -> bool:
    """Every variable read is made of original chunks, each whole, none twice (an id, dptr or size changed in FTI's
    unhashed records moves or drops a verified chunk, as FTI's own reader would take it; it never changes a byte,
    and a recovery refuses a variable whose size then differs from the protected array's)."""
    chunks = sorted(VARS[vid][dptr:dptr + size] for block in LAYOUT for vid, _c, dptr, size in block
                    if VARS[vid][dptr:dptr + size])

    def split(value: bytes, left: list[bytes]) -> list[bytes] | None:
        if not value:
            return left
        for i, chunk in enumerate(left):
            if value.startswith(chunk):
                rest = split(value[len(chunk):], left[:i] + left[i + 1:])
                if rest is not None:
                    return rest
        return None

    left: list[bytes] | None = chunks
    for value in variables.values():
        left = split(value, left) if left is not None else None
    return left is not None


def _rerecord(raw: bytes, record: str, changes: list[tuple[int, str, int]], sizes: dict[str, int]) -> bytes:
    """``raw`` (an fti_tail_file) with container fields changed and its checksum, record and myHash redone."""
    spec = RECORDS[record]
    stride = 58 if record == "master" else 62
    data_size = sum(c[3] for block in LAYOUT for c in block)
    meta = bytearray(raw[data_size:len(raw) - spec["area"]])
    fmt = "<iiBBQQqq16s" if record == "master" else "<iiiBBQQqq16s"
    offsets, pos = [], 0
    for block in LAYOUT:
        offsets += [pos + 12 + stride * i for i in range(len(block))]
        pos += 12 + stride * len(block)
    for index, field, value in changes:
        at = offsets[index % len(offsets)]
        fields = list(struct.unpack_from(fmt, meta, at))
        slot = _FIELDS[field] - (1 if record == "master" and _FIELDS[field] > 1 else 0)  # master: no idx
        bounds = {"B": (0, 255), "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1), "q": (-2**63, 2**63 - 1)}
        lo, hi = bounds[fmt[1:][slot]]
        fields[slot] = min(max(value % 2**64 if fmt[1:][slot] == "Q" else value, lo), hi)
        struct.pack_into(fmt, meta, at, *fields)
    hashes = [struct.unpack_from(fmt, meta, at)[-1] for at in offsets]
    meta_size = len(meta) + spec["area"]
    fs = data_size + meta_size
    values = dict(ckpt_size=fs, meta_size=meta_size, data_size=data_size, fs=fs) | sizes
    return raw[:data_size] + bytes(meta) + fti_record(record, hashlib.md5(b"".join(hashes)).hexdigest(), **values)


@SETTINGS
@given(record=st.sampled_from(sorted(RECORDS)),
       changes=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(sorted(_FIELDS)), HOSTILE), max_size=3),
       sizes=st.dictionaries(st.sampled_from(["ckpt_size", "meta_size", "data_size", "fs", "max_fs", "pt_fs"]),
                             HOSTILE, max_size=2))
def test_forged_fti_records_are_refused_or_read_exactly(tmp_path_factory, record, changes, sizes):
    raw = _rerecord(fti_tail_file(VARS, LAYOUT, record=record), record, changes, sizes)
    path = tmp_path_factory.mktemp("fti") / "Ckpt3-Rank0.fti"
    path.write_bytes(raw)
    got = _checked(path, len(raw))
    if got is not None:
        assert _pieces(got), (changes, sizes)
        if not changes:
            assert got == VARS


@SETTINGS
@given(record=st.sampled_from(["1.1", "196f77d2", "master"]), cut=st.integers(-3, 3),
       rank_size=HOSTILE, parity_len=st.integers(0, 512))
def test_forged_parity_records_are_never_read_as_data(tmp_path_factory, record, cut, rank_size, parity_len):
    """An FTI parity file, its record saying anything (hash redone), shifted or not: always refused (it is no
    checkpoint); taken for a parity file only when the record describes the file exactly."""
    raw = fti_rsed_file((bytes(range(256)) * 2)[:parity_len], rank_size, record=record)
    raw = raw[cut:] if cut > 0 else bytes(-cut) + raw
    path = tmp_path_factory.mktemp("rsed") / "Ckpt1-RSed0.fti"
    path.write_bytes(raw)
    assert _checked(path, len(raw)) is None
    with open(path, "rb") as fh:
        found = sniff_parity(fh.fileno(), len(raw))
    assert (found is not None) == (cut == 0 and 0 <= rank_size <= parity_len)


def _own_file(tmp_path: Path) -> tuple[bytes, np.ndarray, np.ndarray]:
    dirs = {"ckpt_dir": str(tmp_path / "L"), "glbl_dir": str(tmp_path / "G"), "meta_dir": str(tmp_path / "M"),
            "verbosity": 4}
    ctx = ftidask.init(**dirs)
    a, b = np.arange(100.0), np.arange(12, dtype=np.int32).reshape(3, 4)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 1)
    a = np.arange(150.0)  # grown: a second block
    ctx.protect(1, a)
    info = ctx.checkpoint(2, 1)
    (path,) = (tmp_path / "L").glob(f"node0/*/l1/ckpt2.s{info.seq}/Ckpt2-Rank0.fti")
    raw = path.read_bytes()
    ctx.finalize()
    return raw, a, b


_OWN: dict[str, tuple[bytes, np.ndarray, np.ndarray]] = {}


def _reforged(raw: bytes, block_changes, table_changes, fb_changes) -> bytes:
    """``raw`` with its block and container records and table changed, the checksum and FB hash redone."""
    fb = FileBlock.unpack(raw[:FB_SIZE])
    body, offset, records = bytearray(raw[FB_SIZE:fb.fs]), FB_SIZE, []
    while offset < fb.fs:
        bmd = BlockMeta.unpack(raw[offset:offset + 12])
        records.append((offset - FB_SIZE, [bmd.numvars, bmd.dbsize],
                        [list(ContainerMeta.unpack(raw[offset + 12 + 64 * i:offset + 76 + 64 * i]).__dict__.values())
                         for i in range(bmd.numvars)]))
        offset += bmd.dbsize
    for (where, index, value) in block_changes:
        at, head, metas = records[where % len(records)]
        if index < 2:
            head[index] = max(min(value, 2**31 - 1 if index == 0 else 2**63 - 1), -2**31 if index == 0 else -2**63)
        else:
            meta = metas[index % len(metas)]
            field = index % 8
            meta[field] = bool(value) if field == 3 else max(min(value, 2**31 - 1 if field < 3 else 2**63 - 1),
                                                              -2**31 if field < 3 else -2**63)
    checksum = hashing.new_hasher(fb.hash_id)
    for at, head, metas in records:
        rec = BlockMeta(*head).pack() + b"".join(ContainerMeta(*m).pack() for m in metas)
        body[at:at + len(rec)] = rec
        checksum.update(rec)
    length = struct.unpack("<Q", raw[-16:-8])[0]
    table = json.loads(raw[-16 - length:-16])
    for index, key, value in table_changes:
        table["vars"][index % len(table["vars"])][key] = value
    tail = pack_trailer(json.dumps(table).encode())
    checksum.update(tail)
    fields = {"checksum": checksum.hexdigest()[:32]} | dict(fb_changes)
    return FileBlock(**(fb.__dict__ | fields)).sealed().pack() + bytes(body) + tail


TABLE_VALUES = {"nbytes": HOSTILE, "shape": st.sampled_from([[2**40], [-1], [0], [2**31, 2**31], [1] * 40, [150]]),
                "dtype": st.sampled_from(["<f8", "|O", "V8", "V0", "<U0", "M8[ns]", "<i4"]),
                "id": st.sampled_from([1, 2, 3, 2**40, -1]), "order": st.sampled_from(["C", "F", "K"]),
                "extra": st.sampled_from([{}, {"codec": {"id": "zstd"}}, {"codec": {"id": "pickle"}}, {"plain": [0]}])}


@pytest.mark.slow  # about 4 s: a context per example
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(block_changes=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 9), HOSTILE), max_size=3),
       table_changes=st.lists(st.sampled_from(sorted(TABLE_VALUES)).flatmap(
           lambda key: st.tuples(st.integers(0, 1), st.just(key), TABLE_VALUES[key])), max_size=2),
       fb_changes=st.lists(st.tuples(st.sampled_from(["fs", "ckpt_size", "max_fs", "pt_fs"]), HOSTILE), max_size=1))
def test_forged_ftidask_file_is_refused_untouched_or_recovered_exactly(tmp_path_factory, block_changes,
                                                                       table_changes, fb_changes):
    if "raw" not in _OWN:
        _OWN["raw"] = _own_file(tmp_path_factory.mktemp("own"))
    raw, a, b = _OWN["raw"]
    forged = _reforged(raw, block_changes, copy.deepcopy(table_changes), fb_changes)
    root = tmp_path_factory.mktemp("forged")
    path = root / "Ckpt2-Rank0.fti"
    path.write_bytes(forged)
    ctx = ftidask.init(ckpt_dir=str(root / "L"), glbl_dir=str(root / "G"), meta_dir=str(root / "M"), verbosity=4)
    x, y = np.full(150, -7.0), np.full((3, 4), -7, np.int32)
    ctx.protect(1, x)
    ctx.protect(2, y)
    tracemalloc.start()
    try:
        ctx.recover_file(path)
        accepted = True
    except (ftidask.FormatError, ftidask.RecoveryError):
        accepted = False
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        ctx.finalize()
    assert peak < 32 << 20
    if not accepted:
        assert (x == -7).all() and (y == -7).all(), "a refused recovery touched an array"
    elif not any(key == "order" for _i, key, _v in table_changes):  # a file may hold its bytes in F order
        assert x.tobytes() == a.tobytes() and y.tobytes() == b.tobytes()
