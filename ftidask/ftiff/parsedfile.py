"""A parsed FTI-FF file (:class:`FtiffFile`: what :func:`ftidask.ftiff.reader.parse_ftiff` returns, its structure
checked) and its identity on disk, which tells the file verified from the same path modified or replaced since.

Separate from :mod:`ftidask.ftiff.reader` (parsing, verifying and reading a file), which returns it, so that the
reader keeps room for those.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType
from typing import Any, BinaryIO

from ..model.arrays import VarInfo
from ..model.errors import FormatError
from .layout import Layout, Slot, layout_from_slots
from .structs import BlockMeta, ContainerMeta, FileBlock


@dataclasses.dataclass(frozen=True)
class FtiffFile:
    """The parsed, structurally checked metadata of one file."""

    path: str
    file_size: int  # the bytes that are the file: less than the file's size for a padded FTI L3 rank file
    fb: FileBlock
    blocks: tuple[tuple[BlockMeta, tuple[ContainerMeta, ...]], ...]
    trailer: dict[str, Any] | None
    vars: dict[int, VarInfo]
    identity: tuple[int, ...] = (0, 0, 0, 0, 0)  # device, inode, size, mtime_ns, ctime_ns when parsed
    tail: bool = False  # FTI 1.2+ layout: data first, metadata at the end (tailmeta.py)

    @property
    def legacy(self) -> bool:
        """True for a file written by FTI 1.1 (MD5 everywhere, no variable table)."""
        return self.fb.legacy

    def containers(self) -> Iterator[tuple[int, int, ContainerMeta]]:
        """Every container's ``(block index, index in block, metadata)``, in file order."""
        for bi, (_bmd, metas) in enumerate(self.blocks):
            for ci, meta in enumerate(metas):
                yield bi, ci, meta

    def containers_of(self, ids: Collection[int]) -> Iterator[tuple[int, int, ContainerMeta]]:
        """The containers of the variables ``ids``, as :meth:`containers` gives them (file order)."""
        if 4 * len(ids) >= len(self.var_nbytes()):  # most of them: one pass (no index made for it)
            return (c for c in self.containers() if c[2].id in ids)
        # A few of many (recover_var()): from the index, never a pass over every container per call
        return iter(sorted(c for vid in ids for c in self._by_var.get(vid, ())))

    @functools.cached_property
    def _by_var(self) -> dict[int, list[tuple[int, int, ContainerMeta]]]:
        out: dict[int, list[tuple[int, int, ContainerMeta]]] = {}
        for c in self.containers():
            out.setdefault(c[2].id, []).append(c)
        return out

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, made once per parsed file under ``key`` (what a reader derives from it per call otherwise)."""
        cache = self.__dict__.setdefault("_memo", {})  # as functools.cached_property: beside the frozen fields
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def var_nbytes(self) -> Mapping[int, int]:
        """Bytes held per variable id (read-only: computed once per parsed file)."""
        return self._var_nbytes

    def layout(self) -> Layout:
        """The container layout, for planning the next checkpoint on top of it (built once per parsed file)."""
        return self._layout

    # Cached: each recover_var(), stored_size() and recovery of a file asked for them again, a pass over every
    # container each time (recover_var() of each of 10,000 variables made 10,000 passes over 10,000 containers).
    @functools.cached_property
    def _var_nbytes(self) -> Mapping[int, int]:
        if self.vars:
            return MappingProxyType({vid: info.nbytes for vid, info in self.vars.items()})
        sizes: dict[int, int] = {}
        for _bi, _ci, meta in self.containers():
            sizes[meta.id] = sizes.get(meta.id, 0) + (meta.chunksize if meta.hascontent else 0)
        return MappingProxyType(sizes)

    @functools.cached_property
    def _layout(self) -> Layout:
        return layout_from_slots([
            [Slot(m.id, m.idx, m.containerid, m.dptr, m.fptr, m.containersize, m.chunksize if m.hascontent else 0)
             for m in metas] for _bmd, metas in self.blocks])


def identity_of(stat: os.stat_result) -> tuple[int, ...]:
    """What tells a file from itself modified or replaced (:attr:`FtiffFile.identity`)."""
    # ctime too: no program can set it back, so a write with the modification time restored still shows
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def unchanged(parsed: FtiffFile) -> bool:
    """Whether the file at ``parsed.path`` is still the one parsed (and verified), unmodified since."""
    try:
        return identity_of(os.stat(parsed.path)) == parsed.identity
    except OSError:
        return False


def check_unchanged(fh: BinaryIO, parsed: FtiffFile) -> None:
    """Raise unless ``fh`` is the very file that was parsed and verified, unmodified since."""
    if identity_of(os.fstat(fh.fileno())) != parsed.identity:
        raise FormatError("file was replaced or modified after it was verified", path=parsed.path)
