"""The run's identity (FTI's ``exec_id``), its status at start, and its commit records.

A checkpoint exists only once its commit record is written (last, atomically, by one
process): files without a record are an interrupted checkpoint and are never recovered.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from pathlib import Path
from typing import Any

from . import storage

STATUS_FRESH, STATUS_RESTART, STATUS_KEPT = 0, 1, 2
_CURRENT = "current_exec_id"


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One rank's file in a committed checkpoint."""

    rank: int
    node: int
    size: int
    fb_hash: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        return storage.ckpt_dirname(self.ckpt_id, self.seq)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["files"] = [f.to_json() for f in self.files]
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CommitRecord | None:
        try:
            files = tuple(FileRecord(int(f["rank"]), int(f["node"]), int(f["size"]), str(f["fb_hash"]))
                          for f in raw["files"])
            return cls(int(raw["seq"]), int(raw["ckpt_id"]), int(raw["level"]), float(raw["timestamp"]),
                       int(raw["nranks"]), files, dict(raw.get("extra", {})))
        except (KeyError, TypeError, ValueError):
            return None


def new_exec_id() -> str:
    return time.strftime("%Y-%m-%d_%H-%M-%S") + "-" + secrets.token_hex(3)


class RunState:
    """Run metadata under ``{meta_dir}/{exec_id}``; read by every process, written by one."""

    def __init__(self, meta_dir: Path, exec_id: str) -> None:
        self.meta_dir = meta_dir
        self.exec_id = exec_id
        self.root = meta_dir / exec_id

    @property
    def records_dir(self) -> Path:
        return self.root / "commits"

    def records(self) -> list[CommitRecord]:
        """Every readable commit record, oldest first."""
        out = []
        if self.records_dir.is_dir():
            for path in self.records_dir.glob("s*.json"):
                rec = CommitRecord.from_json(storage.read_json(path))
                if rec is not None:
                    out.append(rec)
        return sorted(out, key=lambda r: r.seq)

    def next_seq(self) -> int:
        """One more than any sequence number this run used (records and directories left behind)."""
        return max([0] + [r.seq for r in self.records()]) + 1

    def write_record(self, record: CommitRecord) -> None:
        storage.write_json_atomic(self.records_dir / f"s{record.seq:08d}.json", record.to_json())

    def delete_record(self, seq: int) -> None:
        try:
            os.unlink(self.records_dir / f"s{seq:08d}.json")
        except FileNotFoundError:
            pass

    def run_info(self) -> dict[str, Any]:
        return storage.read_json(self.root / "run.json") or {}

    def write_run(self, **changes: Any) -> None:
        info = self.run_info()
        info.update(changes, exec_id=self.exec_id)
        storage.write_json_atomic(self.root / "run.json", info)
        storage.write_json_atomic(self.meta_dir / _CURRENT, {"exec_id": self.exec_id})


def resolve_run(meta_dir: Path, configured: str | None) -> tuple[str, int]:
    """``(exec_id, status)`` at start: the previous run's identity on a restart, a new one otherwise."""
    candidate = configured
    if candidate is None:
        current = storage.read_json(meta_dir / _CURRENT)
        if isinstance(current, dict) and isinstance(current.get("exec_id"), str):
            candidate = current["exec_id"]
    if candidate is not None:
        state = RunState(meta_dir, candidate)
        info = state.run_info()
        if state.records():
            if info.get("state") == "finalized":
                if info.get("keep_last"):
                    return candidate, STATUS_KEPT
            else:
                return candidate, STATUS_RESTART
        if configured is not None:
            return configured, STATUS_FRESH
    return new_exec_id(), STATUS_FRESH
