"""readahead: the next pieces of a span read on a thread while the caller hashes the last one, through a ring of
buffers (a recovery's verification) or into the data's final place (readhash). The hashes equal those of a plain
read, for every length around the piece and ring sizes; a file that ends early is said; a read error reaches the
caller as the OSError it was (the reader thread once died with it and left the caller waiting for ever)."""

import os

import numpy as np
import pytest

from ftidask.ftiff import hashing, readahead, readhash, verify

PIECE = 1 << 16  # small rings: many pieces, many turns of the ring


def _ring(n: int = readahead.SLOTS) -> list[memoryview]:
    return [memoryview(bytearray(PIECE)) for _ in range(n)]


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 13 * PIECE + 999, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("offset, length", [(0, 0), (5, 1), (0, PIECE), (3, PIECE + 1), (0, 4 * PIECE),
                                            (17, 9 * PIECE + 333), (999, 13 * PIECE)])
def test_feed_hashes_the_span_as_a_plain_read(data_file, slots, offset, length):
    fd, data = data_file
    hasher = hashing.new_hasher(hashing.hash_id("xxh3_128"))
    assert readahead.feed(fd, offset, length, hasher.update, _ring(slots))
    assert hasher.digest() == hashing.digest(hashing.hash_id("xxh3_128"), data[offset:offset + length])


@pytest.mark.parametrize("length", [1, PIECE, 5 * PIECE])
def test_feed_says_when_the_file_ends_inside_the_span(data_file, length):
    fd, data = data_file
    seen = []
    assert not readahead.feed(fd, len(data) - length + 1, length, lambda v: seen.append(bytes(v)), _ring())
    assert b"".join(seen) == data[len(data) - length + 1:][:len(b"".join(seen))]  # whole pieces only, in order


def test_a_read_error_is_raised_to_the_caller_not_left_to_hang_it(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # preadv on a directory: a real EISDIR
    try:
        with pytest.raises(IsADirectoryError):
            readahead.feed(fd, 0, 10 * PIECE, lambda v: None, _ring())
        with pytest.raises(IsADirectoryError):  # readhash's readers go through the same thread
            readhash.read_hashed(fd, 0, memoryview(bytearray(3 * readhash.PIECE)), hashing.hash_id("md5"))
    finally:
        os.close(fd)


def test_a_container_that_cannot_be_read_is_damage_with_the_reason(tmp_path):
    """verify.first_problem turns the OSError into the container's problem (the recovery then passes to the
    redundancy or an older checkpoint), through the read-ahead thread."""
    class Meta:
        id, containerid, fptr, chunksize, hash = 1, 0, 0, 10 * PIECE, b""

    class Parsed:
        class fb:
            hash_id = hashing.hash_id("md5")
        vars: dict = {}

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        problem = verify.first_problem(fd, Parsed, [(0, 0, Meta)], decode=False)
    finally:
        os.close(fd)
    assert "block 0, container 0" in problem and "cannot be read" in problem
