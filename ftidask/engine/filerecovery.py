"""``recover_file``: one checkpoint file outside the run's checkpoints, in two steps.

:func:`prepare_file` reads the file, verifies every byte against its hash (an FTI-FF file or Zarr store by its own
hashes, FTI's POSIX or MPI-IO file by its meta file's MD5) and checks each protected variable against it, touching
nothing; the :class:`PreparedFile` it returns fills the arrays when loaded. The two steps are apart so that ranks
reading an FTI run (:mod:`ftidask.tools.fti_run`) agree that every rank's file fits before any rank writes an array:
FTI takes a level only when every rank recovers from it, and a rank that wrote its arrays before another's file was
refused would be left holding a checkpoint the run does not recover.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..ftiff.fti_mpiio import check_rank, is_mpiio_file, read_mpiio
from ..ftiff.posix import other_io_mode, read_posix
from ..model.arrays import ArrayBytes
from ..model.errors import FormatError, RecoveryError
from ..model.pathnames import checked_path
from .pagemove import Stager, release_all
from .recoverplan import plan, upload
from .recovery import check_file, load_file


class PreparedFile:
    """A file verified and planned into the protected arrays, none written yet: :meth:`load` fills them (once),
    :meth:`release` gives back what a load that will not come holds (verified pages staged for the arrays)."""

    def __init__(self, load: Callable[[], dict[int, Any]], release: Callable[[], None] = lambda: None) -> None:
        self._load, self._release = load, release

    def load(self) -> dict[int, Any]:
        """Fill the protected arrays from the verified file: the recovered ones, by id."""
        try:
            return self._load()
        finally:
            self.release()

    def release(self) -> None:
        """Give back the staged pages (a load that will not come); idempotent."""
        release, self._release = self._release, lambda: None
        release()


def prepare_file(protected: Mapping[int, Any], progress: Any, path: Any, meta: Any, rank: Any, own_rank: int,
                 verifying: Callable[[], contextlib.AbstractContextManager[Stager | None]]) -> PreparedFile:
    """``recover_file(path, meta, rank)`` up to the first array written (:class:`PreparedFile`): a
    :class:`RecoveryError` for an argument refused, a file damaged or not a checkpoint, or one whose variables do not
    fit those ``protected``. ``verifying``: the context around the verification that stages verified pages for
    fresh arrays (:meth:`ftidask.engine.recovering.Recovery.recover_file`)."""
    check_paths(path, meta, rank)
    if meta is not None:  # FTI's POSIX file (or MPI-IO's shared file), described by its meta files
        return _prepare_posix(protected, progress, path, meta, own_rank if rank is None else rank)
    with verifying() as stage:
        verdict = check_file(Path(path), None, own_rank, stage)
    try:
        if verdict.kind != "ok" or verdict.parsed is None:
            raise RecoveryError(f"cannot recover from {os.fspath(path)}: {hinted(verdict.message, path)}")
        parsed = verdict.parsed
        targets = plan(protected, parsed, None)
        problem = targets.problem or targets.load_states()
        if problem:
            raise RecoveryError(problem)
    except BaseException:
        release_all(verdict.staged)
        raise

    def load() -> dict[int, Any]:
        load_file(parsed, targets.arrays, staged=verdict.staged)
        targets.apply_states()
        progress.plan_from(parsed)  # as a recovery of the run's own checkpoint
        # its sizes for stored_size; no run's record goes with this file: a recover() after it finds its checkpoint
        # anew (else it paired the newest record with this file, loaded it, and said it recovered that checkpoint)
        progress.restart_file, progress.restart_record, progress.verified = parsed, None, None
        return _recovered(progress, targets)

    return PreparedFile(load, lambda: release_all(verdict.staged))  # committed ones are gone already


def _prepare_posix(protected: Mapping[int, Any], progress: Any, path: Any, meta: Any, rank: int) -> PreparedFile:
    """FTI's POSIX checkpoint file ``path``, described by its meta file ``meta`` (:mod:`ftidask.ftiff.posix`), or
    rank ``rank``'s part of FTI's MPI-IO file (:mod:`ftidask.ftiff.fti_mpiio`), verified whole (size, MD5) and every
    protected variable checked against it (each must be there, of its size: FTI stores bytes, no dtype or shape)."""
    try:
        parsed = read_mpiio(path, meta, rank) if is_mpiio_file(path) else read_posix(path, meta)
    except FormatError as exc:
        what = "FTI's MPI-IO file" if is_mpiio_file(path) else "FTI's POSIX file"
        raise RecoveryError(f"cannot recover from {what}: {exc}") from None
    targets = plan(protected, parsed, None)
    if targets.problem:
        raise RecoveryError(targets.problem)

    def load() -> dict[int, Any]:
        for vid, array in targets.arrays.items():
            if array.nbytes:
                ArrayBytes(array).store(0, parsed.data[vid])  # the array's memory order, as FTI copied it
        upload(targets.devices)
        # stored_size and realloc describe this file now, as after an FTI-FF one (they described the run's own
        # checkpoint, and realloc put an array of its old size in place of the one just filled); its sizes only,
        # not its bytes. The next checkpoint plans as before: FTI's file has no containers to plan on.
        progress.restart_file = StoredSizes(str(path), parsed.var_nbytes())
        progress.restart_record = progress.verified = None
        return _recovered(progress, targets)

    return PreparedFile(load)


@dataclasses.dataclass(frozen=True)
class StoredSizes:
    """What stored_size and realloc read of a file of FTI's POSIX or MPI-IO I/O just recovered: its bytes per
    variable (no dtype or shape: FTI stores bytes)."""

    path: str
    sizes: dict[int, int]
    vars: dict[int, Any] = dataclasses.field(default_factory=dict)

    def var_nbytes(self) -> dict[int, int]:
        """Bytes held per variable id."""
        return dict(self.sizes)


def _recovered(progress: Any, targets: Any) -> dict[int, Any]:
    progress.recovered = True
    out = targets.recovered()
    progress.recovered_ids.update(out)  # what snapshot() no longer recovers
    return out


def check_paths(path: Any, meta: Any, rank: Any = None) -> None:
    """recover_file's ``path`` and ``meta`` (or None): paths, else a RecoveryError naming the argument (before,
    None or 5 was pathlib's TypeError); ``rank`` (or None) a rank, given only for FTI's MPI-IO file."""
    for what, value in (("path", path), ("meta", meta)):
        if not isinstance(value, (str, os.PathLike)) and (what == "path" or value is not None):
            raise RecoveryError(f"recover_file({what}=...) takes a path (str or os.PathLike)"
                                f"{'' if what == 'path' else ' or None'}, got {type(value).__name__} {value!r}")
        if value is not None:  # a NUL, a lone surrogate, a name too long: said here, not by open() deep inside
            checked_path(value, f"recover_file({what}=...)", RecoveryError)
    if rank is None:
        return
    if not is_mpiio_file(path):
        raise RecoveryError("recover_file(rank=...) names whose part to read of FTI's MPI-IO file (Ckpt{id}-mpiio.fti, "
                            f"every rank's bytes in one file); {os.fspath(path)} is not one")
    try:
        check_rank(rank)
    except FormatError as exc:
        raise RecoveryError(f"recover_file(rank=...): {exc}") from None


def hinted(message: str, path: str | os.PathLike[str]) -> str:
    """``message`` of a file recover_file refused, with a hint when it may be a file of FTI's POSIX I/O (raw bytes,
    no FTI-FF metadata), which is read with its meta file, or what it is when a file of FTI's other I/O modes."""
    if "not an FTI-FF file" not in message:
        return message
    other = other_io_mode(path)
    if other:
        return other
    return (f"{message}; a checkpoint file of FTI's POSIX I/O (ckpt_io = 1) is read with its meta file: "
            "recover_file(path, meta=META_DIR/sector*-group*.fti)")
