"""Import a Zarr store as a checkpoint: the reverse of :mod:`ftidask.tools.zarr_export`.

:func:`read_zarr` reads a Zarr group's arrays (verified through the ftidask manifest when the
store has one); :func:`import_zarr` starts a new run whose first checkpoint holds them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import pystate
from ..engine.runstate import RunState, read_current_exec_id
from ..model.config import load_config
from ..model.errors import FormatError, FTIError
from ..model.pathnames import checked_path
from ..storage import runlock
from ..zarrfmt import store as zarr_store
from ..zarrfmt.foreign import plain_group_attrs, read_plain_group
from .shown import shown

log = logging.getLogger("ftidask.zarr")


def store_path(value: Any, what: str) -> Path:
    """``value``, the path of a Zarr store (``what`` names the argument), else a FormatError saying what it takes
    (before, None or 5 was pathlib's TypeError)."""
    if not isinstance(value, (str, os.PathLike)):
        raise FormatError(f"{what} takes the path of a Zarr store (str or os.PathLike), got {type(value).__name__} "
                          f"{value!r}")
    return checked_path(value, what, FormatError)  # a NUL, a lone surrogate, a name too long

def _check_group(group: Any, what: str) -> None:
    if not isinstance(group, str):  # None or 3 were read as the root or as an empty group
        raise FormatError(f"{what}(group=...) takes the group's name (str, \"\" for the root), got {group!r}")


def read_zarr(path: str | os.PathLike[str], *, group: str = "") -> dict[int, tuple[str, np.ndarray]]:
    """The arrays of a Zarr group by ftidask variable id: ``{id: (name, array)}``.

    A store with an ftidask manifest is verified first (any damaged file raises
    :class:`FormatError`). Any other Zarr group is read as it is: ids come from the arrays'
    ``ftidask_id`` attribute, else 1, 2, ... in name order.
    """
    path = store_path(path, "read_zarr(path=...)")
    _check_group(group, "read_zarr")
    if not path.is_dir():
        raise FormatError(f"{path}: no Zarr store there")
    if (path / zarr_store.MANIFEST).exists():
        return {vid: (name, data) for vid, (name, data, _kind) in _read_manifest_store(path, group).items()}
    return read_plain_group(path, group)


def _read_manifest_store(path: Path, group: str) -> dict[int, tuple[str, np.ndarray, str]]:
    """A store ftidask exported, verified: ``{id: (name, array, Python-state kind or '')}``."""
    from ..zarrfmt.verify import read_verified

    manifest, data = read_verified(path, group)  # verified, each stored byte read once
    table = zarr_store.store_vars(manifest, path, group)
    if not table and group:  # a mistyped group read as an empty one: said, with the groups there are
        groups = sorted({name.rpartition("/")[0] for name, _info in zarr_store.store_entries(manifest, path)})
        raise FormatError(f"{path}: no variable in group {group!r}; the store's groups: "
                          f"{', '.join(repr(g) if g else 'the root' for g in groups) or 'none'}")
    return {vid: (info.name, data[vid], pystate.kind_of(info)) for vid, (info, _n) in table.items()}


def import_zarr(path: str | os.PathLike[str], config: str | os.PathLike[str] | None = None, *,
                ckpt_id: int | None = None, level: int = 4, group: str = "", **overrides: Any) -> Any:
    """Start a new run whose first checkpoint holds the arrays of the Zarr group at ``path``.

    The run is finalized with ``keep_last_ckpt`` so that the next ``ftidask.init`` with the same
    config restarts from it (status 2) and ``recover()`` fills the protected arrays. Returns the
    :class:`~ftidask.CheckpointInfo` of that checkpoint. ``group`` selects a rank group
    (``"rank3"``) of a per-rank export.
    """
    from ..api.start import init

    store = store_path(path, "import_zarr(path=...)")
    _check_group(group, "import_zarr")
    if (store / zarr_store.MANIFEST).exists():  # Python states come back as states, not as their bytes
        arrays = {vid: (name, pystate.from_stored(kind, data, f"variable {vid} of {path}") if kind else data)
                  for vid, (name, data, kind) in _read_manifest_store(Path(path), group).items()}
    else:
        arrays = read_zarr(path, group=group)
    if not arrays:
        raise FormatError(f"{path}: no array to import")
    if ckpt_id is None:
        manifest = (Path(path) / zarr_store.MANIFEST).exists()
        # a store without ftidask's manifest (written, or rewritten, by zarr or xarray): its root group's attribute
        attrs = zarr_store.read_manifest(Path(path)).get("attrs", {}) if manifest else plain_group_attrs(store)
        ckpt_id = attrs.get("checkpoint_id") if isinstance(attrs, dict) else None
        ckpt_id = 1 if ckpt_id is None else ckpt_id
        if type(ckpt_id) is not int:  # a forged manifest's (a bool, a float, a string): never guessed at
            raise FormatError(f"{path}: the {'manifest' if manifest else 'group'}'s checkpoint_id {ckpt_id!r} is not "
                              "an integer (pass --id)")
    overrides["keep_last_ckpt"] = True
    # The directories may hold a run that the next init restarts: the import's finalize would retire its files.
    # Found from the run's state before any init (which would restart that run, changing its state).
    cfg = load_config(config, **overrides)
    # A run that another process holds is not restarted: init starts a run of its own beside it.
    exec_id = cfg.exec_id or read_current_exec_id(Path(cfg.meta_dir))
    if exec_id is not None and not runlock.is_live(Path(cfg.meta_dir) / exec_id) \
            and RunState(Path(cfg.meta_dir), exec_id).start_status(bool(cfg.enable_dcp)) != 0:
        raise _holds_run(config, exec_id)
    ctx = init(config, **overrides)
    if ctx.status() != 0:  # (what the state above did not tell: a run started meanwhile)
        found = ctx.exec_id
        ctx.__exit__(RuntimeError, None, None)  # closed, its checkpoints untouched
        raise _holds_run(config, found)
    try:
        for vid, (name, arr) in arrays.items():
            ctx.protect(vid, arr, name=name)
        info = ctx.checkpoint(ckpt_id, level)
    except BaseException:
        ctx.__exit__(RuntimeError, None, None)
        raise
    ctx.finalize()
    log.info("imported %d arrays from %s as checkpoint %d (level %d) of run %s", len(arrays), path, ckpt_id,
             level, ctx.exec_id)
    return info


def _holds_run(config: Any, exec_id: str) -> FTIError:
    return FTIError(f"the directories of {config or 'the default config'} hold run {exec_id}, which the next init "
                    "restarts: its checkpoints would be retired by the import's. Import with a config of other "
                    "directories, or remove that run first (ftidask clean --exec-id ...)")


def run_import(args: argparse.Namespace) -> int:
    """Run ``ftidask import``; the exit code (2 on an error)."""
    try:
        info = import_zarr(args.store, args.config, ckpt_id=args.ckpt_id, level=args.level, group=args.group)
    except (FileNotFoundError, FTIError) as exc:
        print(f"ftidask: error: {exc}", file=sys.stderr)
        return 2
    kept = _kept_level(args.config, info.id)
    level = (f"level {info.level}" if kept == info.level else f"written at level {info.level}, kept at level {kept}"
             if kept is not None else f"written at level {info.level}, kept at finalize")
    print(f"imported {shown(args.store)} as checkpoint {info.id} ({level}); restart the run with the same "
          "config to recover it")
    return 0


def _kept_level(config: str | None, ckpt_id: int) -> int | None:
    """The level at which the import's checkpoint ``ckpt_id`` is kept (committed) after its finalize, from the run's
    commit records: keep_last_ckpt flushes a checkpoint of another level to level 4. None if it cannot be told."""
    cfg = load_config(config, keep_last_ckpt=True)
    meta = Path(cfg.meta_dir)
    exec_id = cfg.exec_id or read_current_exec_id(meta)
    if not exec_id:
        return None
    kept = [r for r in RunState(meta, exec_id).records() if r.ckpt_id == ckpt_id]
    return kept[-1].level if kept else None
