"""Which files L2 and L3 make and where: one entry point per direction, for every backend.

A backend calls :func:`protect` after a rank's file is written and :func:`rebuild` during
recovery, on every member of the group (they are collective over the :class:`GroupChannel`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..ftiff import hashing
from ..model.config import Config
from ..storage import files as storage
from . import partner, rs
from .channel import GroupChannel


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
