"""Tasks of differential checkpoints on Dask workers: patch a spare, keep spares, remove them.

A worker keeps no state between tasks, so each differential write is told by the client which
file its spare should be (the FB hash from the retired checkpoint's commit record) and reads the
block digests from the spare itself (:func:`ftidask.engine.dcpwrite.write_differential`). A spare that
is missing, torn or unexpected is rewritten in full. A task patches no spare where it lies: it claims it first,
renaming it into its own checkpoint's directory (:func:`ftidask.backends.dask.fence.claim`), so that the task of a
dead client (an orphan, still running) and the restarted client's never patch the same file. L2 and L3 (deltas to
the partner, parity updates) are the shared level code, run by :mod:`ftidask.backends.dask.group_tasks`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...engine.dcpwrite import write_differential
from ...ftiff import hashing
from ...model.arrays import VarInfo
from ...storage import files as storage
from . import fence
from .plan import layout_from_json
from .tasks import chunk_sources, discard_paths, wait_removals


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    # One pool per worker process, made on first use: block hashing runs on every core.
    return ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="ftidask-dcp")


def write_rank_dcp(spare: str, final: str, expected_fb_hash: str | None, layout_json: Any,
                   infos_json: list[dict[str, Any]], meta: dict[str, Any], hash_name: str, block_size: int, bid: int,
                   pt_fs: int, max_fs: int, places: list[list[int]], *chunks: np.ndarray,
                   with_xor: bool = False, fresh: bool = False) -> Any:
    """Bring this worker's spare up to date with the chunks it holds and rename it to ``final``.

    The spare is claimed first (renamed into ``final``'s directory, see :func:`claimed`) and patched there.
    ``with_xor`` (L3): return ``(result, XorDelta)``, the result's ``xor`` giving the ranges and the base, for a
    parity update (:func:`ftidask.backends.dask.group_tasks.parity_delta`, on this worker: the delta past
    ``dcp.files.XOR_IN_MEMORY`` is in a scratch file of this process, which that task closes).
    ``fresh``: the spare is the checkpoint a recovery fell back to and stays untouched: a new file is written in full.
    """
    work = claimed(spare, final)
    if fresh:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(work)
    else:
        fence.claim([(spare, work)])
    infos = [VarInfo.from_json(r) for r in infos_json]
    try:
        written, stats = write_differential(
            work, Path(final), bytes.fromhex(expected_fb_hash) if expected_fb_hash else None,
            layout_from_json(layout_json), chunk_sources(places, chunks, infos), infos,
            meta, block_size=block_size, bid=bid, hash_id=hashing.hash_id(hash_name), pool=_hash_pool(),
            pt_fs=pt_fs, max_fs=max_fs, capture_xor=with_xor, spill_dir=work.parent if with_xor else None)
    except OSError as exc:  # a full disk's write names no file: the client's error says which worker's file
        raise storage.located(exc, work) from exc
    result = {"rank": meta["rank"], "node": meta["node"], "size": written.file_size,
              "fb_hash": written.fb.hash.hex(), "data_bytes": stats.data_bytes, "file_bytes": stats.file_bytes,
              "blocks_changed": stats.blocks_changed, "blocks_total": stats.blocks_total,
              "blocks_hashed": stats.blocks_hashed, "path": final,
              "delta": None if stats.delta is None else stats.delta.to_json()}
    if not with_xor:
        return result
    xor = stats.xor
    result["xor"] = None if xor is None else {"base": xor.base_fb_hash.hex(), "ranges": [list(r) for r in xor.ranges]}
    # the delta itself (its pieces never joined, past 16 MiB in its scratch file, not a copy of every changed byte
    # held as the task's result): it stays in this worker's memory until the parity task, pinned here, takes it
    return result, xor


def claimed(spare: str | Path, into: str | Path) -> Path:
    """Where a task of the checkpoint that writes ``into`` patches ``spare``: beside ``into``, under the spare's name
    (the directory is made). It leaves it there only if it fails: the checkpoint's directory is then removed."""
    storage.makedirs(Path(into).parent)
    return Path(into).parent / Path(spare).name


def keep_as_spares(moves: Sequence[Sequence[str]]) -> list[bool]:
    """Rename each retired file ``src`` to its spare name ``dst``; which renames happened."""
    done = []
    for src, dst in moves:
        try:
            storage.makedirs(Path(dst).parent)
            with fence.exclusive():  # never once another client writes the run (its spares are there)
                discard_paths([dst])  # the old spare: freeing a GiB-sized file must not hold up the commit
                os.replace(src, dst)
            done.append(True)
        except OSError:
            done.append(False)
    return done


def remove_spare_dirs(dirs: Sequence[str]) -> None:
    """Remove the spare directories of a finished run (each worker sees its own node's)."""
    wait_removals()  # the old spares this worker is deleting in the background first
    for d in dirs:
        with contextlib.suppress(OSError):
            storage.remove_tree(Path(d))
