"""A run written by FTI itself, read as FTI_RecoverFiles reads it (src/recover.c): level 1, 2, 3, then 4.

FTI keeps one rank's files in its run's directories (src/conf.c ``FTI_CreateDirs``), named by the run's
``[restart] exec_id``; with ``local_test = 1`` each simulated node has its own local directory::

    {ckpt_dir}[/node{rank // node_size}]/{exec_id}/l1/Ckpt{id}-Rank{rank}.fti
    {ckpt_dir}[/node{right}]/{exec_id}/l2/Ckpt{id}-Pcof{keeper}.fti   the copy kept on the next node of the group
    {ckpt_dir}[/node{node}]/{exec_id}/l3/Ckpt{id}-Rank{rank}.fti      (its parity RSed beside it: never decoded)
    {glbl_dir}/{exec_id}/l4/Ckpt{id}-Rank{rank}.fti
    {meta_dir}/{exec_id}/l{level}/sector{s}-group{g}.fti              POSIX I/O (ckpt_io = 1) only

``rank`` is the process's rank in FTI's global communicator (heads included). The partner copy of rank ``r`` is kept
by the process at the same place on the next node of its group (``FTI_Topo->right``) and named after that keeper's
rank (``FTI_RecvPtner``); ranks are taken as placed node by node (``node = rank // node_size``, as with
``local_test`` and block placement: FTI itself groups them by host name). After a keep_last_ckpt finalize FTI sets
``failure = 2`` and recovers from level 4 only. Each file found is read with :meth:`ftidask.Context.recover_file`
(every byte verified before an array is written); a missing or refused one sends the search on, as FTI goes on to
the next level. FTI's own level-3 parity is not decoded: at level 3 only the rank's own file is read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..model.config import Config, load_config
from ..model.errors import ConfigError, NoCheckpointError, RecoveryError


@dataclasses.dataclass(frozen=True)
class FtiRunFile:
    """One place FTI may keep a rank's checkpoint: its level, checkpoint id, the file, and (POSIX I/O) the
    directory of the meta files that describe it (None for FTI-FF, whose files describe themselves)."""

    level: int
    ckpt_id: int
    path: Path
    meta: Path | None


def _config(config: str | os.PathLike[str] | Config) -> Config:
    cfg = config if isinstance(config, Config) else load_config(config)
    if cfg.exec_id is None:
        raise ConfigError("[restart] exec_id names the FTI run to read (FTI writes it there with failure = 1 once "
                          "its run has a checkpoint); this config has none")
    if cfg.ckpt_io not in (1, 3):
        raise ConfigError(f"ckpt_io = {cfg.ckpt_io}: only FTI's POSIX (1) and FTI-FF (3) runs are read")
    return cfg


def _ids(folder: Path, pattern: str) -> list[tuple[int, Path]]:
    """``(checkpoint id, path)`` of the files in ``folder`` whose name matches ``pattern``, newest id first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        named = re.fullmatch(pattern, path.name)
        if named and path.is_file():
            found.append((int(named[1]), path))
    return sorted(found, reverse=True)


def fti_run_files(config: str | os.PathLike[str] | Config, rank: int) -> list[FtiRunFile]:
    """The files where the FTI run that ``config`` names (FTI's config file: its directories, topology,
    ``ckpt_io`` and ``[restart]``) keeps rank ``rank``'s checkpoint, in the order FTI_RecoverFiles tries them."""
    cfg = _config(config)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise RecoveryError(f"rank must be a non-negative int (the rank in FTI's global communicator), got {rank!r}")
    exec_id, per_node, group = cfg.exec_id, cfg.node_size, cfg.group_size
    node = rank // per_node
    right = node - node % group + (node % group + 1) % group  # FTI_Topo->right: next node of the group, a ring
    keeper = right * per_node + rank % per_node

    def local(n: int) -> Path:
        return Path(cfg.ckpt_dir) / (f"node{n}" if cfg.local_test else "") / str(exec_id)

    def meta(level: int) -> Path | None:
        return Path(cfg.meta_dir) / str(exec_id) / f"l{level}" if cfg.ckpt_io == 1 else None

    places = {1: [(local(node) / "l1", rf"Ckpt(\d+)-Rank{rank}\.fti")],
              2: [(local(node) / "l2", rf"Ckpt(\d+)-Rank{rank}\.fti"),
                  (local(right) / "l2", rf"Ckpt(\d+)-Pcof{keeper}\.fti")],
              3: [(local(node) / "l3", rf"Ckpt(\d+)-Rank{rank}\.fti")],
              4: [(Path(cfg.glbl_dir) / str(exec_id) / "l4", rf"Ckpt(\d+)-Rank{rank}\.fti")]}
    levels = [4] if cfg.failure == 2 else [1, 2, 3, 4]
    return [FtiRunFile(level, ckpt_id, path, meta(level))
            for level in levels for folder, pattern in places[level] for ckpt_id, path in _ids(folder, pattern)]


def recover_fti_run(ctx: Any, config: str | os.PathLike[str] | Config, rank: int) -> FtiRunFile:
    """Fill ``ctx``'s protected arrays from the FTI run ``config`` names, rank ``rank``'s checkpoint, as FTI's
    restart finds it (:func:`fti_run_files`' order: the first file that verifies); the file read is returned.
    None verifying is a :class:`NoCheckpointError` saying why each was refused, the arrays untouched."""
    refused = []
    for found in fti_run_files(config, rank):
        try:
            ctx.recover_file(found.path, meta=found.meta)
        except RecoveryError as exc:
            refused.append(f"level {found.level} {found.path}: {exc}")
            continue
        return found
    raise NoCheckpointError(f"no checkpoint file of rank {rank} in the FTI run that {config} names can be "
                            "recovered" + "".join(f"\n  {why}" for why in refused))
