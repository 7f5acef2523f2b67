"""L3 of a differential checkpoint raised by the heads: the previous parity updated, not encoded anew.

Without heads, each rank's differential writer records ``old XOR new`` of what it rewrites, and the group
updates the parity it kept from the retired checkpoint (:mod:`ftidask.levels.rs_delta`). With heads, the
application writes a differential L1 file and the heads raise it: they have no writer's delta, but while the
previous L3 checkpoint is still committed they hold both files. So each head, for each rank of its node:

1. checks the rank's file of the previous L3 checkpoint (every hash, as a recovery does) and its parity
   against its ``.hash`` record, whose ``fb_hashes`` name the files it encodes;
2. compares the two files block by block (``dcp_block_size``): the blocks that differ, and a digest of each one's
   ``old XOR new``, whose bytes are read again from both files when the group exchanges them (never held);
3. copies the previous parity to the level's spare parity (the previous checkpoint stays whole: the new
   parity is never written over a committed one).

Then the group runs :func:`ftidask.levels.rs_delta.update`, which patches each spare with every member's
delta only when every member could take part and every spare encodes exactly the files the deltas start
from; otherwise (the first L3 checkpoint, a damaged or missing file, more than half of a file changed) the
parity is encoded in full, on every member alike. Stripes whose blocks did not change are never exchanged
nor encoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...dcp.delta import XorDelta
from ...dcp.filexor import files_xor_delta
from ...engine.recovery import check_file
from ...engine.runstate import CommitRecord
from ...ftiff import hashing
from ...levels import rs_delta
from ...levels.rs import hash_path
from ...model.config import Config
from ...storage import files as storage
from ...transport.collective import guarded

log = logging.getLogger("ftidask")
#: A test seam: called with the base and the new file once a head has compared them and before the group's exchange
#: reads their XOR back (a test damages one of them there); None in a run.
BEFORE_EXCHANGE: Callable[[Path, Path], None] | None = None


def previous_l3(records: list[CommitRecord | None], record: CommitRecord) -> CommitRecord | None:
    """The committed L3 checkpoint before ``record`` whose parity a differential ``record`` may update, or None."""
    if not record.extra.get("dcp"):
        return None
    older = [r for r in records if r is not None and r.level == 3 and r.seq < record.seq and not r.fallback]
    return max(older, key=lambda r: r.seq) if older else None


def _prepare(cfg: Config, prev: CommitRecord, prev_dir: Path, app: int, new_file: Path,
             spare: Path) -> tuple[XorDelta | None, str]:
    """Steps 1-3 of the module's docstring for rank ``app``: its delta (its XOR read back from both files: close it),
    with the previous parity as the spare, and the new file's whole-file hash (for the parity's record, read with the
    delta)."""
    base = prev_dir / storage.rank_file(prev.ckpt_id, app)
    old_parity = prev_dir / storage.parity_file(prev.ckpt_id, app)
    if check_file(base, prev, app).kind != "ok":
        return None, ""
    whole = hashing.new_hasher(hashing.hash_id(cfg.hash))
    xor = files_xor_delta(base, new_file, cfg.dcp_block_size, new_file.stat().st_size // 2, whole)
    if xor is None:
        return None, ""
    try:
        hash_path(spare).unlink(missing_ok=True)  # the record last: a spare torn by a crash is never trusted
        storage.copy_file_atomic(old_parity, spare)
        storage.copy_file_atomic(hash_path(old_parity), hash_path(spare))
    except BaseException:
        xor.close()  # its descriptors: the caller never gets the delta
        raise
    return xor, whole.hexdigest()  # rs_delta.update checks the spare's bytes against its record


def update_parity(cfg: Config, group: Any, prev: CommitRecord, prev_dir: Path, app: int, new_file: Path,
                  parity: Path, sizes: list[int], fb_hashes: list[str]) -> tuple[bool, str]:
    """Collectively (the heads of the group) update the parity of rank ``app``'s ``new_file`` from ``prev``'s:
    ``(done, error)``. Not done and no error: the caller encodes in full (the same on every member).

    The delta's XOR is read from the base and new files during the exchange (:mod:`ftidask.dcp.filexor`): neither
    changes meanwhile. The new file is this head's own copy, made for this checkpoint; the base is the previous L3
    checkpoint's, which the heads retire only after every head is done here (``heads._raise``: the agreement comes
    first); and the node's application ranks wait for their head's reply before they write, recover, retire or
    finalize (``wait_post``). A file that changed anyway fails that member's part: never a wrong parity."""
    errors: list[str] = []
    spare = rs_delta.spare_parity_path(parity.parent, app)
    xor, whole = guarded(errors, lambda: _prepare(cfg, prev, prev_dir, app, new_file, spare), (None, ""),
                         f"preparing the parity update of rank {app}")
    try:
        if xor is not None and BEFORE_EXCHANGE is not None:
            guarded(errors, lambda: BEFORE_EXCHANGE(prev_dir / storage.rank_file(prev.ckpt_id, app), new_file))
        why = guarded(errors, lambda: rs_delta.update(group, xor, fb_hashes[group.index], spare, parity, sizes,
                                                      hashing.hash_id(cfg.hash),
                                                      (new_file.name, whole) if whole else None),
                      "failed", f"updating {parity}")
    finally:  # the two files' descriptors, on every path (the files may be removed next: a failed raise)
        if xor is not None:
            guarded([], xor.close)  # never fails the checkpoint: the update is done, or its error stands
    if why is None:
        log.info("L3: parity of rank %d updated from the group's deltas (%d bytes changed)", app,
                 0 if xor is None else xor.nbytes)
        return True, "; ".join(errors)
    if errors and why == "failed":  # rs_delta.update raised after the group's last collective: this member alone
        return True, "; ".join(errors)
    for path in (hash_path(spare), spare):  # not used: a parity's worth of disk freed at once
        guarded([], lambda: path.unlink(missing_ok=True))  # noqa: B023
    log.info("L3: parity of rank %d re-encoded in full: %s", app, "; ".join([why, *errors]))
    return False, ""
