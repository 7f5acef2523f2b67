"""L2 for differential checkpoints: send the partner only what changed.

Every member of an L2 group sends its file to the next member (a ring), as in
:mod:`ftidask.levels.partner`. For a differential file the receiver usually still holds the
previous copy it received of the sender's *base* file, kept as its *spare partner copy*
(``{level dir}/dcp/SparePcof-Rank{r}.fti``, see :func:`spare_partner_path`; the engine puts a
retired ``Pcof`` there). When that spare's FB hash is the delta's ``base_fb_hash``, only the
delta's byte ranges travel and the receiver patches the spare in place, then renames it to the
new ``Pcof``; otherwise the whole file travels. Either way the new partner copy is verified
like any file when it is needed.

The group is any object with the ``GroupChannel`` interface of the MPI backend (``index``,
``size``, ``allgather``, ``exchange``): this module never knows which backend runs it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..dcp.delta import FileDelta, file_fb_hash
from ..storage import files as storage
from ..transport.collective import guarded

log = logging.getLogger("ftidask")


def spare_partner_path(ckpt_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its spare partner copy, next to the checkpoint directories of a level."""
    return ckpt_dir.parent / storage.SPARE_DIR / storage.spare_file(rank, "Pcof")


def _payload_pieces(delta: FileDelta | None, size: int, piece: int) -> list[tuple[int, int]]:
    """The file ranges to send, cut into pieces of at most ``piece`` bytes."""
    ranges = delta.ranges if delta is not None else ((0, size),)
    out = []
    for off, n in ranges:
        for lo in range(0, n, piece):
            out.append((off + lo, min(piece, n - lo)))
    return out


def protect(ch: Any, own: Path, pcof: Path, spare: Path, size: int, delta: FileDelta | None,
            piece: int) -> str:
    """Send ``own`` (or only its ``delta``) to the next member; build the previous member's copy at
    ``pcof``, from ``spare`` when the delta applies to it. Every member calls it. Error or ''."""
    right, left = (ch.index + 1) % ch.size, (ch.index - 1) % ch.size
    errors: list[str] = []  # local work between the collectives records its errors, never raises
    infos = ch.allgather({"size": size, "delta": None if delta is None else delta.to_json()})
    theirs = infos[left]
    left_delta = guarded(errors, lambda: FileDelta.from_json(theirs["delta"]) if theirs["delta"] is not None else None)
    can_patch = left_delta is not None and guarded(
        errors, lambda: file_fb_hash(spare) == left_delta.base_fb_hash.hex(), False, f"cannot check {spare}")
    patches = ch.allgather(bool(can_patch))
    # The exchange's shape comes from values every member has, so its loop is the same on both sides.
    send = _payload_pieces(delta if patches[right] else None, size, piece)
    recv = _payload_pieces(left_delta if can_patch else None, int(theirs["size"]), piece)
    log.debug("L2: sending %d of %d bytes to the partner (%s)", sum(n for _o, n in send), size,
              "changed ranges" if patches[right] else "whole file")
    fin = None
    try:
        fin = storage.open_read(own)  # closed below
    except OSError as exc:
        errors.append(f"{own}: {exc}")
    target = spare if can_patch else pcof
    fd = -1
    try:
        storage.makedirs(target.parent)
        if can_patch:  # the spare partner copy, in a directory of ours: never through a link
            fd = storage.open_regular(target, os.O_RDWR | os.O_NOFOLLOW)
        else:
            fd, target = storage.create_temp(pcof)
    except OSError as exc:
        errors.append(f"{target}: {exc}")
    for k in range(max(len(send), len(recv))):
        block = None
        if k < len(send):
            off, n = send[k]
            data = b""
            if fin is not None:
                try:
                    data = os.pread(fin.fileno(), n, off)
                except OSError as exc:  # still take part in the exchange; the error fails the level
                    errors.append(f"{own}: {exc}")
                    fin.close()
                    fin = None
            block = np.frombuffer(data.ljust(n, b"\0"), np.uint8)  # a missing file fails its hashes later
        want = recv[k][1] if k < len(recv) else 0
        got = ch.exchange(block, right if block is not None else None, want, left if want else None)
        if got is not None and fd >= 0 and not errors:
            # an error must not leave the exchange: the group's other members are in it
            guarded(errors, functools.partial(storage.pwrite_all, fd, np.ascontiguousarray(got), recv[k][0]),
                   None, str(target))
    if fin is not None:
        fin.close()
    if fd >= 0:
        try:
            os.ftruncate(fd, left_delta.file_size if can_patch and left_delta is not None else int(theirs["size"]))
            os.fsync(fd)
        except OSError as exc:
            errors.append(f"{target}: {exc}")
        finally:
            os.close(fd)
        if not errors:
            os.replace(target, pcof)
            storage.fsync_dir(pcof.parent)
        else:
            with contextlib.suppress(OSError):
                os.unlink(target)
    return "; ".join(errors)
