"""L3, FTI's Reed-Solomon level: one parity file per member of a group, any half of the group's files rebuild the rest.

A group holds ``k = group_size`` data files (one per node, padded with zeros to the largest,
FTI's maxFs) and ``k`` parity files (``RSed``); the code is systematic, so any ``k`` of the
``2k`` files give back the others. Files are processed in blocks of ``block`` bytes: no file is
ever held whole in memory. Each parity file's hash is kept beside it (``.hash``) so that a
damaged parity file counts as lost instead of corrupting a rebuild.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import FTIError
from ..ftiff import hashing
from ..storage import read_json, write_json_atomic
from .blockio import SafeOutput, open_input, read_block
from .channel import GroupChannel
from .erasure import ReedSolomon


def hash_path(parity: Path) -> Path:
    return parity.with_name(parity.name + ".hash")


def write_record(parity: Path, hash_id: int, digest: str, size: int, errors: list[str],
                 fb_hashes: list[str] | None = None) -> None:
    """The parity's ``.hash`` file: its hash and length, and (``fb_hashes``) the FB hashes of the
    group's files it encodes, by index (what :mod:`ftidask.levels.rs_delta` checks)."""
    record: dict[str, object] = {"hash_id": hash_id, "hash": digest, "size": size}
    if fb_hashes is not None:
        record["fb_hashes"] = fb_hashes
    try:
        write_json_atomic(hash_path(parity), record)
    except OSError as exc:
        errors.append(f"cannot write {hash_path(parity)}: {exc}")


def encode(ch: GroupChannel, own: Path, parity: Path, sizes: list[int], block: int, hash_id: int,
           fb_hashes: list[str] | None = None) -> str:
    """Write this member's parity file; sizes are the group's file sizes by index. Error or ''."""
    k, max_fs = ch.size, max(sizes)
    codec = ReedSolomon(k, k)
    errors: list[str] = []
    fin = open_input(own, errors)
    out = SafeOutput(parity, errors)
    hasher = hashing.new_hasher(hash_id)
    try:
        for offset in range(0, max_fs, block):
            n = min(block, max_fs - offset)
            blocks = ch.allgather_blocks(read_block(fin, offset, n, sizes[ch.index]))
            par = codec.encode(blocks, parity_indices=[ch.index])[0]
            out.write(par)
            hasher.update(memoryview(par))
    finally:
        if fin is not None:
            fin.close()
    if out.close():
        write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors, fb_hashes)
    return "; ".join(errors)


def parity_ok(parity: Path, size: int, block: int) -> bool:
    """Whether ``parity`` is present, of the expected size, and matches its recorded hash."""
    info = read_json(hash_path(parity))
    try:
        if not isinstance(info, dict) or int(info["size"]) != size or parity.stat().st_size != size:
            return False
        hasher = hashing.new_hasher(int(info["hash_id"]))
        buf = bytearray(block)
        with open(parity, "rb") as fh:
            while n := fh.readinto(buf):
                hasher.update(memoryview(buf)[:n])
        return hasher.hexdigest() == info["hash"]
    except (OSError, KeyError, TypeError, ValueError, FTIError):
        return False


def rebuild(ch: GroupChannel, own: Path, parity: Path, sizes: list[int], block: int, hash_id: int,
            own_ok: bool, verify_own: Callable[[Path], bool]) -> bool:
    """Rebuild the group's lost data and parity files if at most ``k`` of the ``2k`` are lost.

    True when this member's own file verifies afterwards.
    """
    i, k, max_fs = ch.index, ch.size, max(sizes)
    par_ok = parity_ok(parity, max_fs, block)
    flags = ch.allgather([bool(own_ok), bool(par_ok)])
    lost = sum((not d) + (not p) for d, p in flags)
    if lost == 0 or lost > k:
        return own_ok
    available = [j for j in range(k) if flags[j][0]] + [k + j for j in range(k) if flags[j][1]]
    chosen = available[:k]
    codec = ReedSolomon(k, k)
    errors: list[str] = []
    fd = open_input(own, errors) if own_ok else None
    fp = open_input(parity, errors) if par_ok else None
    out_d = SafeOutput(own, errors) if not own_ok else None
    out_p = SafeOutput(parity, errors) if not par_ok else None
    hasher = hashing.new_hasher(hash_id)
    try:
        for offset in range(0, max_fs, block):
            n = min(block, max_fs - offset)
            data = ch.allgather_blocks(read_block(fd, offset, n, sizes[i]))
            pars = ch.allgather_blocks(read_block(fp, offset, n, max_fs))
            if out_d is None and out_p is None:
                continue
            decoded = codec.decode({j: (data[j] if j < k else pars[j - k]) for j in chosen}, n)
            if out_d is not None and offset < sizes[i]:
                out_d.write(decoded[i][: min(n, sizes[i] - offset)])
            if out_p is not None:
                par = codec.encode(decoded, parity_indices=[i])[0]
                out_p.write(par)
                hasher.update(memoryview(par))
    finally:
        for fh in (fd, fp):
            if fh is not None:
                fh.close()
    if out_d is not None:
        out_d.close()
    if out_p is not None and out_p.close():
        write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors)
    return verify_own(own) if not own_ok else own_ok
