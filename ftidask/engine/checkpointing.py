"""The write side: one rank's file of a checkpoint, and the info object returned to the user."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..ftiff.layout import Layout
from ..ftiff.writer import WrittenFile, write_ftiff
from ..model.arrays import ArrayBytes, VarInfo
from ..storage.files import atomic_file


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint did: ``id``, ``level``, ``seq`` (its sequence number in the run), ``bytes_written`` (data)
    and ``file_bytes`` (everything written), ``seconds``; for a differential checkpoint (levels 5-8, else None)
    ``blocks_total`` blocks, of which ``blocks_changed`` were written and ``blocks_hashed`` read and hashed."""

    id: int
    level: int
    seq: int
    bytes_written: int
    file_bytes: int
    seconds: float
    blocks_changed: int | None = None
    blocks_total: int | None = None
    blocks_hashed: int | None = None  # of blocks_total, how many were read and hashed (the others: not written to)

    def __repr__(self) -> str:
        rate = self.bytes_written / self.seconds / 2**20 if self.seconds > 0 else 0.0
        blocks = ("" if self.blocks_changed is None else
                  f", blocks_changed={self.blocks_changed}/{self.blocks_total}")
        return (f"CheckpointInfo(id={self.id}, level={self.level}, bytes_written={self.bytes_written}{blocks}, "
                f"seconds={self.seconds:.3f} ({rate:.0f} MiB/s))")


def write_rank_file(path: Path, layout: Layout, arrays: Mapping[int, ArrayBytes],
                    infos: Sequence[VarInfo | dict[str, Any]], *, hash_id: int, meta: Mapping[str, Any],
                    pt_fs: int | None = None, max_fs: int | None = None, pool: ThreadPoolExecutor | None = None,
                    codecs: Mapping[int, tuple[Any, int]] | None = None, durable: bool = True,
                    sync_pool: ThreadPoolExecutor | None = None, direct: bool = False) -> WrittenFile:
    """Write one rank's FTI-FF file atomically at ``path`` (``infos``: the variable table, each variable's
    :class:`VarInfo` or its JSON form; ``codecs``: variables to compress; ``durable=False``: renamed before the disk
    has it all; ``sync_pool``: threads to fsync it and its directories at once, a record written after naming it, see
    :func:`~ftidask.storage.files.atomic_file`); ``direct``: its data written around the page cache where it can be,
    see :func:`~ftidask.ftiff.writer.write_ftiff`)."""
    trailer = dict(meta)
    trailer["vars"] = [info.to_json() if isinstance(info, VarInfo) else info for info in infos]
    with atomic_file(path, durable=durable, sync_pool=sync_pool) as fh:
        return write_ftiff(fh, layout, arrays, hash_id=hash_id, trailer=trailer, pt_fs=pt_fs, max_fs=max_fs, pool=pool,
                           codecs=codecs, direct=direct)
