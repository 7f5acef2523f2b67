"""Hostile reads, fourth campaign: a forged Python state (a numpy.random Generator's), its container hash and the
file's checksum recomputed, so that only the state's own checks stand between it and the generator.

A bit generator's state holds arrays, written as ``{"__ndarray__": dtype, "shape": [...], "values": [...]}``. The
dtype, shape and values were taken as they came: a dtype of 2**31 - 1 bytes per element made a few values an
allocation of gigabytes (``np.array(values, dtype)``), and an array where the bit generator wants an int made its
state setter raise IndexError, which escaped ``recover_file`` raw. Each is a RecoveryError that touches nothing.
"""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.ftiff import hashing
from ftidask.ftiff.reader import parse_ftiff
from ftidask.ftiff.structs import FB_SIZE, BlockMeta, ContainerMeta, FileBlock
from ftidask.model.errors import RecoveryError


def _generator_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A checkpoint file holding variable 1, a PCG64 Generator's state; the file and that state's bytes."""
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                       verbosity=4)
    ctx.protect(1, np.random.default_rng(7))
    info = ctx.checkpoint(1, 1)
    (path,) = (tmp_path / "L").glob(f"node0/*/l1/ckpt1.s{info.seq}/Ckpt1-Rank0.fti")
    forged = tmp_path / "Ckpt1-Rank0.fti"
    forged.write_bytes(path.read_bytes())
    ctx.finalize()
    with open(forged, "rb") as fh:
        parsed = parse_ftiff(fh, str(forged))
    ((_bi, _ci, meta),) = [c for c in parsed.containers() if c[2].id == 1]
    return forged, forged.read_bytes()[meta.fptr:meta.fptr + meta.chunksize]


def _forge_state(path: Path, state: dict) -> None:
    """Variable 1's stored state replaced by ``state`` (padded with JSON's spaces to the same length), its
    container hash, the file's checksum and the file block's hash recomputed."""
    raw = bytearray(path.read_bytes())
    fb = FileBlock.unpack(bytes(raw[:FB_SIZE]))
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    ((_bi, _ci, meta),) = [c for c in parsed.containers() if c[2].id == 1]
    payload = json.dumps(state, separators=(",", ":")).encode()
    assert len(payload) <= meta.chunksize, (len(payload), meta.chunksize)
    payload += b" " * (meta.chunksize - len(payload))
    raw[meta.fptr:meta.fptr + meta.chunksize] = payload
    checksum, offset = hashing.new_hasher(fb.hash_id), FB_SIZE
    while offset < fb.fs:
        bmd = BlockMeta.unpack(bytes(raw[offset:offset + 12]))
        for i in range(bmd.numvars):
            at = offset + 12 + 64 * i
            cm = ContainerMeta.unpack(bytes(raw[at:at + 64]))
            if cm.id == 1:
                raw[at:at + 64] = dataclasses.replace(cm, hash=hashing.digest(fb.hash_id, payload)).pack()
        checksum.update(bytes(raw[offset:offset + 12 + 64 * bmd.numvars]))
        offset += bmd.dbsize
    checksum.update(bytes(raw[fb.fs:]))  # the variable table after the data
    sealed = FileBlock(**(fb.__dict__ | {"checksum": checksum.hexdigest()[:32]})).sealed().pack()
    path.write_bytes(sealed + bytes(raw[FB_SIZE:]))


def _array(dtype: str, values: list[int], shape: list[int] | None = None) -> dict:
    return {"__ndarray__": dtype, "shape": [len(values)] if shape is None else shape, "values": values}


@pytest.mark.parametrize("where, forged", [
    pytest.param("state", _array("|V67108864", [1, 2, 3]), id="dtype-of-64-MiB-elements"),
    pytest.param("state", _array("|S67108864", [1, 2, 3]), id="bytes-of-64-MiB"),
    pytest.param("state", _array("(20000000,)u1", [1, 2, 3]), id="subarray-dtype"),
    pytest.param("state", _array("<u8", [1, 2, 3], shape=[2**40]), id="shape-not-the-values"),
    pytest.param("state", _array("<u8", [1]), id="an-array-for-an-int"),
    pytest.param("whole", _array("<f8", [1.5]), id="an-array-for-the-state-dict"),
    pytest.param("whole", _array("<u8", [1, 2]), id="an-int-array-for-the-state-dict"),
])
def test_a_forged_generator_state_is_a_recovery_error_that_allocates_nothing(tmp_path, where, forged):
    path, stored = _generator_file(tmp_path)
    state = json.loads(stored)
    if where == "whole":  # PCG64's setter indexed the array with a key: IndexError
        state["state"] = forged
    else:
        state["state"].update(state=forged, inc=1)  # a short inc: the forgery fits the container
    _forge_state(path, state)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L2"), glbl_dir=str(tmp_path / "G2"), meta_dir=str(tmp_path / "M2"),
                       verbosity=4)
    rng = np.random.default_rng(99)
    ctx.protect(1, rng)
    before = rng.bit_generator.state
    tracemalloc.start()
    try:
        with pytest.raises(RecoveryError, match="state is not valid"):
            ctx.recover_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        ctx.finalize()
    assert peak < 32 << 20, peak
    assert rng.bit_generator.state == before  # untouched


def test_the_forging_helper_keeps_a_true_state_readable(tmp_path):
    """The same file forged with its own state, spaces added: read back as it was (the helper forges soundly)."""
    path, stored = _generator_file(tmp_path)
    _forge_state(path, json.loads(stored))
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L2"), glbl_dir=str(tmp_path / "G2"), meta_dir=str(tmp_path / "M2"),
                       verbosity=4)
    rng = np.random.default_rng(99)
    ctx.protect(1, rng)
    ctx.recover_file(path)
    assert rng.bit_generator.state == np.random.default_rng(7).bit_generator.state
    ctx.finalize()
