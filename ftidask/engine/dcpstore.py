"""Where differential checkpoints are written, so that the previous checkpoint stays valid.

Design: two alternating files per rank and level, brought up to date in place.

* The file of the last committed checkpoint is never written to.
* When a checkpoint file of level L is retired (a newer checkpoint was committed), it is not deleted but renamed to
  the *spare* slot ``{level dir}/dcp/Spare-Rank{r}.fti``, with its block digests
  (:class:`~ftidask.dcp.files.BlockState`) kept in memory: it lags one or more checkpoints behind the data.
* A differential checkpoint patches the spare in place (only the blocks whose digest differs from the spare's),
  fsyncs it, renames it into the new checkpoint's directory, and only then is the commit record written (by the
  engine, as for every checkpoint). Its commit record is the commit point: a crash at any moment before it leaves
  the previous checkpoint, untouched and still the newest committed one; the spare may be torn, so its in-memory
  state is dropped when patching starts and a torn spare is simply rewritten in full next time.
* The writer zeroes the spare's FB (and syncs) before its first data write, so a spare torn by a crash never shows a
  valid FB. When a file becomes the spare, its FB hash is also noted in ``Spare-Rank{r}.json``: a restarted process
  trusts the spare's own block-hash section if its FB hash is that one (read from the metadata only, see
  :func:`ftidask.dcp.files.load_state`).
* Without a known spare (first dCP checkpoint, after a failed checkpoint, a torn spare, or when the retired file was
  not a dCP file of this block size and hash), every block is written: that is a full checkpoint in dCP format, and
  the next one is differential again.

Rename and retirement cost no data I/O, so a differential checkpoint writes changed blocks plus metadata only.
Nothing here depends on the backend: each rank calls it for its own file. The file itself is written by
:mod:`ftidask.engine.dcpwrite` (a :class:`DcpHandle` that :meth:`DcpStore.begin` opens, or
:func:`write_differential` without a store).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..dcp.files import BlockState, DcpFileWriter, load_state, state_of_file
from ..dcp.segments import aligns_writes
from ..dcp.track import DcpTracking
from ..ftiff.layout import Layout
from ..ftiff.structs import FB_SIZE, FileBlock
from ..levels.rs import hash_path
from ..model.errors import FormatError
from ..storage import files as storage
from ..storage import interrupts
from .dcpwrite import DcpHandle as DcpHandle
from .dcpwrite import clear_spare_place
from .dcpwrite import write_differential as write_differential

_SHORT_RUN = 128 << 10  # mean bytes per write under which the spare's cache is dropped (see retire)


class DcpStore:
    """One rank's spare files and the block states of its files, per level (1-4)."""

    def __init__(self, paths: storage.RunPaths, rank: int, node: int, *, block_size: int, bid: int,
                 hash_id: int, threads: int | None = None, track_pages: bool = True) -> None:
        self.paths, self.rank, self.node = paths, rank, node
        self.tracking = DcpTracking(track_pages)  # which blocks need hashing at all
        self.block_size, self.bid, self.hash_id = block_size, bid, hash_id
        self._spares: dict[int, BlockState] = {}  # level -> state of the spare file
        self._pinned: set[int] = set()  # levels whose spare holds the checkpoint recovered (see recovered_fallback)
        self._files: dict[tuple[int, int], BlockState] = {}  # (level, seq) -> state of a checkpoint file
        self._elsewhere: set[tuple[int, int]] = set()  # (level, seq) of another layout, redistributed here
        self._pool = ThreadPoolExecutor(max_workers=threads or min(4, os.cpu_count() or 1),
                                        thread_name_prefix="ftidask-dcp")
        self._remover: ThreadPoolExecutor | None = None
        # level -> (data bytes, runs) written by its last differential checkpoints that patched a base
        self._recent_writes: dict[int, deque[tuple[int, int]]] = {level: deque(maxlen=2) for level in (1, 2, 3, 4)}

    def spare_path(self, level: int) -> Path:
        """This rank's spare file of ``level``: what the next differential checkpoint of that level patches."""
        return self.paths.level_dir(level, self.node) / storage.SPARE_DIR / storage.spare_file(self.rank)

    def spare_parity_path(self, level: int) -> Path:
        """The parity file kept for L3 parity updates (see :mod:`ftidask.levels.rs_delta`)."""
        return self.spare_path(level).with_name(storage.spare_file(self.rank, "RSed"))

    def spare_partner_path(self, level: int) -> Path:
        """The partner copy kept for L2 deltas (see :mod:`ftidask.levels.partner_delta`)."""
        return self.spare_path(level).with_name(storage.spare_file(self.rank, "Pcof"))

    def next_path(self, level: int) -> Path:
        """Where a checkpoint is written in full while the spare is the only sound copy (a fallback recovered)."""
        return self.spare_path(level).with_name(storage.spare_file(self.rank, "Next"))

    def begin(self, level: int, layout: Layout) -> DcpHandle:
        """Open the spare of ``level`` for patching up to ``layout`` (a new file while it is pinned)."""
        pinned = level in self._pinned  # the spare is what a crash now would recover: keep it, write everything
        path = self.next_path(level) if pinned else self.spare_path(level)
        if os.path.isdir(path) and not os.path.islink(path):  # no base, and in the way of every later checkpoint
            self._discard(path)
        clear_spare_place(path)  # a link at the spares' directory, or at the spare (never followed)
        self._keep_newest_file(level)
        base = None
        if not pinned:
            self.next_path(level).unlink(missing_ok=True)  # torn by a crash while the spare was pinned
            base = self._spares.pop(level, None)  # from now on the spare's content is unknown
            if base is None:  # after a restart: the spare's own block hashes, if it is the file retired
                known = storage.read_json(self._spare_record(level))
                if isinstance(known, dict) and isinstance(known.get("fb_hash"), str):
                    with contextlib.suppress(ValueError):
                        base = load_state(path, bytes.fromhex(known["fb_hash"]))
        with interrupts.held_off():  # Ctrl-C never between the descriptor and the try that closes it
            fd = storage.open_regular(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if pinned else 0),
                                      storage.FILE_MODE)  # a FIFO planted there would block the writes
            try:
                if base is not None and not _holds(fd, base):
                    base = None
                writer = DcpFileWriter(fd, layout, base, block_size=self.block_size, bid=self.bid,
                                       hash_id=self.hash_id, pool=self._pool,
                                       capture_xor=level == 3,  # L3 updates parity from old XOR new
                                       spill_dir=path.parent)  # a large delta beside the spare, not in memory
                return DcpHandle(self, level, fd, writer, path)
            except BaseException as exc:  # a full disk at its first write: the descriptor is not left open
                os.close(fd)
                if isinstance(exc, OSError):
                    raise storage.located(exc, path) from None
                raise

    def keeps(self, level: int, seq: int) -> bool:
        """Whether :meth:`retire` of checkpoint ``seq`` of ``level`` makes its file the spare (its state is known:
        written or recovered, verified, by this process), barring an error while renaming it."""
        return (level, seq) in self._files or (level, seq) in self._elsewhere

    def retire(self, level: int, seq: int, path: Path, ckpt_id: int | None = None) -> bool:
        """Checkpoint ``seq`` of ``level`` is no longer committed: keep its file as the spare
        (and, at L2, the partner copy it holds as the spare partner copy). True when it was kept."""
        self._pinned.discard(level)  # a newer checkpoint of this level or above is committed
        if level == 2 and ckpt_id is not None:
            pcof = path.parent / storage.partner_file(ckpt_id, self.rank)
            with contextlib.suppress(OSError):
                if pcof.exists():
                    self._discard(self.spare_partner_path(level))
                os.replace(pcof, self.spare_partner_path(level))
        state = self._files.pop((level, seq), None)
        if state is None:
            return False
        spare = self.spare_path(level)
        try:
            clear_spare_place(spare)
            self._discard(spare)
            os.replace(path, spare)
        except OSError:
            return False  # no spare: the next differential checkpoint writes everything
        self._spares[level] = state
        if level != 3 and aligns_writes(self.block_size) and self._short_runs(level):
            # Patching a file cached in large folios costs ~38 us per scattered write on ext4
            # (6.18), writing whole pages (see dcp._page_aligned) into uncached ones ~10 us; but
            # filling an empty cache costs ~0.2 ms per MiB written (100% changed: 0.93x of a full
            # checkpoint instead of 0.64x). So drop the cache when the writes are short. L3
            # reads the old bytes of what it patches, so its spare keeps its cache.
            self._remover_pool().submit(storage.drop_cache, spare)
        if level == 3 and ckpt_id is not None:  # the parity and its record (which files it encodes)
            rsed = path.parent / storage.parity_file(ckpt_id, self.rank)
            parity = self.spare_parity_path(level)
            with contextlib.suppress(OSError):
                if rsed.exists():
                    self._discard(parity)
                    hash_path(parity).unlink(missing_ok=True)
                    os.replace(rsed, parity)
                    os.replace(hash_path(rsed), hash_path(parity))
        write_spare_hint(spare, state.fb_hash.hex())
        return True

    def retired_elsewhere(self, level: int, seq: int) -> None:
        """Checkpoint ``seq`` of ``level``, of another layout, was retired (a spare replaced fails :func:`_holds`)."""
        self._pinned.discard(level)  # a newer checkpoint of this level or above is committed
        self.discard(level, seq)

    def _short_runs(self, level: int) -> bool:
        """Were the level's recent patches mostly short scattered writes? (The spare receives
        the changes of the last two intervals: judge by those.)"""
        recent = self._recent_writes[level]
        runs = sum(r for _b, r in recent)
        return runs > 0 and sum(b for b, _r in recent) < _SHORT_RUN * runs

    def _discard(self, path: Path) -> None:
        """Rename an old spare out of the way now and delete it in the background: freeing a
        GiB-sized file takes a noticeable time that a commit must not wait for."""
        storage.discard(path, self._remover_pool)

    def _remover_pool(self) -> ThreadPoolExecutor:
        if self._remover is None:
            self._remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-dcp-remove")
        return self._remover

    def _spare_record(self, level: int) -> Path:
        return spare_hint_path(self.spare_path(level))

    def _keep_newest_file(self, level: int) -> None:
        """Forget the states of this level's files but the newest: retirement pops them, but a head that
        raises every checkpoint to another level never retires one here (a BlockState per checkpoint)."""
        seqs = sorted(s for lv, s in self._files if lv == level)
        for seq in seqs[:-1]:
            del self._files[level, seq]

    def recovered(self, level: int, seq: int, path: Path, parsed: Any) -> None:
        """The file of a verified, recovered checkpoint: remember its state (it will be a spare)."""
        self._pinned.discard(level)  # a sound committed checkpoint: the spare may be patched again
        state = self._state_of(path, parsed)
        if state is not None:
            self._files[level, seq] = state

    def recovered_fallback(self, level: int, path: Path, parsed: Any) -> None:
        """The spare of ``level`` was recovered (no newer checkpoint could be): it stays untouched until a
        newer checkpoint of the level is committed, and is then patched from its known state."""
        self._pinned.add(level)
        state = self._state_of(path, parsed)
        if state is not None:
            self._spares[level] = state

    def redistributed(self, level: int, seq: int, fallback: bool) -> None:
        """A checkpoint of another layout was recovered: a ``fallback`` pins the spares, untouched until a newer one of
        the level is committed (:meth:`recovered_fallback`); a committed one is kept once retired (:meth:`keeps`)."""
        if fallback:
            self._pinned.add(level)
        else:
            self._elsewhere.add((level, seq))

    def _state_of(self, path: Path, parsed: Any) -> BlockState | None:
        """The block state of a verified file, when it can serve as a base here (its block size and hash)."""
        with contextlib.suppress(OSError, ValueError):
            state = state_of_file(path, parsed)
            if state is not None and state.compatible(self.block_size, self.bid):
                return state
        return None

    def discard(self, level: int, seq: int) -> None:
        """Checkpoint ``seq`` failed, or its file did not verify at a recovery: it never becomes the spare."""
        self._files.pop((level, seq), None)
        self._elsewhere.discard((level, seq))

    def forget(self) -> None:
        """Drop every known state (another process may have changed the files)."""
        self._spares.clear()
        self._files.clear()
        self._pinned.clear()
        self._elsewhere.clear()

    def clear(self) -> None:
        """Remove the spares (the run is over) and stop the hashing threads."""
        if self._remover is not None:
            self._remover.shutdown(wait=True)
            self._remover = None
        for level in (1, 2, 3, 4):
            for trash in _own_trash(self.spare_path(level).parent):
                storage.remove_tree(trash)
            parity = self.spare_parity_path(level)
            for path in (self.spare_path(level), self.next_path(level), self.spare_partner_path(level),
                         self._spare_record(level), parity, hash_path(parity)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(self.spare_path(level).parent)
        self.forget()
        self.close()

    def close(self) -> None:
        self.tracking.close()
        self._pool.shutdown(wait=True)
        if self._remover is not None:
            self._remover.shutdown(wait=True)


def _own_trash(folder: Path) -> list[Path]:
    """This process's trash in ``folder``; none once the folder is gone. L4's spare directory is every rank's: the
    clear of another rank may remove it between a look at it and its listing (a finalize failed on ENOENT)."""
    mark = f"-{os.getpid()}-"
    try:
        with os.scandir(folder) as entries:
            return [Path(e.path) for e in entries if e.name.startswith(storage.TRASH_PREFIX) and mark in e.name]
    except FileNotFoundError:
        return []


def spare_hint_path(spare: Path) -> Path:
    """Where the FB hash of the file that became ``spare`` is noted (see :func:`write_spare_hint`)."""
    return spare.with_suffix(".json")


def write_spare_hint(spare: Path, fb_hash: str) -> None:
    """Note that ``spare`` is the (committed, fsynced) file whose FB hash is ``fb_hash``: a process that
    did not retire it (a restarted one, or the rank a head moved it for) then trusts its own block-hash
    section. Not synced: a lost or stale hint only names another FB hash, and the spare is rewritten in full."""
    hint = spare_hint_path(spare)
    with contextlib.suppress(OSError):
        with interrupts.held_off():  # Ctrl-C never between the descriptor and its file object
            fd, tmp = storage.create_temp(hint, os.O_WRONLY)
            fh = os.fdopen(fd, "wb")
        with fh:
            fh.write(json.dumps({"fb_hash": fb_hash}).encode())
        os.replace(tmp, hint)


def distrust_spare(store: DcpStore | None, level: int, spare: Path) -> None:
    """A recovery found ``spare`` (this rank's spare of ``level``, checked as the previous checkpoint) damaged or not
    the file its fallback record names: forget its block state and its hint, so that the next differential
    checkpoint writes every block. Trusted, a damaged block that the next checkpoint does not change was kept
    as it was (only the changed blocks are written): that checkpoint was committed, reported written, and never
    verified. Best effort: a hint left only names an FB hash, which the next patch checks again."""
    if store is not None:
        store._spares.pop(level, None)
    with contextlib.suppress(OSError):
        spare_hint_path(spare).unlink(missing_ok=True)


def reclaim_retired(spare: Path, path: Path, fb_hash: str) -> bool:
    """Put back at ``path`` (a committed differential checkpoint's rank file, missing there) this rank's ``spare`` of
    its level when the spare is that file (its FB hash ``fb_hash``, as its commit record names): its retirement, by
    a newer commit, was interrupted after this rank moved it and before every rank had (the commit record of the
    retired checkpoint goes last), so that neither its commit record nor its level's fallback record found every
    rank's file, and a damaged newer checkpoint left nothing to recover. True when it was put back; the recovery
    then verifies every byte as for any file."""
    try:
        if spare.is_symlink():  # never a link moved into a checkpoint (a FIFO or device: refused by open_read)
            return False
        with storage.open_read(spare) as fh:
            raw = fh.read(FB_SIZE)
        if len(raw) != FB_SIZE or FileBlock.unpack(raw).hash.hex() != fb_hash:
            return False
        storage.makedirs(path.parent)
        os.replace(spare, path)
    except (OSError, FormatError):
        return False
    with contextlib.suppress(OSError):
        spare_hint_path(spare).unlink(missing_ok=True)
    return True


def _holds(fd: int, state: BlockState) -> bool:
    """True when the file at ``fd`` is still the one ``state`` describes (its FB hash)."""
    raw = os.pread(fd, FB_SIZE, 0)
    if len(raw) != FB_SIZE:
        return False
    try:
        return FileBlock.unpack(raw).hash == state.fb_hash
    except FormatError:
        return False


class DcpSlot:
    """A rank's differential-checkpoint store, made on first use and shared by its context's writer,
    recovery and retention (none of them holds the context: dropping it releases the run at once)."""

    def __init__(self, make: Callable[[], DcpStore]) -> None:
        self.make = make
        self.store: DcpStore | None = None

    def get(self) -> DcpStore:
        """The store, made now if this is its first use."""
        if self.store is None:
            self.store = self.make()
        return self.store
