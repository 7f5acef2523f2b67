"""FTI's own level-3 Reed-Solomon code (``Ckpt{id}-RSed{r}.fti``), decoded as ``FTI_Decode`` decodes it.

What FTI computes (leobago/fti src/postckpt.c ``FTI_RSenc``, src/postreco.c ``FTI_Decode``, FTI 1.3/1.4):

* A group of ``k = group_size`` ranks (group rank ``g`` = the node's place in its group) has ``2k`` files: the rank
  files (ids ``0..k-1``) and their parity files (ids ``k..2k-1``), all ``maxFs`` bytes long once padded: each rank
  file is extended with zeros to ``maxFs`` (``truncate``); of an FTI-FF file the last ``sizeof(off_t)`` bytes of that
  padded file hold its own size (8 bytes, the machine's order: little-endian), so that a rebuilt file tells its size
  (FTI 1.2 and later: FTI 1.1 pads with zeros alone, its files' size being in their file block).
  POSIX: ``maxFs`` is the meta file's ``ckpt_file_maxs``; FTI-FF: the ``fs`` (= ``maxFs``) of a parity file's record.
* Arithmetic: GF(2^16) of Jerasure (``l3WordSize = FTI_WORD = 16``), primitive polynomial ``0x1100B`` (galois.c
  ``prim_poly[16] = 0210013``), the data taken as 16-bit words in the machine's (little-endian) order
  (``galois_w16_region_multiply``). Parity ``g``'s word is ``sum_i M[g][i] * D_i`` with the Cauchy matrix
  ``M[g][i] = galois_single_divide(1, g ^ (k + i), 16)``.
* Blocks of ``blockSize`` (``[advanced] block_size`` KiB) are read one at a time, every buffer zeroed first, and
  ``maxFs - pos`` bytes of the last one written: each word is computed on its own, so the parity is the same for
  any block size and this module works in pieces of its own (:data:`PIECE`). A parity file is exactly ``maxFs``
  bytes (FTI-FF: then a file-metadata record, :mod:`.ftiparity`).
* Decoding: the first ``k`` files still there (data ids first, FTI's ``dm_ids``) give the rows of the matrix
  ``[I; M]``, inverted (``jerasure_invert_matrix``); a lost file is the row of the inverse (or, a parity file,
  ``M``'s row times it) applied to those ``k`` files (``jerasure_matrix_dotprod``). The result is then cut to the
  file's size (POSIX: ``ckpt_file_size``; FTI-FF: the size in its last 8 bytes).
* An odd ``maxFs``: the parity file holds only the low byte of its last word, so that word, byte ``maxFs - 1``,
  cannot be rebuilt from parity (FTI's own decoding gets it wrong: our oracle shows it, tests/data/fti_l3/README.md):
  :func:`rebuild` reports it (``exact_end``) and the caller restores that byte from what it knows (zero padding, the
  FTI-FF size's top byte, or the file's MD5).

NumPy only: a word multiply is two table look-ups (log, antilog) over a piece's ``uint16`` array, each piece's logs
taken once for all the files rebuilt from it.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import BinaryIO

import numpy as np

from ..model.errors import FormatError

POLY = 0x1100B  # x^16 + x^12 + x^3 + x + 1: Jerasure's prim_poly[16]
ORDER = 0xFFFF  # the multiplicative group's order
PIECE = 1 << 20  # bytes of each file decoded at a time (even: pieces hold whole words)
SIZE_WORD = 8  # sizeof(off_t): FTI-FF's padded file ends with its size
ZERO_LOG = 2 * ORDER  # log[0]: into the zeros after the repeated antilog table

#: ``read(offset, nbytes)``: exactly ``nbytes`` of a padded file from ``offset`` (zeros past its end)
Reader = Callable[[int, int], bytes]


@functools.cache
def tables() -> tuple[np.ndarray, np.ndarray]:
    """``(log, antilog)`` of GF(2^16) as Jerasure's ``galois_create_log_tables(16)`` builds them: ``antilog[j]`` is
    ``x^j``, ``log[antilog[j]] = j``. ``antilog`` is repeated (``j < 2 * ORDER``: the sum of two logs needs no
    reduction) and followed by zeros, where ``log[0] = ZERO_LOG`` points: a product with 0 is then 0 with no test."""
    antilog = np.zeros(3 * ORDER + 1, dtype=np.uint16)
    b = 1
    for j in range(ORDER):  # 65535 steps, once: the shift register is sequential
        antilog[j] = b
        b <<= 1
        if b & 0x10000:
            b ^= POLY
    antilog[ORDER:2 * ORDER] = antilog[:ORDER]
    log = np.full(1 << 16, ZERO_LOG, dtype=np.intp)  # intp: indexes used as they are, never converted
    log[antilog[:ORDER]] = np.arange(ORDER, dtype=np.intp)
    return log, antilog


def gf_mul(a: int, b: int) -> int:
    """``a * b`` in GF(2^16)."""
    log, antilog = tables()
    return int(antilog[log[a] + log[b]])


def gf_div(a: int, b: int) -> int:
    """``a / b`` in GF(2^16) (``galois_single_divide``); ``b`` nonzero."""
    if b == 0:
        raise ZeroDivisionError("division by 0 in GF(2^16)")
    if a == 0:
        return 0
    log, antilog = tables()
    return int(antilog[(log[a] - log[b]) % ORDER])


def coding_matrix(k: int) -> list[list[int]]:
    """FTI's ``k x k`` Cauchy matrix: row ``g`` gives parity ``g`` from the ``k`` rank files."""
    return [[gf_div(1, i ^ (k + j)) for j in range(k)] for i in range(k)]


def invert(matrix: Sequence[Sequence[int]]) -> list[list[int]]:
    """The inverse over GF(2^16) (Gauss-Jordan, as ``jerasure_invert_matrix``); FormatError if singular."""
    n = len(matrix)
    a = [list(row) + [int(i == j) for j in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            raise FormatError("the decoding matrix is singular")
        a[col], a[pivot] = a[pivot], a[col]
        scale = gf_div(1, a[col][col])
        a[col] = [gf_mul(v, scale) for v in a[col]]
        for r in range(n):
            factor = a[r][col]
            if r != col and factor:
                a[r] = [v ^ gf_mul(factor, p) for v, p in zip(a[r], a[col])]
    return [row[n:] for row in a]


def mul_region(words: np.ndarray, factor: int) -> np.ndarray:
    """``factor * words`` word by word (``galois_w16_region_multiply``), a new ``uint16`` array."""
    return _mul_logs(tables()[0][words], factor)


def _mul_logs(logs: np.ndarray, factor: int) -> np.ndarray:
    """``factor`` times the words whose logs are ``logs``."""
    log, antilog = tables()
    if factor == 0:
        return np.zeros(logs.shape, dtype=np.uint16)
    return antilog[logs + log[factor]] if factor != 1 else antilog[logs]


def combine(row: Sequence[int], pieces: Sequence[np.ndarray]) -> np.ndarray:
    """``sum_j row[j] * pieces[j]`` (``jerasure_matrix_dotprod``)."""
    return _combine_logs(row, [tables()[0][words] for words in pieces])


def _combine_logs(row: Sequence[int], logs: Sequence[np.ndarray]) -> np.ndarray:
    out = np.zeros(logs[0].shape, dtype=np.uint16)
    for factor, piece in zip(row, logs):
        if factor:
            out ^= _mul_logs(piece, factor)
    return out


def plan(k: int, present: Sequence[int], wanted: Sequence[int]) -> tuple[list[int], dict[int, list[int]]]:
    """The ``k`` files a decoding reads (FTI's ``dm_ids``: the first ``k`` of ``present``, ids in ``0..2k-1``) and,
    for each id of ``wanted``, its row over them. FormatError when fewer than ``k`` are present."""
    survivors = sorted(set(present))[:k]
    if len(survivors) < k:
        raise FormatError(f"{2 * k - len(set(present))} of the group's {2 * k} files (rank files and parity) are "
                          f"lost or damaged: FTI's code rebuilds at most {k}")
    code = coding_matrix(k)
    rows = [[int(i == s) for i in range(k)] if s < k else code[s - k] for s in survivors]
    inverse = invert(rows)  # rank file i = inverse[i] . survivors
    out: dict[int, list[int]] = {}
    for want in wanted:
        if want < k:
            out[want] = inverse[want]
        else:  # a parity: its row of the code times the rank files
            coef = code[want - k]
            out[want] = [_dot(coef, [inverse[i][j] for i in range(k)]) for j in range(k)]
    return survivors, out


def _dot(a: Sequence[int], b: Sequence[int]) -> int:
    acc = 0
    for x, y in zip(a, b):
        acc ^= gf_mul(x, y)
    return acc


def words_of(raw: bytes | bytearray | memoryview) -> np.ndarray:
    """``raw`` as little-endian 16-bit words, an odd length padded with a zero byte (FTI's zeroed buffers)."""
    data = bytes(raw)
    return np.frombuffer(data + b"\0" if len(data) % 2 else data, dtype="<u2").astype(np.uint16)


def encode(k: int, files: Sequence[bytes], max_fs: int) -> list[bytes]:
    """The ``k`` parity files ``FTI_RSenc`` writes for the padded rank files ``files`` (each at most ``max_fs``
    bytes, zeros added; FTI-FF's size word is the caller's), whole in memory: for tests and small groups."""
    pieces = [words_of(bytes(f).ljust(max_fs, b"\0")) for f in files]
    return [combine(row, pieces).astype("<u2").tobytes()[:max_fs] for row in coding_matrix(k)]


def padded_reader(fd: int, size: int, max_fs: int, size_word: bool) -> Reader:
    """A :data:`Reader` of the first ``size`` bytes of ``fd`` padded as FTI pads a rank file for its code: zeros up to
    ``max_fs`` and, ``size_word`` (FTI-FF), ``size`` in the last 8 bytes. A file of exactly ``max_fs`` bytes (left
    padded by an interrupted FTI decoding, or a parity file) is read as it is: give ``size = max_fs``."""
    tail = struct.pack("<q", size) if size_word and size < max_fs else b""
    if size + len(tail) > max_fs:
        raise FormatError(f"{size} bytes do not fit the group's maxFs of {max_fs}")

    def read(offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        stop = min(offset + nbytes, size)
        if stop > offset:
            got = os.pread(fd, stop - offset, offset)
            if len(got) != stop - offset:
                raise FormatError(f"the file ends at byte {offset + len(got)}, before {size}")
            out[:len(got)] = got
        if tail:
            start = max_fs - len(tail)
            lo, hi = max(offset, start), min(offset + nbytes, max_fs)
            if hi > lo:
                out[lo - offset:hi - offset] = tail[lo - start:hi - start]
        return bytes(out)

    return read


def rebuild(k: int, max_fs: int, sources: Mapping[int, Reader], sinks: Mapping[int, BinaryIO],
            piece: int = PIECE) -> bool:
    """Write the ``max_fs`` padded bytes of each lost file of ``sinks`` (ids ``0..2k-1``) from the files of ``sources``
    (at least ``k`` of them, each checked sound by the caller), ``piece`` bytes of every file at a time.

    Returns ``exact_end``: False when ``max_fs`` is odd and a parity file was read, so that byte ``max_fs - 1`` of
    every rebuilt file is unknown (module docstring) and must be restored by the caller."""
    if piece <= 0 or piece % 2:
        raise ValueError("piece must be a positive even number of bytes")
    survivors, rows = plan(k, list(sources), list(sinks))
    for pos in range(0, max_fs, piece):
        nbytes = min(piece, max_fs - pos)
        logs = [tables()[0][words_of(sources[s](pos, nbytes))] for s in survivors]  # once for every lost file
        for want, sink in sinks.items():
            sink.write(_combine_logs(rows[want], logs).astype("<u2").tobytes()[:nbytes])
    return not (max_fs % 2 and any(s >= k for s in survivors))
