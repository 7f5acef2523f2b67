"""L3, FTI's Reed-Solomon level: one parity file per member of a group, any half of the group's files rebuild the rest.

A group holds ``k = group_size`` data files (one per node, padded with zeros to the largest,
FTI's maxFs) and ``k`` parity files (``RSed``); the code is systematic, so any ``k`` of the
``2k`` files give back the others. Files are processed in blocks of ``block`` bytes: no file is
ever held whole in memory. Each parity file's hash is kept beside it (``.hash``) so that a
damaged parity file counts as lost instead of corrupting a rebuild.

That record also keeps the whole-file hash of every data file of the group (``file_hashes``, by file name), as
FTI's L3 metadata keeps each rank's checksum: a data file's own hashes cover its containers' data only, and a byte
changed in a container's slack (FTI-FF keeps a container's size when its variable shrinks) leaves it "sound". When a
loss forces a decode, such a file counts as lost too (and is rebuilt), never as an input that would spoil every file
rebuilt from it. Each member hashes its own file as it reads it for the encode (no extra read); a rebuild reads its
own file once more, only when the group lost a file. A record without ``file_hashes`` (an older version's, a parity
a rank's differential writer patched: :mod:`ftidask.levels.rs_delta`) checks nothing more.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff import hashing
from ..model.errors import FTIError
from ..storage.files import open_read, read_json, write_json_atomic
from ..transport.collective import guarded
from .blockio import SafeOutput, open_input, read_block
from .channel import GroupChannel
from .erasure import ReedSolomon


def hash_path(parity: Path) -> Path:
    """The ``.hash`` record beside a parity file."""
    return parity.with_name(parity.name + ".hash")


def write_record(parity: Path, hash_id: int, digest: str, size: int, errors: list[str],
                 fb_hashes: list[str] | None = None, file_hashes: dict[str, str] | None = None) -> None:
    """The parity's ``.hash`` file: its hash and length, (``fb_hashes``) the FB hashes of the
    group's files it encodes, by index (what :mod:`ftidask.levels.rs_delta` checks), and (``file_hashes``) the
    whole-file hash of each of those files, by file name (what :func:`rebuild` checks, with ``hash_id`` too)."""
    record: dict[str, object] = {"hash_id": hash_id, "hash": digest, "size": size}
    if fb_hashes is not None:
        record["fb_hashes"] = fb_hashes
    if file_hashes is not None:
        record["file_hashes"] = file_hashes
    try:
        write_json_atomic(hash_path(parity), record)
    except OSError as exc:
        errors.append(f"cannot write {hash_path(parity)}: {exc}")


def _read(fh: Any, offset: int, n: int, valid: int, path: Path, errors: list[str]) -> np.ndarray:
    """A block to send: zeros (the error recorded) when it cannot be read, so the group stays in step."""
    got = guarded(errors, functools.partial(read_block, fh, offset, n, valid), None, f"cannot read {path}")
    return np.zeros(n, dtype=np.uint8) if got is None else got


def encode(ch: GroupChannel, own: Path, parity: Path, sizes: list[int], block: int, hash_id: int,
           fb_hashes: list[str] | None = None) -> str:
    """Write this member's parity file; sizes are the group's file sizes by index. Error or ''."""
    k, max_fs = ch.size, max(sizes)
    codec = ReedSolomon(k, k)
    errors: list[str] = []
    fin = open_input(own, errors)
    out = SafeOutput(parity, errors)
    hasher, whole = hashing.new_hasher(hash_id), hashing.new_hasher(hash_id)
    read_ok = fin is not None
    try:
        for offset in range(0, max_fs, block):
            n = min(block, max_fs - offset)
            had = len(errors)
            mine = _read(fin, offset, n, sizes[ch.index], own, errors)
            read_ok = read_ok and len(errors) == had
            whole.update(memoryview(mine)[:max(0, min(n, sizes[ch.index] - offset))])  # the file's bytes, no padding
            blocks = ch.allgather_blocks(mine)
            if out.fh is None:
                continue  # failed already: this member only keeps the group's collectives in step
            # Local work between collectives never raises (the group would wait): an error drops the output.
            par = guarded(errors, lambda: codec.encode(blocks, parity_indices=[ch.index])[0],  # noqa: B023
                         None, f"cannot encode {parity}")
            if par is None:
                out.abort()
                continue
            out.write(par)
            hasher.update(memoryview(par))
    finally:
        if fin is not None:
            fin.close()
    # Every member's whole-file hash, for every parity's record ('': this member's file could not be read).
    digests = ch.allgather([own.name, whole.hexdigest() if read_ok else ""])
    if out.close():
        write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors, fb_hashes, by_name(digests))
    return "; ".join(errors)


def by_name(digests: list[list[str]]) -> dict[str, str] | None:
    """The group's ``[file name, whole-file hash]`` pairs as a record's ``file_hashes`` ('' hashes left out); None
    when two files share a name (never in a checkpoint: ``Ckpt{id}-Rank{r}.fti``): the record cannot tell them
    apart."""
    names = [name for name, _ in digests]
    return {name: digest for name, digest in digests if digest} if len(set(names)) == len(names) else None


def _present(parity: Path, size: int) -> bool:
    """Whether ``parity`` (``size`` bytes) and its ``.hash`` record are there: stats, no file opened."""
    try:
        return parity.stat().st_size == size and hash_path(parity).is_file()
    except OSError:
        return False


def parity_ok(parity: Path, size: int, block: int) -> bool:
    """Whether ``parity`` is present, of the expected size, and matches its recorded hash."""
    return check_parity(parity, block, size) == ""


def check_parity(parity: Path, block: int = 1 << 20, size: int | None = None) -> str:
    """'' when ``parity`` matches its ``.hash`` record (length and hash; ``size``: the length expected), else
    why not."""
    info = read_json(hash_path(parity))
    try:
        if not isinstance(info, dict):
            return f"{parity}: no readable hash record {hash_path(parity).name}"
        if size is not None and int(info["size"]) != size:
            return f"{parity}: recorded for {info['size']} bytes, the group's files need {size}"
        if parity.stat().st_size != int(info["size"]):
            return f"{parity}: {parity.stat().st_size} bytes, its record says {info['size']}"
        matches = file_hash(parity, int(info["hash_id"]), block) == info["hash"]
        return "" if matches else f"{parity}: does not match its recorded hash"
    except (OSError, KeyError, TypeError, ValueError, OverflowError, FTIError) as exc:  # Overflow: int(Infinity)
        return f"{parity}: {exc}"


def file_hash(path: Path, hash_id: int, block: int = 1 << 20) -> str:
    """The hash (hex) of the whole file at ``path``, read in blocks of ``block`` bytes."""
    hasher = hashing.new_hasher(hash_id)
    buf = bytearray(block)
    with open_read(path) as fh:
        while n := fh.readinto(buf):
            hasher.update(memoryview(buf)[:n])
    return hasher.hexdigest()


def recorded(parity: Path) -> dict[str, Any] | None:
    """What a parity's record says of the group's files: ``hash_id``, ``fb_hashes`` and ``file_hashes`` (None when
    it has no well-formed ``file_hashes``: an older version's record)."""
    info = read_json(hash_path(parity))
    if not isinstance(info, dict) or not isinstance(info.get("hash_id"), int):
        return None
    files, fbs = info.get("file_hashes"), info.get("fb_hashes")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return None
    return {"hash_id": info["hash_id"], "file_hashes": files,
            "fb_hashes": fbs if isinstance(fbs, list) and all(isinstance(v, str) for v in fbs) else None}


def _agreed(records: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The record most of the sound parities give (they were written by one encode: all alike), or None."""
    seen = [json.dumps(r, sort_keys=True) for r in records if r is not None]
    return json.loads(max(sorted(set(seen)), key=seen.count)) if seen else None  # sorted: alike everywhere


def decode_inputs(data: list[str], parity: list[str], lost: int, sizes: list[int],
                  block: int = 1 << 20) -> tuple[list[str | None], list[str | None], list[str]]:
    """``k`` of a group's files that may rebuild its data file ``lost`` in one process (the others None), and why
    each file left out was; fewer than ``k`` when the group has no more.

    The rule of :func:`rebuild`: a parity must match its ``.hash`` record, a data file the whole-file hash those
    records keep (``file_hashes``): one that differs, even where its own hashes do not look, spoils every byte
    decoded from it. The data files that match are taken first (a cheaper decode), then the parity files, and only
    then a data file the records keep no hash of (an older version's record; what is rebuilt from it is verified
    against the commit record), as :func:`rebuild` takes the parity first. ``lost`` itself is never an input."""
    k, max_fs = len(data), max(sizes)
    agreed = _agreed([recorded(Path(p)) for p in parity])
    hashes: dict[str, str] = agreed["file_hashes"] if agreed else {}
    use_d: list[str | None] = [None] * k
    use_p: list[str | None] = [None] * k
    unhashed: list[int] = []
    why: list[str] = []
    for j, p in enumerate(data):
        if j == lost:
            continue
        want = hashes.get(Path(p).name)
        try:
            if Path(p).stat().st_size != sizes[j]:
                why.append(f"{p}: {Path(p).stat().st_size} bytes, the checkpoint's file has {sizes[j]}")
            elif not want:
                unhashed.append(j)
            elif file_hash(Path(p), int(agreed["hash_id"]), block) != want:  # type: ignore[index]
                why.append(f"{p}: differs from the whole-file hash its group's parity records keep")
            else:
                use_d[j] = p
        except FileNotFoundError:
            why.append(f"{p}: missing")
        except (OSError, FTIError) as exc:
            why.append(f"{p}: {exc}")
    for j, p in enumerate(parity):
        if sum(x is not None for x in use_d + use_p) == k:
            break
        problem = check_parity(Path(p), block, max_fs)
        if problem:
            why.append(problem)
        else:
            use_p[j] = p
    for j in unhashed:
        if sum(x is not None for x in use_d + use_p) < k:
            use_d[j] = data[j]
    return use_d, use_p, why


def _rebuild_block(codec: ReedSolomon, data: list[np.ndarray], pars: list[np.ndarray], chosen: list[int], n: int,
                   offset: int, i: int, size: int, out_d: SafeOutput | None, out_p: SafeOutput | None,
                   hasher: Any) -> None:
    """Decode one block of the group and write this member's lost data and parity (local work)."""
    k = len(data)
    try:
        decoded = codec.decode({j: (data[j] if j < k else pars[j - k]) for j in chosen}, n)
        if out_d is not None and offset < size:
            out_d.write(decoded[i][: min(n, size - offset)])
        if out_p is not None:
            par = codec.encode(decoded, parity_indices=[i])[0]
            out_p.write(par)
            hasher.update(memoryview(par))
    except Exception:
        for out in (out_d, out_p):  # what this member rebuilds is incomplete: never commit it
            if out is not None:
                out.abort()
        raise


def rebuild(ch: GroupChannel, own: Path, parity: Path, sizes: list[int], block: int, hash_id: int,
            own_ok: bool, verify_own: Callable[[Path], bool], errors: list[str] | None = None) -> bool:
    """Rebuild the group's lost data and parity files if at most ``k`` of the ``2k`` are lost.

    True when this member's own file verifies afterwards; ``errors`` gets why this member could not read or
    write what it had to (a full disk, a read error). The group first agrees on its own files'
    verdicts: when every member's file is sound, no parity file is opened (a restart reads each byte
    once). Only when a file is lost are the parity files checked against their ``.hash`` records (a
    damaged one counts as lost) and every lost data and parity file rebuilt. A parity file that is
    missing, of the wrong size or without its record (stats, no file opened), also counts as lost
    and is re-encoded, so that the checkpoint survives the next failure
    as FTI's does. A damaged parity of the right size beside sound data files stays as it is until
    the next L3 checkpoint rewrites it (``ftidask verify`` reports it).

    When a file is lost, each member whose own file is sound also checks it against the whole-file hash the
    parity records keep (one more read of it): a file that differs where its own hashes do not look (a container's
    slack) is no decoding input, and is rebuilt too when the other files are enough; when they are not, it is an
    input after all (as without whole-file hashes): a data file it spoils fails its checks, and no lost parity is
    rebuilt from it (a parity is not checked once rebuilt).
    """
    i, k, max_fs = ch.index, ch.size, max(sizes)
    if all(ch.allgather(bool(own_ok) and _present(parity, max_fs))):
        return own_ok
    errors = [] if errors is None else errors
    par_ok = guarded(errors, lambda: parity_ok(parity, max_fs, block), False)  # never raise before a collective
    record = guarded([], lambda: recorded(parity), None) if par_ok else None
    flags = ch.allgather([bool(own_ok), bool(par_ok), record])
    lost = sum((not d) + (not p) for d, p, _ in flags)
    if lost == 0 or lost > k:
        return own_ok
    agreed = _agreed([r for _, _, r in flags])
    want = agreed["file_hashes"].get(own.name) if agreed else None
    exact = not (own_ok and want) or bool(guarded(  # never raise before a collective; unreadable: not exact
        [], lambda: file_hash(own, int(agreed["hash_id"]), block) == want, False))  # type: ignore[index]
    exacts = ch.allgather(exact)
    # The parity files first: each was checked whole against its .hash record, where a data file's hashes cover its
    # containers' data only: a byte changed in a container's slack (FTI-FF keeps a container's size when its variable
    # shrinks) leaves it "sound", and as an input it would spoil every file rebuilt from it. Such a file (its
    # whole-file hash not the recorded one) is rebuilt instead, when the other files are enough.
    good = [k + j for j in range(k) if flags[j][1]] + [j for j in range(k) if flags[j][0] and exacts[j]]
    suspect = [j for j in range(k) if flags[j][0] and not exacts[j]]
    chosen = (good if len(good) >= k else good + suspect)[:k]
    rebuild_own = not own_ok or (i in suspect and len(good) >= k)
    codec = ReedSolomon(k, k)
    fd = open_input(own, errors) if not rebuild_own else None
    fp = open_input(parity, errors) if par_ok else None
    out_d = SafeOutput(own, errors) if rebuild_own else None
    # A parity decoded from a file known to differ would be recorded as sound (a data file rebuilt from it is
    # verified, a parity is not): left lost, the next L3 checkpoint writes it.
    out_p = SafeOutput(parity, errors) if not par_ok and not set(chosen) & set(suspect) else None
    hasher = hashing.new_hasher(hash_id)
    try:
        for offset in range(0, max_fs, block):
            n = min(block, max_fs - offset)
            data = ch.allgather_blocks(_read(fd, offset, n, sizes[i], own, errors))
            pars = ch.allgather_blocks(_read(fp, offset, n, max_fs, parity, errors))
            if out_d is None and out_p is None:
                continue
            guarded(errors, lambda: _rebuild_block(codec, data, pars, chosen, n, offset, i, sizes[i],  # noqa: B023
                                                  out_d, out_p, hasher), None, "cannot rebuild")
    finally:
        for fh in (fd, fp):
            if fh is not None:
                fh.close()
    if out_d is not None:
        out_d.close()
    if out_p is not None and out_p.close():
        same = agreed is not None and agreed["hash_id"] == hash_id  # the group's files, as the sound parities say
        write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors, agreed["fb_hashes"] if same else None,
                     agreed["file_hashes"] if same else None)
    return verify_own(own) if rebuild_own else own_ok
