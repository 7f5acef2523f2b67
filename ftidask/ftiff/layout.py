"""Pure layout planning: which bytes of which variable go in which FTI-FF container.

No I/O here. Containers are fixed once created: a variable that grows gets one new
container (holding the missing bytes) in a block appended for this checkpoint; a variable
that shrinks keeps its containers, partly filled or empty (FTI-FF v1.1 semantics).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

from .structs import BMD_SIZE, FB_SIZE, VMD_SIZE


@dataclasses.dataclass(frozen=True)
class Slot:
    """One container: ``chunksize`` bytes of variable ``var_id`` from ``dptr``, stored at ``fptr``."""

    var_id: int
    idx: int
    containerid: int
    dptr: int
    fptr: int
    containersize: int
    chunksize: int

    @property
    def hascontent(self) -> bool:
        """Whether the container holds any bytes (``chunksize > 0``)."""
        return self.chunksize > 0


@dataclasses.dataclass(frozen=True)
class Block:
    """One variable chunk block (VCB): metadata then its containers' data."""

    offset: int
    slots: tuple[Slot, ...]

    @property
    def numvars(self) -> int:
        """Number of containers in the block (FTI's ``numvars``)."""
        return len(self.slots)

    @property
    def metasize(self) -> int:
        """Bytes of the block's metadata: its BMD and one VMD per container."""
        return BMD_SIZE + VMD_SIZE * len(self.slots)

    @functools.cached_property
    def dbsize(self) -> int:
        """The block's size in the file: its metadata and its containers (FTI's ``dbsize``)."""
        # cached (the block is frozen): a checkpoint asks for it several times, a sum over every container each
        return self.metasize + sum(s.containersize for s in self.slots)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The whole VB of one file."""

    blocks: tuple[Block, ...] = ()

    @functools.cached_property
    def fs(self) -> int:
        """Size of FB + VB (FTI's ``fs``)."""
        return FB_SIZE + sum(b.dbsize for b in self.blocks)

    @functools.cached_property
    def ckpt_size(self) -> int:
        """Bytes of variable data held (FTI's ``ckptSize``)."""
        return sum(s.chunksize for s in self.slots())

    def slots(self) -> Iterator[Slot]:
        """Every container of the file, block by block."""
        for block in self.blocks:
            yield from block.slots

    @functools.cached_property
    def _by_var(self) -> dict[int, tuple[tuple[int, int, Slot], ...]]:
        # Made once per layout: a file of n variables was planned in n scans of every container (4.4 s at 5000).
        out: dict[int, list[tuple[int, int, Slot]]] = {}
        for bi, block in enumerate(self.blocks):
            for si, s in enumerate(block.slots):
                out.setdefault(s.var_id, []).append((bi, si, s))
        return {vid: tuple(held) for vid, held in out.items()}

    def positions_of(self, var_id: int) -> tuple[tuple[int, int, Slot], ...]:
        """The containers of variable ``var_id`` in file order, each with its block's index and its own in it."""
        return self._by_var.get(var_id, ())

    def slots_of(self, var_id: int) -> list[Slot]:
        """The containers of variable ``var_id``, in file order."""
        return [s for _b, _i, s in self._by_var.get(var_id, ())]

    def capacity(self, var_id: int) -> int:
        """Bytes that the containers of variable ``var_id`` can hold."""
        return sum(s.containersize for _b, _i, s in self._by_var.get(var_id, ()))


def plan_layout(previous: Layout | None, variables: Sequence[tuple[int, int]]) -> Layout:
    """The layout for this checkpoint.

    ``variables`` lists ``(var_id, nbytes)`` in protection order (the index is FTI's ``idx``).
    Variables no longer listed keep their containers, emptied.
    """
    previous = previous or Layout()
    planned = tuple(variables)
    if previous.__dict__.get(_PLANNED) == planned:  # planned for these very variables: it is its own plan
        return previous
    sizes = dict(variables)
    if len(sizes) != len(variables):
        ids = [vid for vid, _n in variables]
        raise ValueError(f"duplicate variable ids in {ids}")
    index = {vid: i for i, (vid, _n) in enumerate(variables)}
    blocks: list[Block] = []
    capacity: dict[int, int] = {}  # var id -> bytes its containers hold, and how many it has
    held: dict[int, int] = {}
    changed = False
    for block in previous.blocks:
        slots, same = [], True
        for s in block.slots:
            vid = s.var_id
            nbytes = sizes.get(vid)
            if nbytes is None:  # no longer protected: emptied, its index kept
                idx, chunk = s.idx, 0
            else:
                idx, chunk = index[vid], max(0, min(s.containersize, nbytes - s.dptr))
                capacity[vid] = capacity.get(vid, 0) + s.containersize
                held[vid] = held.get(vid, 0) + 1
            # a container planned as before is the same (frozen) object: a run's checkpoints of unchanged
            # variables then reuse the previous layout whole, and what it cached (20 us a variable before)
            if idx != s.idx or chunk != s.chunksize:
                s, same = Slot(vid, idx, s.containerid, s.dptr, s.fptr, s.containersize, chunk), False
            slots.append(s)
        blocks.append(block if same else Block(block.offset, tuple(slots)))
        changed = changed or not same
    growth: list[tuple[int, int, int, int]] = []  # var_id, containerid, dptr, size
    for vid, nbytes in variables:
        have = capacity.get(vid, 0)
        if nbytes > have:
            growth.append((vid, held.get(vid, 0), have, nbytes - have))
    if not growth and not changed:
        return _planned_for(previous, planned)
    if growth:
        offset = previous.fs
        fptr = offset + BMD_SIZE + VMD_SIZE * len(growth)
        slots_new = []
        for vid, cid, dptr, size in growth:
            slots_new.append(Slot(vid, index[vid], cid, dptr, fptr, size, size))
            fptr += size
        blocks.append(Block(offset, tuple(slots_new)))
    return _planned_for(Layout(tuple(blocks)), planned)


#: A layout's attribute naming the variables it was planned for: planned again for the same ones, it comes out
#: the same (every variable fits its containers, filled as before), so a run of unchanged variables skips the plan.
_PLANNED = "_planned_for"


def _planned_for(layout: Layout, planned: tuple[tuple[int, int], ...]) -> Layout:
    object.__setattr__(layout, _PLANNED, planned)  # frozen: set as its cached properties are, outside the fields
    return layout


def layout_from_slots(blocks: Sequence[Sequence[Slot]]) -> Layout:
    """Rebuild a :class:`Layout` from the containers of a file, its offsets recomputed: each block's and each
    container's ``fptr``, where ftidask writes them. A file of FTI 1.2+ (metadata at its end) counts ``fptr`` from
    the start of its data, not of the file: copied, the next checkpoint wrote its data over its own file block."""
    offset = FB_SIZE
    out = []
    for slots in blocks:
        fptr = offset + BMD_SIZE + VMD_SIZE * len(slots)
        placed = []
        for s in slots:
            placed.append(s if s.fptr == fptr else dataclasses.replace(s, fptr=fptr))
            fptr += s.containersize
        block = Block(offset, tuple(placed))
        out.append(block)
        offset += block.dbsize
    return Layout(tuple(out))
