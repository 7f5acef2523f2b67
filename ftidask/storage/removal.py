"""Removing what a run no longer needs: trees removed without raising, trash renamed now and deleted in the
background (with a bounded backlog), and the garbage interrupted checkpoints leave in a level directory.

Re-exported by :mod:`ftidask.storage.files`, where the callers have long found them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import sys
import weakref
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from . import interrupts
from .paths import SPARE_DIR, is_inside

log = logging.getLogger("ftidask")


def remove_tree(path: Path) -> None:
    """Remove ``path``: a regular file, a symbolic link (removed, never followed) or a directory tree.

    Something already gone is fine (trash is deleted by a background thread and by start-up
    garbage collection, possibly both at once); any other error is logged, not raised: a leftover
    must never fail a checkpoint, but it must not go unnoticed either.
    """
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        if not is_dir:
            os.unlink(path)
            return
    except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: nothing there either
        return
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
        return

    def failed(_func: Any, name: str, exc: Any) -> None:
        exc = exc[1] if isinstance(exc, tuple) else exc  # onerror's exc_info, onexc's exception
        if not isinstance(exc, FileNotFoundError):
            log.warning("could not remove %s: %s", name, exc)

    with interrupts.held_off():  # rmtree holds directory descriptors: Ctrl-C there would leak one for good
        shutil.rmtree(path, **({"onexc": failed} if sys.version_info >= (3, 12) else {"onerror": failed}))


def remove_inside(path: Path, parent: Path) -> bool:
    """Remove the tree at ``path`` only if it lies inside ``parent`` (see :func:`is_inside`); whether it
    did: every deletion of a path made from a name read somewhere (an exec_id) goes through here."""
    if not is_inside(path, parent):
        return False
    remove_tree(path)
    return True


def prune_empty_dirs(root: Path) -> None:
    """Remove the empty directories under ``root``, deepest first, and ``root`` itself if it ends up
    empty. Only empty directories go (``os.rmdir``): a file, or one created meanwhile, keeps its own."""
    for dirpath, _dirnames, _filenames in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):  # not empty, or gone
            os.rmdir(dirpath)


TRASH_PREFIX = ".trash-"


def move_to_trash(path: Path, into: Path | None = None) -> Path | None:
    """Rename ``path`` to a hidden sibling (or a hidden entry of directory ``into``, on the same file
    system), atomic and instant, to be removed later; None if absent.

    Freeing the pages of a GiB-sized file takes a noticeable time: the caller removes the
    trash in the background, and whatever a crash leaves is collected at the next start.
    """
    target = (into or path.parent) / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    except OSError:
        if not os.path.lexists(path):  # a read-only file system refuses (EROFS) before it looks the name up
            return None
        raise
    return target


#: Deletions a remover may have queued before ``discard`` waits for the oldest: the trash never
#: grows faster than it is deleted, so disk use stays bounded by retention even on a slow disk.
_BACKLOG = 2
_queued: weakref.WeakKeyDictionary[Executor, deque[Future[None]]] = weakref.WeakKeyDictionary()


def discard(path: Path, remover: Callable[[], Executor], into: Path | None = None, now: bool = False) -> None:
    """Move ``path`` to the trash now (in directory ``into``, else beside it) and have ``remover()`` (made
    only when needed) delete it; with ``now`` (a small tree), delete it here at once."""
    trash = move_to_trash(path, into)
    if trash is None:
        return
    if now:  # a few KiB: the hand-off to the remover's thread (and its GIL traffic) costs more than the deletion
        remove_tree(trash)
        return
    pool = remover()
    queued = _queued.setdefault(pool, deque())
    while queued and queued[0].done():
        queued.popleft()
    if len(queued) >= _BACKLOG:
        with contextlib.suppress(IndexError):  # another thread took it meanwhile
            queued.popleft().result()
    queued.append(pool.submit(remove_tree, trash))


def collect_level_garbage(root: Path, committed: Collection[str], trash: bool, spares: bool = True,
                          settled: Collection[str] = ()) -> int:
    """Remove what interrupted checkpoints left in one level directory ``root``: checkpoint
    directories that ``committed`` does not name, temporary files and stores, and (``trash``:
    when nothing of this process is being deleted, at start-up) trash and old spares, and every
    spare when the run does not write differential checkpoints (``spares`` False); the count.
    ``settled``: committed directories not looked into (found clean since nothing writes there: a run that
    keeps every L4 checkpoint would list each of them again at every checkpoint)."""
    removed = 0
    try:
        with os.scandir(root) as it:
            entries = list(it)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # none, or not a directory (a link loop): as
            return removed  # Path.is_dir read it (a loop planted on a node of an earlier start failed every start)
        raise
    for entry in entries:
        name = entry.name
        if name in settled:
            continue
        if name.startswith(TRASH_PREFIX):
            if trash:
                remove_tree(Path(entry.path))
                removed += 1
        elif name.startswith(".") and ".tmp-" in name:
            # logged, not raised, when it cannot go (a read-only disk): the restart goes on
            remove_tree(Path(entry.path))
            removed += 1
        elif entry_is_dir(entry) and name.startswith("ckpt") and name not in committed:
            remove_tree(Path(entry.path))
            removed += 1
        elif entry_is_dir(entry):
            path = Path(entry.path)
            for tmp in _temporaries(entry.path):
                remove_tree(tmp)  # a file, or a Zarr store being written (l4_format = zarr)
                removed += 1
            if name == SPARE_DIR and trash and not spares:  # no dCP in this run: nothing will patch them
                remove_tree(path)
                removed += 1
            elif name == SPARE_DIR and trash:  # old spares that a crash left
                for old in _entries(path, TRASH_PREFIX):  # (a glob raised if the directory went meanwhile)
                    remove_tree(old)
                    removed += 1
    return removed


def _entries(directory: Path, prefix: str) -> list[Path]:
    """The entries of ``directory`` whose names start with ``prefix``; none when it is gone or not a directory."""
    try:
        with os.scandir(directory) as it:
            return [Path(e.path) for e in it if e.name.startswith(prefix)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _temporaries(directory: str) -> list[Path]:
    """The entries of ``directory`` named as a temporary (``.*.tmp-*``), as ``Path.glob`` found them (none when
    it is gone, not a directory or not readable), without its cost (a checkpoint looks into several)."""
    try:
        with os.scandir(directory) as it:
            return [Path(e.path) for e in it if e.name.startswith(".") and ".tmp-" in e.name[1:]]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def entry_is_dir(entry: os.DirEntry[str]) -> bool:
    """``Path.is_dir``'s answer (a link to a directory counts) from the listing's file type, without a stat."""
    try:
        return entry.is_dir()
    except OSError:
        return False
