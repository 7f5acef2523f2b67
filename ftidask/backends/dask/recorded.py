"""The Dask part of a commit record (``CommitRecord.extra``): the variables, and where each chunk is.

The client writes it at each commit, and recovery plans every read from it without opening a file.
The record's digest finds a record damaged by chance, not one whose content is wrong but sealed (a
forgery, another version's bug): such content must not reach the planner as it is, where it
became an ``IndexError`` from deep inside or a read sent to rank 99. :func:`layout` checks it all,
and a record that fails is :class:`DamagedRecord`, which recovery treats as a lost file: that
checkpoint cannot be recovered, an older one may be.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any

from ...engine.runstate import CommitRecord
from ...model.arrays import dtype_from_json
from ...model.errors import FTIError
from .plan import GridIndex, VarSpec

_MAX_DIMS = 64  # NumPy's limit
_MAX_ID = 2**31  # variable ids are C ints in FTI-FF


class DamagedRecord(FTIError):
    """A Dask commit record whose content cannot describe the checkpoint it names."""


@dataclasses.dataclass(frozen=True)
class ChunkAt:
    """One chunk of a variable: in rank ``rank``'s file, ``nbytes`` at byte ``dptr`` of the variable."""

    index: GridIndex
    rank: int
    dptr: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """A checked Dask record: every variable, every chunk of its grid once, the dtypes as recorded
    (what the read tasks parse again) and the workers that wrote the files (rank order)."""

    specs: list[VarSpec]
    chunks: dict[int, list[ChunkAt]]
    raw_dtypes: dict[int, Any]
    workers: list[str]

    def expected(self, rank: int) -> list[tuple[int, list[int], int, int]]:
        """``(var id, grid index, dptr, nbytes)`` of every chunk with bytes in ``rank``'s file (what the
        file's check confirms against the file's own variable table)."""
        return [(vid, list(c.index), c.dptr, c.nbytes) for vid, rows in self.chunks.items() for c in rows
                if c.rank == rank and c.nbytes]


def _show(value: Any) -> str:
    """``value`` shortened for a message: reprlib stops at a few levels and items, where ``str`` of a forged value
    nested as deep as JSON allows recursed past Python's limit (a RecursionError, not the damage it is)."""
    return reprlib.repr(value)


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    if type(value) is not int or not lo <= value < hi:  # bool and float are no counts here
        raise DamagedRecord(f"{what} is {_show(value)}")
    return value


def _ints(value: Any, lo: int, hi: int, what: str, most: int = _MAX_DIMS) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > most:
        raise DamagedRecord(f"{what} is {_show(value)}")
    return tuple(_int(v, lo, hi, what) for v in value)


def _spec(raw: Any) -> VarSpec:
    if not isinstance(raw, dict):
        raise DamagedRecord(f"a variable is {_show(raw)}")
    vid = _int(raw.get("id"), -_MAX_ID, _MAX_ID, "a variable's id")
    what = f"variable {vid}"
    shape = _ints(raw.get("shape"), 0, 2**63, f"{what}'s shape")
    grid = raw.get("chunks")
    if not isinstance(grid, list) or len(grid) != len(shape):
        raise DamagedRecord(f"{what}'s chunks {_show(grid)} do not fit its shape {shape}")
    # Any number of chunks along an axis (Dask allows chunks of 0; the record's size bounds the lists), not
    # at most 64, a shape's bound: every array of more than 64 chunks along an axis was unrecoverable.
    chunks = tuple(_ints(c, 0, 2**63, f"{what}'s chunks", most=len(c) if isinstance(c, list) else 0) for c in grid)
    if any(sum(c) != n or not c for c, n in zip(chunks, shape, strict=True)):
        raise DamagedRecord(f"{what}'s chunks {_show(grid)} do not add up to its shape {shape}")
    name, kind, state = raw.get("name"), raw.get("kind", "dask"), raw.get("pystate", "")
    device = raw.get("device", False)
    if not isinstance(name, str) or kind not in ("dask", "numpy") or not isinstance(state, str) or not isinstance(
            device, bool):
        raise DamagedRecord(f"{what}: name {_show(name)}, kind {_show(kind)}, pystate {_show(state)}, device "
                            f"{_show(device)}")
    try:
        dtype = dtype_from_json(raw.get("dtype"))
    except FTIError as exc:
        raise DamagedRecord(f"{what}: {exc}") from None
    return VarSpec(vid, name, dtype, shape, chunks, kind, state, bool(device))


def _chunk_rows(spec: VarSpec, rows: Any, nranks: int) -> list[ChunkAt]:
    what = f"variable {spec.id}'s chunk table"
    if not isinstance(rows, list) or len(rows) != math.prod(len(c) for c in spec.chunks):
        # (before the grid is enumerated: forged chunks of 10**5 entries per axis make a grid of 10**10)
        raise DamagedRecord(f"{what} does not list every chunk of its grid once")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 4:
            raise DamagedRecord(f"{what} holds {_show(row)}")
        index = _ints(row[0], 0, 2**31, f"{what}'s grid index")
        if len(index) != len(spec.chunks) or any(i >= len(c) for i, c in zip(index, spec.chunks, strict=True)):
            raise DamagedRecord(f"{what}: grid index {list(index)} is outside the grid")
        at = ChunkAt(index, _int(row[1], 0, nranks, f"{what}'s rank"), _int(row[2], 0, 2**63, f"{what}'s dptr"),
                     _int(row[3], 0, 2**63, f"{what}'s byte count"))
        if at.nbytes != spec.chunk_nbytes(index):
            raise DamagedRecord(f"{what}: chunk {list(index)} has {at.nbytes} bytes, its shape holds "
                                f"{spec.chunk_nbytes(index)}")
        out.append(at)
    if sorted(c.index for c in out) != spec.grid():  # grid() is sorted: C order
        raise DamagedRecord(f"{what} does not list every chunk of its grid once")
    return out


def layout(record: CommitRecord) -> RecordLayout:
    """The checked content of Dask commit ``record``, or :class:`DamagedRecord` saying what is wrong."""
    extra = record.extra
    try:
        raw_vars, table = extra.get("vars"), extra.get("chunks")
        if not isinstance(raw_vars, list) or not isinstance(table, dict):
            raise DamagedRecord("it lists no variables or no chunk table")
        specs = [_spec(v) for v in raw_vars]
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids) or set(table) != {str(i) for i in ids}:
            raise DamagedRecord(f"its chunk table names variables {sorted(table)[:8]}, its variables are {ids[:8]}")
        chunks = {s.id: _chunk_rows(s, table[str(s.id)], record.nranks) for s in specs}
        workers = extra.get("workers", [])
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise DamagedRecord(f"its workers are {_show(workers)}")
    except DamagedRecord as exc:
        raise DamagedRecord(f"the commit record of checkpoint {record.ckpt_id} is damaged: {exc}") from None
    return RecordLayout(specs, chunks, {v["id"]: v["dtype"] for v in raw_vars}, list(workers))


def names(records: list[CommitRecord]) -> dict[int, str]:
    """The variables' names (by id) in the newest of ``records`` whose map is sound; {} if none is."""
    for record in records:
        try:
            return {spec.id: spec.name for spec in layout(record).specs}
        except DamagedRecord:
            continue
    return {}
