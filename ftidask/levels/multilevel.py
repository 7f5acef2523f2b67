"""Which files L2 and L3 make and where: one entry point per direction, for every backend.

A backend calls :func:`protect` after a rank's file is written and :func:`rebuild` during
recovery, on every member of the group (they are collective over the :class:`GroupChannel`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff import hashing
from ..model.config import Config
from ..storage import files as storage
from ..transport.collective import reason
from . import partner, rs
from .channel import GroupChannel

log = logging.getLogger("ftidask")


def protect(group: GroupChannel, cfg: Config, level: int, ckpt_id: int, rank: int, own_file: Path,
            ckpt_dir: Path, sizes: list[int], fb_hashes: list[str] | None = None) -> str:
    """Add L2 (partner copy) or L3 (parity) for rank ``rank``'s ``own_file``; sizes by group index. Error or ''.

    ``fb_hashes``: the group's files' FB hashes, recorded with an L3 parity (for parity updates).
    """
    if level == 2:
        return partner.protect(group, own_file, ckpt_dir / storage.partner_file(ckpt_id, rank), sizes,
                               cfg.transfer_size << 20)
    if level == 3:
        return rs.encode(group, own_file, ckpt_dir / storage.parity_file(ckpt_id, rank), sizes,
                         cfg.block_size << 10, hashing.hash_id(cfg.hash), fb_hashes)
    return ""


def protect_in_step(group: GroupChannel, cfg: Config, level: int, ckpt_id: int, rank: int, own_file: Path,
                    ckpt_dir: Path, sizes: list[int], fb_hashes: list[str] | None = None) -> str:
    """:func:`protect` that never leaves the group waiting. Error or ''.

    An exception escaping :func:`protect` on this member (a bug: the level code records its own failures) would
    leave the other members blocked in the exchanges this one skipped. It becomes this member's error instead, and
    this member takes part in the rest of the group's exchanges without a file (:func:`keep_in_step`), as a member
    whose file cannot be read does: the group ends the level together and the caller agrees on the error.
    """
    counted = _Counted(group)
    try:
        return protect(counted, cfg, level, ckpt_id, rank, own_file, ckpt_dir, sizes, fb_hashes)
    except Exception as exc:  # noqa: BLE001 - this member's error, reported once the group is done
        log.error("level %d of checkpoint %d failed on rank %d", level, ckpt_id, rank, exc_info=True)
        why = f"level {level} of checkpoint {ckpt_id} failed for rank {rank}: {reason(exc)}"
    keep_in_step(_Counted(group, skip=counted.done), cfg, level, sizes)
    return why


def keep_in_step(group: GroupChannel, cfg: Config, level: int, sizes: list[int]) -> None:
    """Make this member's part of the group's L2/L3 exchanges with no file: zeros sent, nothing written.

    The exchanges depend only on the level, the config and ``sizes`` (the same on every member), so replaying
    them with no input and no output meets the others' exchanges one for one (``group`` skips those already
    made). Outputs go below a regular file, where they cannot be created: nothing is encoded or written.
    """
    with tempfile.TemporaryDirectory(prefix="ftidask-in-step-") as tmp:
        blocker = Path(tmp) / "no-output"
        blocker.touch()
        none = Path(tmp) / "no-input"
        if level == 2:  # the level code itself, not protect(): the failure may be protect's own
            partner.protect(group, none, blocker / "out", sizes, cfg.transfer_size << 20)
        elif level == 3:
            rs.encode(group, none, blocker / "out", sizes, cfg.block_size << 10, hashing.hash_id(cfg.hash))


class _Counted:
    """A group channel that counts the exchanges made through it, and makes none for the first ``skip`` ones
    (made before: :func:`keep_in_step` replays a level from its start); those return placeholders. An exchange
    that raises is not counted: the exception came before the group saw it (a bad buffer, a local error)."""

    def __init__(self, group: GroupChannel, skip: int = 0) -> None:
        self.group, self.skip, self.done = group, skip, 0
        self.index, self.size = group.index, group.size

    def _skipped(self) -> bool:
        if self.done < self.skip:
            self.done += 1
            return True
        return False

    def allgather(self, value: Any) -> list[Any]:
        if self._skipped():
            return [value] * self.size
        out = self.group.allgather(value)
        self.done += 1
        return out

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        if self._skipped():
            return [block] * self.size
        out = self.group.allgather_blocks(block)
        self.done += 1
        return out

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        if self._skipped():
            return np.zeros(recv_nbytes, np.uint8) if source is not None else None
        out = self.group.exchange(send, dest, recv_nbytes, source)
        self.done += 1
        return out


def rebuild(group: GroupChannel, cfg: Config, level: int, ckpt_id: int, rank: int, own_file: Path, ckpt_dir: Path,
            sizes: list[int], ok: bool, *, verify_own: Callable[[Path], bool],
            verify_partner: Callable[[Path], bool], errors: list[str] | None = None) -> bool:
    """Rebuild what the group lost of an L2/L3 checkpoint (own, partner and parity files); True if own verifies.
    ``errors`` gets why this member could not read or write its part (a full disk, a read error).

    ``sizes`` (by group index) come from the commit record: an own file of another size is no source, whatever
    its hashes say (a forged size would have it sent, or encoded, as that many bytes), and is rebuilt if it can be.
    """
    ok = bool(ok) and partner.has_size(own_file, sizes[group.index])
    if level == 2:
        return partner.rebuild(group, own_file, ckpt_dir / storage.partner_file(ckpt_id, rank), sizes,
                               cfg.transfer_size << 20, ok, verify_own, verify_partner, errors)
    if level == 3:
        return rs.rebuild(group, own_file, ckpt_dir / storage.parity_file(ckpt_id, rank), sizes,
                          cfg.block_size << 10, hashing.hash_id(cfg.hash), ok, verify_own, errors)
    return ok
