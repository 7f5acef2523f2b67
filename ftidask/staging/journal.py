"""The transfers a mover thread has under way, noted beside the rank's stage directory.

A mover thread dies with its process: killed during a copy, it leaves its hidden temporary file at the
destination (``.NAME.ftidask-stage-TOKEN-ID.tmp``, under ``glbl_dir``), which nothing else would ever remove. So
before a transfer starts its temporary name is noted in a directory of notes (``.rank{r}-transfers`` beside the
stage directory ``rank{r}``: the application's stage directory holds its files only), and the note goes once the
transfer is over; the restart of the run (the same ``exec_id``, hence the same directories) removes the
temporary files still noted (:func:`sweep`; those of ranks that are gone or sit on other nodes now:
:func:`sweep_others`). A mover process outlives the application (it finishes the transfer under way) and the
application removes the temporary files of a mover that died: they need no note. An MPI head does not outlive
its job (mpiexec tears it down with any process of the job killed): the application rank notes the transfers it
hands to its head (:mod:`ftidask.backends.mpi.stage_heads`). A Dask job killed whole (client and workers) is the same:
the client notes the copies it hands to its workers (:mod:`ftidask.backends.dask.staging`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import re
from pathlib import Path

from ..storage import files as storage
from .copy import StageRequest

log = logging.getLogger("ftidask")

#: What a temporary name of :func:`ftidask.staging.copy.temp_name` looks like; a note naming anything else is ignored.
_TEMP = re.compile(r"\..+\.ftidask-stage-[0-9a-f]{12}-[0-9]+\.tmp")
#: A note still at its own temporary name (:func:`ftidask.storage.files.create_temp`): killed while written.
_TORN = re.compile(r".*\.tmp-[0-9]+(-[0-9a-f]{8})?")


def notes_dir(stage_dir: Path) -> Path:
    """Where the transfers of the stage directory ``stage_dir`` are noted: a hidden sibling of it."""
    return stage_dir.with_name(f".{stage_dir.name}-transfers")


def _note_path(notes: Path, req: StageRequest) -> Path:
    return notes / os.path.basename(req.tmp)


def begin(notes: Path, req: StageRequest) -> None:
    """Note ``req``'s temporary file before the transfer creates it (no fsync: a process killed keeps the
    page cache; a lost note costs a leftover file, never data)."""
    try:
        storage.makedirs(notes)
        fd, tmp = storage.create_temp(_note_path(notes, req), os.O_WRONLY)
        try:
            try:
                data = json.dumps({"tmp": req.tmp}).encode()
                if os.write(fd, data) != len(data):  # a short write: a torn note, worse than none
                    raise OSError(errno.ENOSPC, "short write of the note")
            finally:
                os.close(fd)
            os.replace(tmp, _note_path(notes, req))
        except BaseException:  # a disk full: the half-made note must not stay (only a restart would sweep it)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:  # the transfer goes on: only its cleanup after a kill is lost
        log.warning("could not note the staging transfer to %s in %s: %s", req.dst, notes, exc)


def end(notes: Path, req: StageRequest) -> None:
    """The transfer is over (its temporary file published or removed): drop its note (never raises: the mover
    thread must live on; a note left costs the restart an unlink of a name already gone)."""
    with contextlib.suppress(OSError):
        os.unlink(_note_path(notes, req))


def sweep(notes: Path, within: Path | None) -> int:
    """Remove the temporary files of the transfers noted in ``notes`` (a run killed during them) and the notes;
    the number of files removed. Called when the run starts again, before any transfer of its own. ``within``:
    the directory the destinations are under (``glbl_dir``; None when ``stage_allow_outside`` lets them be
    anywhere): a note naming a file elsewhere is not the run's (planted, or damaged) and that file stays."""
    root = os.path.realpath(within) + os.sep if within is not None else ""
    try:  # the notes directory itself, never a link's target: a planted link would have its target emptied
        fd = os.open(notes, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    except OSError as exc:  # the run starts all the same: only leftovers stay
        log.warning("could not read the staging notes %s (left as they are): %s", notes, exc)
        return 0
    removed = 0
    try:
        for name in os.listdir(fd):
            if _TORN.fullmatch(name):  # a note being written when the kill came
                _drop(fd, name)
            elif _TEMP.fullmatch(name):  # a note; any other name is none of ftidask's and stays
                removed += _remove_noted(notes / name, name, root)
                _drop(fd, name)
    finally:
        os.close(fd)
    return removed


def _remove_noted(note_path: Path, name: str, root: str) -> int:
    """Remove the temporary file that the note ``note_path`` names, if it is one of a transfer under ``root``."""
    note = storage.read_json(note_path)  # a regular file's, never a link's
    tmp = note.get("tmp") if isinstance(note, dict) else None
    if not (isinstance(tmp, str) and os.path.isabs(tmp) and os.path.basename(tmp) == name and _under(tmp, root)):
        return 0
    try:
        os.unlink(tmp)  # the name itself: a link there is removed, never followed
        log.info("removed %s, left by a staging transfer that was killed", tmp)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("could not remove %s, left by a staging transfer that was killed: %s", tmp, exc)
        return 0


def _drop(fd: int, name: str) -> None:
    """Unlink the note ``name`` of the notes directory open at ``fd`` (a directory of that name stays)."""
    try:
        os.unlink(name, dir_fd=fd)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("could not remove the staging note %s: %s", name, exc)


def _under(tmp: str, root: str) -> bool:
    """Whether the file ``tmp`` is in a directory whose real path is below ``root`` ('': anywhere)."""
    try:
        return not root or (os.path.realpath(os.path.dirname(tmp)) + os.sep).startswith(root)  # glbl_dir's own too
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return False


def sweep_others(stage_root: Path, rank: int, size: int, within: Path | None) -> int:
    """:func:`sweep` the notes that the sweep of this rank's own stage directory does not reach: those of its rank
    number on the other nodes (a restart on another node layout) and, on rank 0, those of the ranks this run does
    not have (a restart on fewer ranks: nobody else would ever remove their temporary files). Only this run's rank
    r moves files under the number r, and none has started yet: no live transfer's note is among them."""
    removed = 0
    for notes in sorted(stage_root.glob("node*/.rank*-transfers")):
        number = re.fullmatch(r"\.rank([0-9]+)-transfers", notes.name)
        if number and (int(number[1]) == rank or (rank == 0 and int(number[1]) >= size)):
            removed += sweep(notes, within)
            with contextlib.suppress(OSError):
                notes.rmdir()
    return removed



def tidy_stage(stage_root: Path, glbl_dir: Path, nodes: str = "node*") -> int:
    """A dead or finished run's stage directories (``{ckpt_dir}/stage/{exec_id}/{nodes}``): the temporary files
    its transfers left (under ``glbl_dir``: a dead run's stage_allow_outside is not known) and their notes removed,
    then the empty directories (``stage_root`` too, if it ends up empty); the application's files waiting there
    stay (they are its own, as at finalize). The files left."""
    left = 0
    for node_dir in sorted(stage_root.glob(nodes)):
        try:  # another rank of the node may tidy (and remove) it meanwhile: a glob raised then
            with os.scandir(node_dir) as it:
                found = sorted(Path(e.path) for e in it if fnmatch.fnmatchcase(e.name, ".rank*-transfers"))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for notes in found:
            sweep(notes, glbl_dir)
        storage.prune_empty_dirs(node_dir)
        left += sum(len(files) for _dir, _dirs, files in os.walk(node_dir))
    with contextlib.suppress(OSError):  # not empty, or gone
        stage_root.rmdir()
    return left
