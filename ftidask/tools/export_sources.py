"""Where the checkpoint to export is: its rank files, from a run's config (every candidate, newest first) or a path.

From a config, the lost or damaged files of an L2/L3 checkpoint are rebuilt from their groups first, as a
recovery does (:func:`rebuilt`), before :mod:`ftidask.tools.zarr_export` verifies and reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from ..engine.recovery import check_file
from ..engine.reshard_rebuild import old_groups, rebuild_group
from ..engine.retention import rank_path
from ..engine.runstate import CommitRecord, RunState, check_exec_id, read_current_exec_id
from ..ftiff.filekind import is_config_file
from ..model.config import Config, load_config
from ..model.errors import FormatError, FTIError, NoCheckpointError
from ..model.pathnames import checked_path
from ..storage import files as storage

log = logging.getLogger("ftidask.zarr")


@dataclasses.dataclass(frozen=True)
class Source:
    """One rank's verified file (or store) of the checkpoint being exported."""

    rank: int
    path: Path
    record: CommitRecord | None


# --- finding the checkpoint ----------------------------------------------------------------------

def _rank_of(path: Path) -> int:
    stem = path.name.split("-Rank", 1)[-1].split(".", 1)[0]
    try:
        return int(stem)
    except ValueError:
        raise FTIError(f"{path}: not a rank file (expected Ckpt{{id}}-Rank{{r}}.fti or .zarr)") from None


def _from_record(config: Config, exec_id: str | None, ckpt_id: int | None, level: int | None) -> list[list[Source]]:
    """Every checkpoint of the run that fits ``ckpt_id``/``level``, newest first, as its rank files: the committed
    ones, and the previous differential checkpoints kept as spares (what a recovery falls back to)."""
    meta_dir = Path(config.meta_dir)
    if exec_id is None:
        exec_id = config.exec_id
    if exec_id is None:
        exec_id = read_current_exec_id(meta_dir)
    else:
        check_exec_id(exec_id, "--exec-id")
    if not exec_id:
        raise NoCheckpointError(f"no run found in {meta_dir.absolute()}: no checkpoint was written with this "
                                "meta_dir (relative directories are taken from the current directory), or name the "
                                "run with --exec-id ID (exec_id=... in Python)")
    state = RunState(meta_dir, exec_id)
    records = [r for r in [*state.records(), *state.fallbacks()]
               if (ckpt_id is None or r.ckpt_id == ckpt_id) and (level is None or r.level == level)]
    if not records:
        raise NoCheckpointError(f"no committed checkpoint for run {exec_id} in {meta_dir}"
                                + (f" with id {ckpt_id}" if ckpt_id is not None else "")
                                + (f" at level {level}" if level is not None else ""))
    paths = storage.RunPaths(Path(config.ckpt_dir), Path(config.glbl_dir), meta_dir, exec_id)
    return [[Source(f.rank, rank_path(paths, record, f.node, f.rank), record)
             for f in sorted(record.files, key=lambda f: f.rank)]
            for record in sorted(records, key=lambda r: (r.seq, not r.fallback), reverse=True)]


def _from_path(path: Path) -> list[Source]:
    if path.is_dir() and not path.name.endswith(".zarr"):
        if (path / "commits").is_dir():
            raise NoCheckpointError(f"{path} is a run's metadata directory: pass the run's config file "
                                    "(or ckpt_dir/glbl_dir/meta_dir) instead")
        found = sorted([*path.glob("Ckpt*-Rank*.fti"), *path.glob("Ckpt*-Rank*.zarr")])
        if not found:
            raise NoCheckpointError(f"{path}: no Ckpt*-Rank*.fti file or .zarr store in this directory")
        return sorted((Source(_rank_of(p), p, None) for p in found), key=lambda s: s.rank)
    if not path.exists():
        raise NoCheckpointError(f"{path} does not exist")
    return [Source(_rank_of(path) if "-Rank" in path.name else 0, path, None)]


def locate(checkpoint: str | os.PathLike[str] | Config | None, *, exec_id: str | None = None,
           ckpt_id: int | None = None, level: int | None = None, **overrides: Any) -> list[list[Source]]:
    """The rank files of the checkpoints to try, newest first: from a config (file, :class:`Config` or
    ``overrides``; every checkpoint of the run, or those of ``ckpt_id``/``level``), or the one of a checkpoint
    directory or file."""
    config = config_of(checkpoint, overrides)
    if config is not None:
        return _from_record(config, exec_id, ckpt_id, level)
    return [_from_path(checked_path(checkpoint, "the checkpoint", FormatError))]


def config_of(checkpoint: str | os.PathLike[str] | Config | None, overrides: dict[str, Any]) -> Config | None:
    """The run's config when ``checkpoint`` names one (file, :class:`Config`, or None with ``overrides``)."""
    if isinstance(checkpoint, Config):
        return checkpoint.replace(**overrides) if overrides else checkpoint
    if checkpoint is None:
        return load_config(None, **overrides)
    path = checked_path(checkpoint, "export_checkpoint(checkpoint=...)", FormatError)
    return load_config(path, **overrides) if is_config_file(path) else None  # by content: FTI names it config.fti


def rebuilt(config: Config | None, sources: list[Source]) -> bool:
    """Rebuild the lost or damaged rank files of an L2/L3 checkpoint from their groups (partner copies,
    parity), as a recovery does: whether any group had such a file (each rebuilt file verifies against
    the commit record; a group that cannot be rebuilt is skipped, and the export then refuses the checkpoint)."""
    record = sources[0].record
    if config is None or record is None or record.level not in (2, 3) or record.fallback:
        return False
    path_of = {s.rank: s.path for s in sources}
    try:
        groups = old_groups(record, config.group_size)
    except FTIError as exc:  # a sealed record's malformed groups (a forgery): nothing rebuilt, an older one exported
        log.warning("checkpoint %d (level %d): cannot rebuild its lost files: %s", record.ckpt_id, record.level, exc)
        return False
    tried = False
    for group in groups:
        lost = [r for r in group if check_file(path_of[r], record, r).kind != "ok"]
        if not lost:
            continue
        tried = True
        problem = rebuild_group(config, record, group, path_of.__getitem__)
        if problem:
            log.warning("checkpoint %d (level %d): %s", record.ckpt_id, record.level, problem)
        else:  # the ranks whose files were lost or damaged, not their whole group (the others' files were kept)
            log.warning("checkpoint %d (level %d): rebuilt the lost or damaged files of old ranks %s from their group",
                        record.ckpt_id, record.level, lost)
    return tried
