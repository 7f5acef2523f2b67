"""readhash.read_hashed: a container read and hashed piece by piece (the next piece read while one is hashed)
gives the bytes and the digest of a read then a hash, for every length around the piece size."""

import os

import numpy as np
import pytest

from ftidask.ftiff import hashing, readhash

PIECE = readhash.PIECE


@pytest.mark.parametrize("length", [0, 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 12345])
def test_bytes_and_digest_as_a_read_then_a_hash(tmp_path, length):
    data = np.random.default_rng(length).integers(0, 256, length + 777, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    out = np.zeros(length, np.uint8)
    hid = hashing.hash_id("xxh3_128")
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = readhash.read_hashed(fd, 777, memoryview(out), hid)
    finally:
        os.close(fd)
    assert out.tobytes() == data[777:].tobytes()
    assert digest == hashing.digest(hid, data[777:].tobytes())


@pytest.mark.parametrize("missing", [1, PIECE + 1])
def test_a_file_that_ends_early_gives_none(tmp_path, missing):
    length = 2 * PIECE + 5
    path = tmp_path / "f"
    path.write_bytes(bytes(length - missing))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert readhash.read_hashed(fd, 0, memoryview(bytearray(length)), hashing.hash_id("md5")) is None
    finally:
        os.close(fd)


def test_a_byte_changed_in_the_last_piece_changes_the_digest(tmp_path):
    data = bytearray(np.random.default_rng(1).integers(0, 256, 3 * PIECE, dtype=np.uint8).tobytes())
    hid = hashing.hash_id("xxh3_128")
    expected = hashing.digest(hid, bytes(data))
    data[-3] ^= 0x10
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert readhash.read_hashed(fd, 0, memoryview(bytearray(len(data))), hid) != expected
    finally:
        os.close(fd)
