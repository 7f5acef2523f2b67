"""L3 for differential checkpoints: update the parity from what changed instead of re-encoding.

Reed-Solomon parity is linear over GF(2^8): if parity ``P_j`` encodes the group's files ``D_i``,
then ``P_j + sum_i C[j][i] * (D_i' - D_i)`` encodes the files ``D_i'`` (``+`` and ``-`` are XOR).
Each member's differential writer records ``D_i' XOR D_i`` for every range it rewrote
(:class:`~ftidask.dcp.delta.XorDelta`); the members exchange these deltas only, and each one
patches the parity it kept from the retired checkpoint (its *spare parity*,
``{level dir}/dcp/SpareRSed-Rank{r}.fti``), then renames it into the new checkpoint.

This is only correct when the spare parity encodes exactly the files the deltas start from, so
every member checks, and all agree before anything is written:

* the spare parity's record (its ``.hash`` file) lists the FB hashes of the files it encodes,
  and they are the FB hashes of every member's base (``XorDelta.base_fb_hash``), and the spare's
  bytes match the hash of that record (a damaged spare would be patched into a parity that verifies);
* every member has a delta (its file was patched, with the base's layout).

The parity length follows the group's largest file (FTI's maxFs), which may change by a few bytes
(the variable table holds the time): past the old length every old file was zero padding, so the
old parity is zero there, and past the new length the new files are, so the spare is extended with
zeros or truncated to the new length before it is patched.

Otherwise :func:`update` returns a reason and the caller re-encodes in full
(:func:`ftidask.levels.rs.encode`). The new record keeps the group's whole-file hashes (what
:func:`ftidask.levels.rs.rebuild` checks a sound file against) only when every member gives its own
(``own_whole``: the heads hash each new file as they compare it with its base; a rank's differential
writer reads only the ranges it rewrites, and hashing its whole file would read it once more).

The spare's record is removed before it is patched, so a parity torn by a crash is never trusted
again; the new parity's hash and record are written after it is complete. Like every L3 parity, it
is checked against its hash before a rebuild.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..dcp.delta import XorDelta
from ..ftiff import hashing, readahead
from ..model.errors import FTIError
from ..storage import files as storage
from ..transport.collective import guarded
from .channel import GroupChannel
from .erasure import ReedSolomon, gf_add_scaled
from .rs import by_name, check_parity, hash_path, write_record

log = logging.getLogger("ftidask")
STRIPE = 4 << 20  # payload bytes of each member exchanged at once (a stripe of each member held)
PATCH_PIECE = 1 << 20  # parity bytes read, patched and written at once


def spare_parity_path(ckpt_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its spare parity, next to the checkpoint directories of L3."""
    return ckpt_dir.parent / storage.SPARE_DIR / storage.spare_file(rank, "RSed")


def _can_use(spare: Path, xor: XorDelta | None) -> dict[str, Any]:
    record = storage.read_json(hash_path(spare))
    try:
        ok = (xor is not None and isinstance(record, dict) and isinstance(record.get("fb_hashes"), list)
              and record.get("size") == spare.stat().st_size)
    except OSError:  # no spare: never raise between the group's collectives
        ok = False
    # Its bytes too: a damaged spare patched as it is would get a fresh hash over wrong parity (one read of it,
    # still far less than re-encoding, which reads the whole group's files and moves them).
    why = check_parity(spare) if ok else ""
    if why:
        log.warning("L3: the spare parity cannot be updated, the group re-encodes: %s", why)
        ok = False
    return {"ok": ok, "base": xor.base_fb_hash.hex() if xor is not None else "",
            "encodes": record.get("fb_hashes") if ok and isinstance(record, dict) else None,
            "ranges": [list(r) for r in xor.ranges] if xor is not None else [],
            "nbytes": xor.nbytes if xor is not None else 0}


def update(ch: GroupChannel, xor: XorDelta | None, own_fb_hash: str, spare: Path, parity: Path, sizes: list[int],
           hash_id: int, own_whole: tuple[str, str] | None = None) -> str | None:
    """Collectively patch every member's spare parity into ``parity``; None when done, else why not.

    Collective over the group (every member calls it). Nothing is written unless every member
    can take part; an I/O error after that point is raised as :class:`FTIError` (the checkpoint
    then fails and the previous one stays, as for any failed level).
    """
    max_fs = max(sizes)
    problems: list[str] = []  # a local failure before a collective: this member cannot patch, all re-encode
    mine = guarded(problems, lambda: _can_use(spare, xor), {"ok": False, "base": "", "encodes": None, "ranges": [],
                                                             "nbytes": 0}, f"cannot check {spare}")
    infos = ch.allgather(mine | {"new": own_fb_hash, "whole": list(own_whole) if own_whole else None})
    bases = [info["base"] for info in infos]
    if not all(info["ok"] and info["encodes"] == bases for info in infos):
        return "the spare parity does not encode every member's base file"
    assert xor is not None  # every member said ok
    width = max(info["nbytes"] for info in infos)
    rounds = _exchange(ch, xor, width, problems)
    wholes = [info["whole"] for info in infos]
    try:
        patch_parity(spare, parity, ch.index, [info["ranges"] for info in infos], rounds, max_fs, hash_id,
                     [info["new"] for info in infos], by_name(wholes) if all(wholes) else None)
    finally:  # a member whose patch failed still takes its part in every exchange left, then raises
        with contextlib.suppress(FTIError):
            for _ in rounds:
                pass
    log.debug("L3: parity updated from the group's deltas (%d bytes from each member, parity %d bytes)",
             width, max_fs)
    return None


def _exchange(ch: GroupChannel, xor: XorDelta, width: int,
              problems: list[str]) -> Iterator[tuple[int, list[np.ndarray]]]:
    """The group's deltas a stripe at a time: ``(start, blocks)``, ``blocks[i]`` member ``i``'s payload bytes
    ``[start, start + len)``, every payload padded to ``width``. One stripe of each member is held at once: the
    whole payloads gathered held the group's every changed byte (a checkpoint that changed all its state: the group
    size times the state, beside the member's own delta and its padded copy; 7x the state in a group of 4).

    After the last exchange a local failure (``problems``: here or before) is raised, before anything is renamed."""
    for start in range(0, width, STRIPE):
        n = min(STRIPE, width - start)
        own = guarded(problems, lambda: xor.read(start, n), None, "cannot prepare the parity delta")
        yield start, ch.allgather_blocks(np.zeros(n, np.uint8) if own is None else own)
    # That was the last collective: what follows is local and may fail alone (the caller agrees on it).
    if problems:
        raise FTIError("; ".join(problems))


def _windows(ranges: list[list[int]], starts: list[int], start: int,
             block: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(file offset, XOR bytes)`` of the parts of ``ranges`` (a member's, its payload back to back: range ``k``
    from payload byte ``starts[k]``) that payload bytes ``[start, start + len(block))`` hold."""
    stop = start + len(block)
    # from the range that holds ``start``: a scan from the first range at each stripe cost the ranges times the
    # stripes (a 256 MiB delta of 16 KiB ranges: 0.2 s for each member's, every member patching from all of them)
    k = max(bisect.bisect_right(starts, start) - 1, 0)
    while k < len(ranges) and starts[k] < stop:
        off, n = ranges[k]
        lo, hi = max(start, starts[k]), min(stop, starts[k] + n)
        if lo < hi:
            yield off + lo - starts[k], block[lo - start:hi - start]
        k += 1


def patch_parity(spare: Path, parity: Path, position: int, ranges: list[list[list[int]]],
                 rounds: Iterable[tuple[int, list[np.ndarray]]], max_fs: int, hash_id: int, fb_hashes: list[str],
                 file_hashes: dict[str, str] | None = None) -> None:
    """Patch parity row ``position`` in ``spare`` with every member's deltas (``ranges[i]`` and, a stripe at a time
    from ``rounds`` (:func:`_exchange`), the XOR bytes of member ``i``), rename it to ``parity``, write its hash and
    record.

    Local: the members already agreed that every spare encodes their deltas' base files.
    """
    coefs = ReedSolomon(len(ranges), len(ranges)).matrix[position]
    try:
        hash_path(spare).unlink(missing_ok=True)  # from now on the spare's content is unknown
        fd = storage.open_regular(spare, os.O_RDWR | os.O_NOFOLLOW)  # never written through a planted link
    except OSError as exc:
        raise FTIError(f"cannot patch the spare parity {spare}: {exc}") from exc
    try:
        os.ftruncate(fd, max_fs)  # zeros past the old maxFs (old files were padding there), or cut
        buf = np.empty(PATCH_PIECE, np.uint8)  # the parity's bytes being patched, a piece at a time
        starts = [[0, *itertools.accumulate(n for _off, n in member_ranges)] for member_ranges in ranges]
        for start, blocks in rounds:
            for i, member_ranges in enumerate(ranges):
                for off, delta in _windows(member_ranges, starts[i], start, blocks[i]):
                    n = min(len(delta), max_fs - off)  # past maxFs every file is padding on both sides
                    for lo in range(0, max(n, 0), PATCH_PIECE):
                        cur = buf[:min(PATCH_PIECE, n - lo)]
                        if readahead.read_full(fd, off + lo, memoryview(cur)) != len(cur):
                            raise FTIError(f"{spare}: shorter than the parity length {max_fs}")
                        gf_add_scaled(int(coefs[i]), delta[lo:lo + len(cur)], cur)  # parity ^= C[position][i] * delta
                        storage.pwrite_all(fd, memoryview(cur), off + lo)
            del blocks  # before the next stripe is gathered
        os.fsync(fd)
    finally:
        os.close(fd)
    storage.rename_into(spare, parity)
    hasher = hashing.new_hasher(hash_id)
    if max_fs:
        buf = memoryview(bytearray(min(max_fs, 16 << 20)))  # read, not mapped: a read error raises, no SIGBUS
        with storage.open_read(parity) as fh:
            while n := fh.readinto(buf):
                hasher.update(buf[:n])
    errors: list[str] = []
    write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors, fb_hashes, file_hashes)
    if errors:
        raise FTIError("; ".join(errors))
