"""Commit records: the files that make a checkpoint exist, sealed with a digest of their content, and read back
from their directory with a cache that re-reads only a record file that changed.

A checkpoint exists only once its commit record is written (last, atomically, by one process). A run that keeps
every L4 checkpoint (``keep_l4_ckpt``) keeps every L4 record: each checkpoint lists them (to number the next, to
retire, to collect what interrupted ones left), so reading them all anew each time made a checkpoint cost
0.45 ms per record kept (266 ms after 600). :class:`RecordReader` parses a file only when its identity, size or
times changed since it was read: an outside change (a damaged or forged record) is read, as before.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from ..storage import files as storage

log = logging.getLogger("ftidask")
T = TypeVar("T")

#: Record files parsed and directory listings of the records, for the tests and benchmarks (a listing served from
#: the cache parses none; each listing still looks at every record file's signature); the other state files read
#: (:class:`JsonFiles`).
stats = {"parsed": 0, "listed": 0, "files_parsed": 0}


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One rank's file in a committed checkpoint."""

    rank: int
    node: int
    size: int
    fb_hash: str

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict."""
        return {"rank": self.rank, "node": self.node, "size": self.size, "fb_hash": self.fb_hash}


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """A committed checkpoint: which id, level and files, written after every file."""

    seq: int
    ckpt_id: int
    level: int
    timestamp: float
    nranks: int
    files: tuple[FileRecord, ...]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dirname(self) -> str:
        """The checkpoint's directory name, ``ckpt{ckpt_id}.s{seq}``."""
        return storage.ckpt_dirname(self.ckpt_id, self.seq)

    @property
    def fallback(self) -> bool:
        """A retired differential checkpoint kept as the spares (:meth:`RunState.write_fallback`), not a commit."""
        return self.extra.get("fallback") is True

    def as_fallback(self) -> CommitRecord:
        """This record marked as its level's fallback (see :attr:`fallback`)."""
        return dataclasses.replace(self, extra={**self.extra, "fallback": True})

    def committed_copy(self, **changes: Any) -> CommitRecord:
        """This checkpoint with ``changes`` (a copy of its files committed anew: never a fallback)."""
        extra = {k: v for k, v in self.extra.items() if k != "fallback"}
        return dataclasses.replace(self, **{"extra": extra, **changes})

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict (:meth:`from_json` reads it back), its ``extra`` a copy. Written out, not
        ``dataclasses.asdict``, which copied every file record twice: a recovery sends every record kept to the
        ranks (with keep_l4_ckpt, thousands: 90 us each)."""
        return {"seq": self.seq, "ckpt_id": self.ckpt_id, "level": self.level, "timestamp": self.timestamp,
                "nranks": self.nranks, "files": [f.to_json() for f in self.files], "extra": _copied(self.extra)}

    @classmethod
    def from_json(cls, raw: Any) -> CommitRecord | None:
        """The record ``raw`` describes, or None for a torn, damaged or forged one (never recovered)."""
        try:
            files = tuple(FileRecord(int(f["rank"]), int(f["node"]), int(f["size"]), str(f["fb_hash"]))
                          for f in raw["files"])
            record = cls(int(raw["seq"]), int(raw["ckpt_id"]), int(raw["level"]), float(raw["timestamp"]),
                         int(raw["nranks"]), files, dict(raw.get("extra", {})))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinity
            return None
        return record if record.plausible() else None

    def plausible(self) -> bool:
        """Values that a commit ever holds: a record outside them names directories and ranks that
        cannot exist (a seq of 1e300 makes a path too long, an infinite time breaks ``list``)."""
        ranks = sorted(f.rank for f in self.files)
        return (0 < self.seq < 2**63 and self.ckpt_id != 0 and -2**31 <= self.ckpt_id < 2**31
                and 1 <= self.level <= 8 and 0 <= self.timestamp < _YEAR_9999 and 0 < self.nranks < 2**31
                and ranks == list(range(self.nranks)) and all(0 <= f.node < 2**31 and f.size >= 0 for f in self.files))


def _copied(value: Any) -> Any:
    """A deep copy of JSON-like ``value`` (what ``dataclasses.asdict`` made of a record's ``extra``), 5x faster
    than ``copy.deepcopy`` for dicts, lists, tuples and scalars; anything else is deep-copied."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value if value is None or isinstance(value, (str, int, float)) else copy.deepcopy(value)


_CHECK = "check"  # a commit record's digest of its own content (see sealed_record)
_YEAR_9999 = 253402300800  # a record's time is time.time(): time.localtime() refuses NaN, infinities, year 10000
_FIELDS = frozenset(f.name for f in dataclasses.fields(CommitRecord))


def _digest(raw: dict[str, Any]) -> str:
    # As read back: JSON turns int keys into str keys (and tuples into lists), which sort differently.
    body = json.loads(json.dumps({k: v for k, v in raw.items() if k != _CHECK}))
    return hashlib.blake2b(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), digest_size=16).hexdigest()


def sealed_record(record: CommitRecord) -> dict[str, Any]:
    """``record`` as written to disk: its JSON with a digest of that JSON, so that a damaged record
    that still parses (a digit flipped in ``nranks``, a node, a size) is detected, not trusted."""
    return seal_json(record.to_json())


def seal_json(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a record's JSON) with its digest set to match its other keys (tools, tests' forgeries)."""
    raw[_CHECK] = _digest(raw)
    return raw


def unsealed_record(raw: Any) -> CommitRecord | None:
    """The record a commit file holds, or None when it is torn or damaged: its digest does not match
    its content, or (records written before the digest existed) it holds a key no record has."""
    if not isinstance(raw, dict):
        return None
    if _CHECK in raw:
        if raw[_CHECK] != _digest(raw):
            return None
    elif not set(raw) <= _FIELDS:
        return None
    return CommitRecord.from_json(raw)


def _signature(entry: os.DirEntry[str]) -> tuple[int, ...] | None:
    """What tells a record file changed: inode, device, size, mode, and the modification and change times
    (``ctime`` cannot be set back). None when it cannot be told (then it is read). Of the file read: a record
    that is a symbolic link is read through it, so its target's (the link's own stay the same when the target
    is damaged or replaced)."""
    try:
        return _of(entry.stat(follow_symlinks=True))
    except OSError:
        return None


def _of(st: os.stat_result) -> tuple[int, ...]:
    return st.st_ino, st.st_dev, st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns


#: How long after its last change a state file's signature alone is trusted (:class:`JsonFiles`): timestamps may be
#: as coarse as 1 s (ext4 with 128-byte inodes, Lustre; a clock tick on ext4/XFS before Linux 6.13).
SETTLED_NS = 2 * 10**9


class JsonFiles:
    """Values parsed from single JSON files (``run.json``, the fallback records), parsed again only when a file
    changes: each checkpoint reads them to number itself, and most often nothing changed. Kept only for a file read
    whole: one missing, unreadable or refused is read again next time.

    A file unchanged for :data:`SETTLED_NS` is trusted while its signature (:func:`_of`) stays the same: any change
    since gets later times. One changed more recently is read again and compared byte for byte (parsed only when
    they differ): where timestamps are coarse, a file removed and written again within one tick (a fallback record
    dropped and written by one retirement, in this process or a head's) often gets the freed inode, the same size
    and the same times, so its signature still named what was read before."""

    def __init__(self) -> None:
        # path -> (signature, settled: changed before SETTLED_NS, the bytes read, their value)
        self._known: dict[str, tuple[tuple[int, ...], bool, bytes, Any]] = {}

    def read(self, path: Path, parse: Callable[[Any], T]) -> T:
        """``parse`` of the JSON at ``path`` (of None when it is missing or unreadable: ``storage.read_json``)."""
        key = str(path)
        try:
            st: os.stat_result | None = os.stat(key)
        except (FileNotFoundError, NotADirectoryError):  # missing (a link to nothing too): what read_json reads
            self._known.pop(key, None)
            return parse(None)
        except OSError:
            st = None
        sig = None if st is None else _of(st)
        cached = self._known.pop(key, None)
        if sig is not None and cached is not None and cached[0] == sig and cached[1]:
            self._known[key] = cached
            return cast(T, cached[3])
        try:  # stat first: what is read is at least as new as the signature kept
            data: bytes | None = storage.read_regular(path)
        except OSError:
            data = None
        if data is not None and cached is not None and data == cached[2]:
            whole, value = True, cached[3]  # changed on disk (or recently), not in content: not parsed again
        else:
            stats["files_parsed"] += 1
            raw = None if data is None else storage.json_of(data)
            whole, value = raw is not None, parse(raw)
        if st is not None and sig is not None and data is not None and whole:
            settled = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > SETTLED_NS
            self._known[key] = (sig, settled, data, value)
        return value

    def forget(self, path: Path) -> None:
        """This process replaces or removes the file at ``path``: read it again next time, whatever its signature.
        Where timestamps are coarse (1 s on ext4 with 128-byte inodes, a clock tick before Linux 6.13), a file
        removed and written again within one tick often gets the freed inode and the same size and times: its
        signature would still name what was read before (a fallback record unlinked by ``retired_in_full``, and
        the next retirement's written in its place: the stale one named spares that no longer hold it)."""
        self._known.pop(str(path), None)


class RecordReader:
    """The commit records of one directory, parsed once each while their files stay the same."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._known: dict[str, tuple[tuple[int, ...], CommitRecord]] = {}

    def read(self) -> list[CommitRecord]:
        """Every readable record (``s*.json``), oldest first (a torn or damaged one is skipped)."""
        stats["listed"] += 1
        try:
            with os.scandir(self.directory) as it:
                entries = [e for e in it if e.name.startswith("s") and e.name.endswith(".json")]
        except (FileNotFoundError, NotADirectoryError):  # none yet
            self._known = {}
            return []
        # Any other error (EACCES, EIO, ESTALE, EMFILE) is raised: read as "no records" (as the glob read them), the
        # next checkpoint took a committed one's sequence number, and the garbage collection removed every committed
        # checkpoint's directory. The callers make it a clear error (an init's FTIError, the same CheckpointError on
        # every rank).
        known, out = {}, []
        for entry in entries:
            sig = _signature(entry)
            cached = self._known.get(entry.name)
            if sig is not None and cached is not None and cached[0] == sig:
                rec = cached[1]
            else:
                stats["parsed"] += 1
                rec = unsealed_record(storage.read_json(Path(entry.path)))
                if rec is None:  # torn or damaged: never a checkpoint (the recovery's error lists what it tried)
                    log.debug("ignoring the torn or damaged commit record %s", entry.path)
            if sig is not None and rec is not None:  # one that could not be read (EIO, a lease held on it:
                known[entry.name] = (sig, rec)  # EAGAIN) is read again next time, whatever its times say
            if rec is not None:
                out.append(rec)
        self._known = known  # a whole new map: records of files gone are dropped
        return sorted(out, key=lambda r: r.seq)

    def note(self, name: str, raw: bytes) -> None:
        """Record file ``name`` was just written by this process with the bytes ``raw`` (sealed): kept as a listing
        would read it, without reading it back (the retirement that follows the commit lists it)."""
        try:
            sig = _of(os.stat(self.directory / name))
        except OSError:
            return  # read at the next listing
        rec = CommitRecord.from_json(json.loads(raw))
        if rec is not None:
            self._known[name] = (sig, rec)
