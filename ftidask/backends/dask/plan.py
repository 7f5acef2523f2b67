"""Pure planning of a Dask checkpoint: which worker (rank) writes which chunks, and where.

Each worker writes one FTI-FF file. Inside it, variable ``id`` is the concatenation of the
chunks of array ``id`` that this worker holds, in chunk-grid (C) order, each chunk in C order:
one container per chunk, ``dptr`` its byte offset within those chunks. The chunk's grid index
and shape go into the variable table (``VarInfo.extra``) and into the commit record, so that
recovery knows which file holds which chunk without opening them all on the client.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...ftiff.layout import Block, Layout, Slot
from ...ftiff.structs import BMD_SIZE, FB_SIZE, VMD_SIZE
from ...model.arrays import VarInfo, dtype_to_json

GridIndex = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class VarSpec:
    """A protected Dask array as the planner sees it (no data)."""

    id: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    kind: str = "dask"  # "dask" or "numpy" (a NumPy array protected on a Dask cluster)
    pystate: str = ""  # a Python state's kind (ftidask.engine.pystate): its JSON bytes, a NumPy uint8 array
    device: bool = False  # its chunks are CuPy arrays (written from the host copies of their bytes)

    def grid(self) -> list[GridIndex]:
        """Every chunk's grid index, in C order."""
        return list(itertools.product(*(range(len(c)) for c in self.chunks)))

    def chunk_shape(self, index: GridIndex) -> tuple[int, ...]:
        """The shape of the chunk at grid index ``index``."""
        return tuple(c[i] for c, i in zip(self.chunks, index, strict=True))

    def chunk_nbytes(self, index: GridIndex) -> int:
        """Bytes of the chunk at grid index ``index``."""
        return math.prod(self.chunk_shape(index)) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-able dict (``pystate`` and ``device`` only when set)."""
        return {"id": self.id, "name": self.name, "dtype": dtype_to_json(self.dtype), "shape": list(self.shape),
                "chunks": [list(c) for c in self.chunks], "kind": self.kind} | (
                    {"pystate": self.pystate} if self.pystate else {}) | ({"device": True} if self.device else {})


@dataclasses.dataclass(frozen=True)
class ChunkPlace:
    """Where one chunk goes: rank ``rank``'s file, container ``containerid`` at byte ``dptr``."""

    var_id: int
    index: GridIndex
    rank: int
    containerid: int
    dptr: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One worker's file: its layout, variable table, and the chunks it writes in slot order."""

    rank: int
    layout: Layout
    infos: tuple[VarInfo, ...]
    chunks: tuple[ChunkPlace, ...]


def plan_ranks(variables: Sequence[VarSpec], owner: Mapping[tuple[int, GridIndex], int],
               nranks: int, codecs: Mapping[int, Mapping[str, Any]] | None = None) -> list[RankPlan]:
    """Plan every rank's file; ``owner[(var_id, index)]`` is the rank holding that chunk, ``codecs`` the
    numcodecs config of each variable to compress (recorded in its ``extra["codec"]``, which the writing
    worker follows; containers stay planned by the raw sizes, as the engine plans them)."""
    codecs = codecs or {}
    per_rank: list[list[ChunkPlace]] = [[] for _ in range(nranks)]
    per_rank_var: list[dict[int, list[ChunkPlace]]] = [{} for _ in range(nranks)]
    for var in variables:
        offsets = [0] * nranks
        for index in var.grid():
            rank = owner[var.id, index]
            held = per_rank_var[rank].setdefault(var.id, [])
            place = ChunkPlace(var.id, index, rank, len(held), offsets[rank], var.chunk_nbytes(index))
            offsets[rank] += place.nbytes
            held.append(place)
            per_rank[rank].append(place)
    plans = []
    index_of = {var.id: i for i, var in enumerate(variables)}
    for rank in range(nranks):
        places = per_rank[rank]
        fptr = FB_SIZE + BMD_SIZE + VMD_SIZE * len(places)
        slots = []
        for p in places:
            slots.append(Slot(p.var_id, index_of[p.var_id], p.containerid, p.dptr, fptr, p.nbytes, p.nbytes))
            fptr += p.nbytes
        layout = Layout((Block(FB_SIZE, tuple(slots)),) if slots else ())
        infos = []
        for var in variables:
            held = per_rank_var[rank].get(var.id, [])
            nbytes = sum(p.nbytes for p in held)
            extra = {"dask": {"shape": list(var.shape), "chunks": [list(c) for c in var.chunks], "kind": var.kind,
                              "blocks": [[list(p.index), list(var.chunk_shape(p.index)), p.dptr] for p in held]}}
            if var.pystate:
                extra["pystate"] = var.pystate
            if var.id in codecs and nbytes:  # as the engine: a variable of no bytes has nothing to compress
                extra["codec"] = dict(codecs[var.id])
            infos.append(VarInfo(var.id, var.name, var.dtype, (nbytes // var.dtype.itemsize,), "C", nbytes, extra))
        plans.append(RankPlan(rank, layout, tuple(infos), tuple(places)))
    return plans


def chunk_table(plans: Sequence[RankPlan]) -> dict[str, list[list[Any]]]:
    """For the commit record: var id -> ``[grid index, rank, dptr, nbytes]`` of every chunk."""
    table: dict[str, list[list[Any]]] = {}
    for plan in plans:
        for p in plan.chunks:
            table.setdefault(str(p.var_id), []).append([list(p.index), p.rank, p.dptr, p.nbytes])
    return table


def layout_to_json(layout: Layout) -> list[list[list[int]]]:
    """A layout as plain lists (what a task receives)."""
    return [[[s.var_id, s.idx, s.containerid, s.dptr, s.fptr, s.containersize, s.chunksize] for s in b.slots]
            for b in layout.blocks]


def layout_from_json(raw: Sequence[Sequence[Sequence[int]]]) -> Layout:
    """A rank file's FTI-FF layout from the blocks of slots a task receives (JSON lists: no pickled objects)."""
    blocks = []
    offset = FB_SIZE
    for slots in raw:
        block = Block(offset, tuple(Slot(*map(int, s)) for s in slots))
        blocks.append(block)
        offset += block.dbsize
    return Layout(tuple(blocks))


def compute_items(arr: Any) -> np.ndarray:
    """``arr`` computed into one NumPy array with every byte of each item. Dask joins the chunks of a structured
    dtype with NumPy's field-by-field copy, which drops the bytes no field covers (padding, ``itemsize`` beyond the
    fields): the chunks are joined as plain bytes and viewed back."""
    dtype = arr.dtype
    if dtype.fields is None:
        return arr.compute()
    raw = np.dtype((np.void, dtype.itemsize))
    return np.ascontiguousarray(arr.view(raw).compute()).view(dtype)  # (one chunk may come back strided)


def rechunk_items(arr: Any, chunks: Any) -> Any:
    """``arr.rechunk(chunks)`` keeping every byte of each item (see :func:`compute_items`)."""
    dtype = arr.dtype
    if dtype.fields is None:
        return arr.rechunk(chunks)
    return arr.view(np.dtype((np.void, dtype.itemsize))).rechunk(chunks).view(dtype)
