"""The read side: check a rank's file of a committed checkpoint, then fill the arrays.

Everything is verified before the first byte reaches a user array: structure, every hash,
the match with the commit record, and the sizes of the protected arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..ftiff.reader import FtiffFile, parse_ftiff, read_into, verify_data
from ..ftiff.readhash import read_verified
from ..model.arrays import ArrayBytes
from ..model.errors import ConfigError, FormatError, NoCheckpointError
from ..storage.files import RunPaths, open_read
from .pagemove import release_all
from .prefault import Prefault
from .progress import tracked
from .runstate import CommitRecord

log = logging.getLogger("ftidask")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of checking one rank's file: ``ok``, ``damaged`` (try another), ``mismatch`` (user error) or
    ``unreadable`` (sound as far as it was read, but a package it needs is not installed: nothing older is tried)."""

    kind: str
    message: str = ""
    parsed: FtiffFile | None = None
    staged: dict[int, Any] = dataclasses.field(default_factory=dict)  # var id -> pagemove.Staged, verified


def check_file(path: Path, record: CommitRecord | None, rank: int,
               stage: Callable[[FtiffFile], dict[int, Any]] | None = None) -> Verdict:
    """Parse and hash-check ``path``; compare it with the commit record.

    ``stage``: given the parsed file, the variables to read into staged pages (:mod:`.pagemove`) while
    they are hashed; the verdict holds them, verified (the others are hashed in place and copied later).
    """
    if path.suffix == ".zarr":  # a level-4 checkpoint written as Zarr
        from .zarr_l4 import check_store

        try:
            return check_store(path, record, rank, stage)
        except ConfigError as exc:
            return Verdict("unreadable", f"{path}: {exc}")
    staged: dict[int, Any] = {}
    try:
        with open_read(path) as fh:
            parsed = parse_ftiff(fh, str(path))
            if record is not None:
                expected = next((f for f in record.files if f.rank == rank), None)
                if expected is None or expected.fb_hash != parsed.fb.hash.hex():
                    return Verdict("damaged", f"{path}: does not belong to checkpoint {record.ckpt_id} "
                                   f"(seq {record.seq})")
                if expected.size != parsed.file_size:  # the record's sizes drive L2/L3 rebuilds: never trusted
                    return Verdict("damaged", f"{path}: {parsed.file_size} bytes, the commit record of checkpoint "
                                   f"{record.ckpt_id} (seq {record.seq}) says {expected.size}")
            staged = stage(parsed) if stage is not None else {}
            if staged:  # the staged pages are faulted in ahead of the reader, on the other core
                with Prefault((), [(s.view, s.addr) for s in staged.values()]):
                    read_verified(fh, parsed, {vid: s.view for vid, s in staged.items()})
                verify_data(fh, parsed, only=set(parsed.var_nbytes()) - set(staged))
            else:
                verify_data(fh, parsed)
    except FileNotFoundError:
        release_all(staged)
        return Verdict("damaged", f"{path}: missing")
    except (FormatError, OSError) as exc:
        release_all(staged)
        return Verdict("damaged", str(exc))
    except ConfigError as exc:  # a compressed file without numcodecs: not damage, and not a reason to go back
        release_all(staged)
        return Verdict("unreadable", f"{path}: {exc}")
    except BaseException:
        release_all(staged)
        raise
    return Verdict("ok", parsed=parsed, staged=staged)


def check_sizes(parsed: FtiffFile, arrays: Mapping[int, np.ndarray]) -> str:
    """An error message when a protected array cannot receive its stored data, else ''.

    Every target is checked (dtype, shape, size, writeable) before the first byte is copied, so
    that a recovery refused for one variable leaves every array as it was.
    """
    sizes = parsed.var_nbytes()
    for vid, array in arrays.items():
        problem = check_writeable(vid, array)
        if problem:
            return problem
        if vid not in sizes:
            return (f"variable {vid} is protected but not in checkpoint file {parsed.path} "
                    f"(it holds ids {sorted(sizes)})")
        info = parsed.vars.get(vid)
        if info is not None and (info.dtype != array.dtype or info.shape != tuple(array.shape)):
            return (f"variable {vid}: checkpoint holds {info.dtype} {info.shape}, the protected array is "
                    f"{array.dtype} {tuple(array.shape)}; use ctx.stored_size({vid}) and ctx.realloc({vid}, ...)")
        if array.nbytes != sizes[vid]:
            return (f"variable {vid}: checkpoint holds {sizes[vid]} bytes, the protected array has "
                    f"{array.nbytes}; use ctx.stored_size({vid}) and ctx.realloc({vid}, ...)")
    return ""


def check_writeable(vid: int, array: Any) -> str:
    """An error message when recovery cannot write into the protected array ``array``, else ''."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        return (f"variable {vid}: the protected array is read-only (a read-only view, buffer or memory map), so "
                "recovery cannot fill it; protect a writeable array, e.g. numpy.array(a), and recover again")
    return ""


def load_file(parsed: FtiffFile, arrays: Mapping[int, np.ndarray], *, config: Any = None,
              staged: Mapping[int, Any] | None = None) -> None:
    """Fill ``arrays`` (already size-checked) from a verified file (with a progress bar per ``config``).

    ``staged``: variables already read and verified into staged pages, moved under their arrays here.
    """
    staged = {vid: s for vid, s in (staged or {}).items() if vid in arrays and s.array is arrays[vid]}
    if str(parsed.path).endswith(".zarr"):
        from .zarr_l4 import load_store

        load_store(parsed, {vid: a for vid, a in arrays.items() if vid not in staged})  # type: ignore[arg-type]
        targets = {}
    else:  # the stream order is the stored one, whatever the layout of the array receiving it
        targets = {vid: ArrayBytes(arr, parsed.vars[vid].order if vid in parsed.vars else "C")
                   for vid, arr in arrays.items() if vid not in staged}
    if targets:
        streams, bar = tracked(targets, config, "recovery") if config is not None else (targets, None)
        with open_read(parsed.path) as fh, bar or contextlib.nullcontext():
            read_into(fh, parsed, streams)
    for s in staged.values():  # last: the file copy above is what can still fail
        s.commit()


#: What a recovery that finds no commit record at all adds (FTI returns FTI_NSCS there): why, and when to recover.
NOTHING_YET = (": nothing to recover. A fresh start (status() == 0) has no checkpoint until its first one commits: "
               "recover(), recover_var() and realloc() belong to a restart (status() != 0); stored_size() is 0 there")


def newest_recoverable(records: Iterable[CommitRecord], try_one: Callable[[CommitRecord], tuple[T | None, str]],
                       paths: RunPaths, ckpt_id: int | None, level: int | None,
                       none_recoverable: str = "no checkpoint verifies") -> tuple[CommitRecord, T]:
    """The recovery protocol's search, for every backend: the first of ``records`` (newest first) that
    ``try_one`` verifies or rebuilds (it returns ``(result, "")``, or ``(None, why not)``), with its result.

    When none can be, a :class:`NoCheckpointError` names the run and every checkpoint passed over with why.
    """
    reasons = []
    for record in records:
        result, why = try_one(record)
        if not why:
            return record, result  # type: ignore[return-value]
        reasons.append(f"checkpoint {record.ckpt_id} (level {record.level}): {why}")
        log.warning("cannot recover checkpoint %d (level %d): %s", record.ckpt_id, record.level, why)
    what = "no committed checkpoint" if not reasons else none_recoverable
    raise NoCheckpointError(f"{what} for run {paths.exec_id} in {paths.meta_dir}"
                            + (f" (ckpt_id={ckpt_id})" if ckpt_id is not None else "")
                            + (f" (level={level})" if level is not None else "")
                            + (f": a differential checkpoint (level {level}) is recorded at its base level, recover("
                               f"level={level - 4})" if not reasons and level in (5, 6, 7, 8) else "")
                            + (NOTHING_YET if not reasons and ckpt_id is None and level is None else "")
                            + "".join(f"\n  - {r}" for r in reasons))
