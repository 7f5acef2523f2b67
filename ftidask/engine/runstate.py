"""The run's identity (FTI's ``exec_id``), its status at start, and its commit records.

A checkpoint exists only once its commit record is written (last, atomically, by one
process): files without a record are an interrupted checkpoint and are never recovered.

Which run an init gets is chosen by :mod:`ftidask.engine.claim`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from ..model.config import check_exec_id
from ..model.errors import CheckpointError, ConfigError
from ..storage import files as storage
from ..storage import runlock
from .records import (
    CommitRecord,
    FileRecord,
    JsonFiles,
    RecordReader,
    seal_json,
    sealed_record,
    unsealed_record,
)

__all__ = ["CommitRecord", "FileRecord", "RunState", "SeqReservation", "seal_json", "sealed_record",
           "unsealed_record"]  # the records are re-exported: where the rest of the code looks for them

STATUS_FRESH, STATUS_RESTART, STATUS_KEPT = 0, 1, 2
_CURRENT = "current_exec_id"
log = logging.getLogger("ftidask")

#: An exec_id is one directory name: ASCII letters, digits, '-', '_', '.', starting with a letter or digit.


def read_current_exec_id(meta_dir: Path) -> str | None:
    """The exec_id ``{meta_dir}/current_exec_id`` names; None if missing. Damaged (unreadable, or not a
    valid exec_id), it is taken as naming the unfinished run whose last commit is the newest, if any:
    a damaged pointer must not leave a dead run's checkpoints behind, unused."""
    path = meta_dir / _CURRENT
    current = storage.read_json(path)
    value = current.get("exec_id") if isinstance(current, dict) else None
    if value is None:
        if not path.exists():
            return None
        why = f"{path} is unreadable or names no run"
    else:
        try:
            return check_exec_id(value, f"{path}")
        except ConfigError as exc:
            why = str(exc)
    found = _newest_unfinished_run(meta_dir)
    log.warning("ignoring %s; %s", why, f"restarting run {found!r}, the unfinished run committed last"
                if found else "no unfinished run with a checkpoint to restart")
    return found


def _newest_unfinished_run(meta_dir: Path) -> str | None:
    """The run under ``meta_dir`` with committed checkpoints, not finalized (or kept at finalize), whose
    newest commit record was written last; None if there is none."""
    best: tuple[float, str] | None = None
    for sub in meta_dir.iterdir() if meta_dir.is_dir() else ():
        try:
            exec_id = check_exec_id(sub.name, str(sub))
        except ConfigError:
            continue  # not a run's directory
        state = RunState(meta_dir, exec_id)
        try:
            if not sub.is_dir() or state.start_status() == STATUS_FRESH:
                continue
        except OSError as exc:  # another run's records that cannot be listed: not the one to restart
            log.warning("passing over run %s: %s", exec_id, exc)
            continue
        times = []
        try:
            for p in state.records_dir.glob("s*.json"):
                with contextlib.suppress(OSError):  # one record removed meanwhile, or a dangling link: not the run's
                    times.append(p.stat().st_mtime)
        except OSError:  # the records' directory removed meanwhile: a run that is being retired
            continue
        if not times:
            continue
        newest = max(times)
        if best is None or newest > best[0]:
            best = (newest, exec_id)
    return best[1] if best else None


def new_exec_id() -> str:
    """A new run's id: its start time, readable and sortable as FTI's, and 6 random hex digits so that two runs
    started in the same second (a side run, a job array) never share directories."""
    return time.strftime("%Y-%m-%d_%H-%M-%S") + "-" + secrets.token_hex(3)


#: Sequence numbers a :class:`SeqReservation` reserves in ``run.json`` at a time: one atomic write per that many
#: checkpoints, and a restart's numbers start at most that far past the last one used.
SEQ_BLOCK = 64


def _seq_mark(value: Any) -> int:
    """A sequence number noted in ``run.json``; 0 when missing, damaged or forged."""
    return value if type(value) is int and 0 <= value < 2**62 else 0


class SeqReservation:
    """Sequence numbers that no client of the run ever uses twice (the Dask backend's).

    A Dask checkpoint's tasks outlive the client that submitted them: a client killed, or a checkpoint that failed
    and was cancelled, leaves the tasks already running on worker threads to run to their end, while the cluster
    lives on. A number used again would give the next checkpoint the same directories, temporary names, task keys
    (distributed then hands the new checkpoint the result of the old task still running under that key) and
    worker-to-worker sessions as those orphans. So each number is taken from a block noted in ``run.json``
    (``seq_reserved``) before any task that uses it is submitted, never twice in this process, and a client that
    starts the run later (a restart) begins past every block reserved before it.
    """

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.last = self.upto = _seq_mark(state.run_info().get("seq_reserved"))  # every earlier client's

    def take(self) -> int:
        """The next sequence number, reserved durably; a :class:`CheckpointError` if it cannot be."""
        seq = max(self.state.next_seq(), self.last + 1)
        if seq > self.upto:
            seq = max(seq, _seq_mark(self.state.run_info().get("seq_reserved")) + 1)  # another Context's block
            upto = min(seq + SEQ_BLOCK - 1, 2**62 - 1)
            try:
                self.state.write_run(seq_reserved=upto)
            except OSError as exc:
                raise CheckpointError(f"cannot reserve sequence numbers in {self.state.root / 'run.json'}: "
                                      f"{exc}") from exc
            self.upto = upto
        self.last = seq
        return seq


class RunState:
    """Run metadata under ``{meta_dir}/{exec_id}``; read by every process, written by one."""

    def __init__(self, meta_dir: Path, exec_id: str) -> None:
        self.meta_dir = meta_dir
        self.exec_id = exec_id
        self.root = meta_dir / exec_id
        self._commits = self.root / "commits"
        self._fallback_paths = {level: self._commits / f"fallback-l{level}.json" for level in (1, 2, 3, 4)}
        self._records = RecordReader(self.records_dir)
        self._files = JsonFiles()  # run.json and the fallback records, read at every checkpoint
        self._numbered: list[CommitRecord] | None = None  # the records next_seq listed last (take_numbered)

    @property
    def records_dir(self) -> Path:
        """The directory of the commit records (and of the fallback records)."""
        return self._commits

    def records(self) -> list[CommitRecord]:
        """Every readable commit record, oldest first (a torn or damaged one is skipped; a file read before and
        unchanged since is not parsed again: :class:`~ftidask.engine.records.RecordReader`)."""
        return self._records.read()

    def take_numbered(self) -> list[CommitRecord]:
        """The records as :meth:`next_seq` listed them last (once; listed now if it did not since, or if a record was
        written or deleted here since): what the Dask backend's committer, the run's only writer of records, uses
        between numbering a checkpoint and sealing it, rather than a listing of its own."""
        numbered, self._numbered = self._numbered, None
        return numbered if numbered is not None else self.records()

    def next_seq(self) -> int:
        """One more than any sequence number this run used (records, fallbacks, and the mark finalize leaves
        in ``run.json``: a finished run started again never reuses its directory names, as in l4_archive); a
        :class:`CheckpointError` past the largest a record may hold (a forged record's: a checkpoint committed with
        it would never be read back, and it would retire the previous one)."""
        mark = _seq_mark(self.run_info().get("seq"))  # a damaged or forged mark: ignored
        self._numbered = self.records()
        seq = max([mark] + [r.seq for r in self._numbered + self.fallbacks()]) + 1
        if seq >= 2**63:
            raise CheckpointError(f"the commit records in {self.records_dir} use every sequence number (damaged or "
                                  "forged records): start another run")
        return seq

    def mark_seq(self) -> int:
        """Note the highest sequence number used so far in ``run.json`` (see :meth:`next_seq`), and return it.
        Best effort (a full disk must not stop a finalize that frees it): the finalized state carries it too."""
        used = self.next_seq() - 1
        try:
            self.write_run(seq=used)
        except OSError as exc:
            log.warning("cannot note the sequence numbers used in %s: %s", self.root / "run.json", exc)
        return used

    def write_record(self, record: CommitRecord) -> None:
        """Commit ``record`` (atomically); a :class:`CheckpointError` when it cannot be written (a full
        or read-only ``meta_dir``): then the previous checkpoint stays the newest."""
        name = f"s{record.seq:08d}.json"
        self._numbered = None  # that listing is out of date from now on
        try:
            raw = storage.write_json_atomic(self.records_dir / name, sealed_record(record))
        except OSError as exc:
            raise CheckpointError(f"writing its commit record in {self.records_dir} failed: {exc}") from exc
        self._records.note(name, raw)
        self._name_again()
        runlock.lock_again(self.root)  # (a stat: its lock file removed with the meta_dir, no other init adopts it)

    def _name_again(self) -> None:
        """``current_exec_id`` removed during the run (or the whole ``meta_dir``): a restart would start afresh and
        leave this record unused; name this run again (no other run holds the pointer). Never fails the commit."""
        if os.path.lexists(self.meta_dir / _CURRENT):
            return
        try:
            with runlock.choosing(self.meta_dir):  # as an init chooses its run: one at a time
                if not os.path.lexists(self.meta_dir / _CURRENT):
                    self.make_current()
        except OSError as exc:
            log.warning("%s is missing and cannot be written again (%s): a restart without exec_id will not find "
                        "run %s; pass exec_id=%r", self.meta_dir / _CURRENT, exc, self.exec_id, self.exec_id)
        else:
            log.warning("%s was removed during the run: it names run %s again", self.meta_dir / _CURRENT,
                        self.exec_id)

    def delete_record(self, seq: int) -> None:
        """Remove commit record ``seq`` (already gone is fine)."""
        self._numbered = None
        try:
            os.unlink(self.records_dir / f"s{seq:08d}.json")
        except FileNotFoundError:
            pass

    def fallbacks(self) -> list[CommitRecord]:
        """The previous differential checkpoint of each level that keeps one (see :meth:`write_fallback`)."""
        out = []
        for level in (1, 2, 3, 4):
            rec = self._files.read(self._fallback_path(level), unsealed_record)
            if rec is not None and rec.level == level and rec.fallback:
                out.append(rec)
        return out

    def write_fallback(self, record: CommitRecord) -> None:
        """Name the retired differential checkpoint ``record``, whose files are now the spares, as the one
        a recovery falls back to when no committed checkpoint verifies (FTI's dCP goes back a layer). Best
        effort: without it, nothing older than the committed checkpoints is recovered."""
        path = self._fallback_path(record.level)
        try:
            storage.write_json_atomic(path, sealed_record(record.as_fallback()))
        except OSError as exc:
            log.warning("cannot keep checkpoint %d as the fallback of level %d: %s", record.ckpt_id, record.level, exc)
        finally:  # read again next time, whatever its signature (JsonFiles.forget)
            self._files.forget(path)

    def delete_fallbacks(self) -> None:
        """The spares are gone (the run is over): nothing to fall back to."""
        for level in (1, 2, 3, 4):
            self._drop_fallback(level)

    def note_retired(self, record: CommitRecord, kept: bool) -> None:
        """Checkpoint ``record`` is being retired, differential checkpoints on: a differential one whose files
        became the spares (``kept``) is its level's fallback now (:meth:`write_fallback`), one written in full
        drops the older fallbacks it passes (:meth:`retired_in_full`). Before its commit record goes."""
        if not record.extra.get("dcp"):
            self.retired_in_full(record)
        elif kept:
            self.write_fallback(record)

    def retired_in_full(self, record: CommitRecord) -> None:
        """Checkpoint ``record``, written in full (not differentially), is being retired: its file is not kept,
        so a fallback of its level or below that is older than it is no longer the checkpoint before the newest
        (recovering it would go back past ``record``): it is dropped."""
        for rec in self.fallbacks():
            if rec.level <= record.level and rec.seq < record.seq:
                self._drop_fallback(rec.level)

    def _drop_fallback(self, level: int) -> None:
        path = self._fallback_path(level)
        try:
            path.unlink(missing_ok=True)
        finally:  # a fallback written next in its place may get its inode, size and times (JsonFiles.forget)
            self._files.forget(path)

    def _fallback_path(self, level: int) -> Path:
        return self._fallback_paths.get(level) or self.records_dir / f"fallback-l{level}.json"

    def run_info(self) -> dict[str, Any]:
        """The run's ``run.json`` as a dict; {} when missing, unreadable, or naming another run."""
        info = self._files.read(self.root / "run.json", lambda raw: raw)
        if not isinstance(info, dict):
            return {}
        info = dict(info)  # the caller's to change (write_run): flat, as written (see write_run)
        if info.get("exec_id", self.exec_id) != self.exec_id:  # copied from another run: not this run's state
            log.warning("ignoring %s: it names run %r", self.root / "run.json", info.get("exec_id"))
            return {}
        return info

    def write_run(self, **changes: Any) -> None:
        """Update ``run.json`` with ``changes`` (atomically; the other keys are kept)."""
        info = self.run_info()
        info.update(changes, exec_id=self.exec_id)
        try:
            storage.write_json_atomic(self.root / "run.json", info)
        finally:  # read again next time, whatever its signature (JsonFiles.forget)
            self._files.forget(self.root / "run.json")

    def make_current(self) -> None:
        """Name this run in ``{meta_dir}/current_exec_id``: the run that an init without exec_id restarts."""
        storage.write_json_atomic(self.meta_dir / _CURRENT, {"exec_id": self.exec_id})

    def start_status(self, dcp: bool = True) -> int:
        """The status this run restarts with (FTI_Status): kept, restart, or fresh (nothing to recover; a
        previous differential checkpoint kept as the spares counts with ``dcp`` only)."""
        if not self.records() and not (dcp and self.fallbacks()):
            return STATUS_FRESH
        info = self.run_info()
        if info.get("state") != "finalized":
            return STATUS_RESTART
        return STATUS_KEPT if info.get("keep_last") else STATUS_FRESH
