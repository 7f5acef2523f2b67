"""A parsed FTI-FF file (:class:`FtiffFile`: what :func:`ftidask.ftiff.reader.parse_ftiff` returns, its structure
checked) and its identity on disk, which tells the file verified from the same path modified or replaced since.

Separate from :mod:`ftidask.ftiff.reader` (parsing, verifying and reading a file), which returns it, so that the
reader keeps room for those.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
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

    def var_nbytes(self) -> dict[int, int]:
        """Bytes held per variable id."""
        if self.vars:
            return {vid: info.nbytes for vid, info in self.vars.items()}
        sizes: dict[int, int] = {}
        for _bi, _ci, meta in self.containers():
            sizes[meta.id] = sizes.get(meta.id, 0) + (meta.chunksize if meta.hascontent else 0)
        return sizes

    def layout(self) -> Layout:
        """The container layout, for planning the next checkpoint on top of it."""
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
