"""L2, FTI's partner copy: every file is also kept on the next node of its group (a ring).

Member ``i`` of a group sends its own file to member ``i+1`` and keeps member ``i-1``'s file
as ``Pcof`` (partner copy). A file lost with its node comes back from the next node's copy;
two adjacent nodes lost together lose a file for good.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..transport.collective import guarded
from .blockio import SafeOutput, open_input, read_block
from .channel import GroupChannel


def exchange_file(ch: GroupChannel, send_path: Path | None, dest: int, send_size: int,
                  recv_path: Path | None, source: int, recv_size: int, piece: int) -> str:
    """Send a file to member ``dest`` while receiving one from ``source``, ``piece`` bytes at a time.

    Either side may be None. Returns an error message ('' on success); the peers' loops always
    complete (a missing file is sent as zeros, which then fails its hash check; a block that cannot
    be read at all is sent as zeros too, the error recorded).
    """
    n_send = -(-send_size // piece) if send_path is not None else 0
    n_recv = -(-recv_size // piece) if recv_path is not None else 0
    errors: list[str] = []
    fin = open_input(send_path, errors) if send_path is not None else None
    out = SafeOutput(recv_path, errors) if recv_path is not None else None
    try:
        for k in range(max(n_send, n_recv)):
            block = None
            if k < n_send:
                n = min(piece, send_size - k * piece)
                block = guarded(errors, functools.partial(read_block, fin, k * piece, n, send_size), None,
                               f"cannot read {send_path}")
                block = np.zeros(n, dtype=np.uint8) if block is None else block
            want = min(piece, recv_size - k * piece) if k < n_recv else 0
            got = ch.exchange(block, dest if block is not None else None, want, source if want else None)
            if out is not None and got is not None:
                out.write(got)
    finally:
        if fin is not None:
            fin.close()
    if out is not None:
        out.close()
    return "; ".join(errors)


def protect(ch: GroupChannel, own: Path, pcof: Path, sizes: list[int], piece: int) -> str:
    """Copy ``own`` to the next member; store the previous member's file at ``pcof``. Error or ''."""
    right, left = (ch.index + 1) % ch.size, (ch.index - 1) % ch.size
    return exchange_file(ch, own, right, sizes[ch.index], pcof, left, sizes[left], piece)


def has_size(path: Path, size: int) -> bool:
    """Whether ``path`` exists with ``size`` bytes (a stat: what a restart with nothing lost may afford)."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def rebuild(ch: GroupChannel, own: Path, pcof: Path, sizes: list[int], piece: int,
            own_ok: bool, verify_own: Callable[[Path], bool], verify_pcof: Callable[[Path], bool],
            errors: list[str] | None = None) -> bool:
    """Bring back lost own files (from the next member's copy), then lost partner copies. True if own verifies;
    ``errors`` gets why this member could not read or write what it had to (a full disk, a read error).

    The group first agrees on its own files' verdicts: when every member's file is sound, no partner
    copy is opened (a restart reads each byte once). Only when a file is lost are the partner copies
    verified (a damaged one counts as lost, never as a source) and everything the ring allows rebuilt,
    partner copies included. A partner copy that is missing or of the wrong size (a stat, no read) also
    counts as a loss: it is rebuilt from its member's own file, so that the checkpoint survives the next
    failure as FTI's does. A damaged partner copy of the right size beside sound own files stays as it
    is until the next L2 checkpoint rewrites it (``ftidask verify`` reports it).
    """
    i, g = ch.index, ch.size
    right, left = (i + 1) % g, (i - 1) % g
    if all(ch.allgather(bool(own_ok) and has_size(pcof, sizes[left]))):
        return own_ok
    errors = [] if errors is None else errors
    # never raise before a collective; a copy of another size than the record's is no source (see has_size)
    pcof_ok = has_size(pcof, sizes[left]) and guarded(errors, lambda: verify_pcof(pcof), False)
    flags = ch.allgather([bool(own_ok), bool(pcof_ok)])
    # Round 1: own files come back from the right member's Pcof.
    send = pcof if (not flags[left][0] and pcof_ok) else None
    recv = own if (not own_ok and flags[right][1]) else None
    if any(not flags[j][0] and flags[(j + 1) % g][1] for j in range(g)):
        errors += filter(None, [exchange_file(ch, send, left, sizes[left], recv, right, sizes[i], piece)])
    if recv is not None:
        own_ok = verify_own(own)
    # Round 2: partner copies come back from the left member's own file.
    owns = ch.allgather(bool(own_ok))
    send = own if (own_ok and not flags[right][1]) else None
    recv = pcof if (not pcof_ok and owns[left]) else None
    if any(not flags[j][1] and owns[(j - 1) % g] for j in range(g)):
        errors += filter(None, [exchange_file(ch, send, right, sizes[i], recv, left, sizes[left], piece)])
    return own_ok
