"""A run written by FTI itself, read as FTI_RecoverFiles reads it (src/recover.c): level 1, 2, 3, then 4.

FTI keeps one rank's files in its run's directories (src/conf.c ``FTI_CreateDirs``), named by the run's
``[restart] exec_id``; with ``local_test = 1`` each simulated node has its own local directory::

    {ckpt_dir}[/node{rank // node_size}]/{exec_id}/l1/Ckpt{id}-Rank{rank}.fti
    {ckpt_dir}[/node{right}]/{exec_id}/l2/Ckpt{id}-Pcof{keeper}.fti   the copy kept on the next node of the group
    {ckpt_dir}[/node{node}]/{exec_id}/l3/Ckpt{id}-Rank{rank}.fti      (its parity Ckpt{id}-RSed{rank}.fti beside it)
    {glbl_dir}/{exec_id}/l4/Ckpt{id}-Rank{rank}.fti
    {glbl_dir}/{exec_id}/l4/Ckpt{id}-mpiio.fti                         MPI-IO (ckpt_io = 2): every rank's part
    {meta_dir}/{exec_id}/l{level}/sector{s}-group{g}.fti              POSIX and MPI-IO I/O (ckpt_io = 1, 2) only
    {ckpt_dir}[/node{node}]/{exec_id}/dCP/dcp-id{f}-rank{rank}.fti      POSIX dCP (meta of l1), after l1's files
    {glbl_dir}/{exec_id}/dCP/dcp-id{f}-rank{rank}.fti                  POSIX dCP, inline L4 (meta of l4), after l4's

``rank`` is the process's rank in FTI's global communicator (heads included); with heads (``head = 1``) the caller
says whether a rank is that or one of FTI_COMM_WORLD (``comm``, :mod:`ftidask.tools.fti_ranks`), a head's is
refused, and the files are found as without heads: FTI names them by global rank, and the heads' post-processing
(L2 copies, L3 parity place by place, L4 flush) leaves the same files (docs/format.md, "FTI runs with heads").
The partner copy of rank ``r`` is kept
by the process at the same place on the next node of its group (``FTI_Topo->right``) and named after that keeper's
rank (``FTI_RecvPtner``); ranks are taken as placed node by node (``node = rank // node_size``, as with
``local_test`` and block placement: FTI itself groups them by host name). After a keep_last_ckpt finalize FTI sets
``failure = 2`` and recovers from level 4 only. Each file found is read with :meth:`ftidask.Context.recover_file`
(every byte verified before an array is written); a missing or refused one sends the search on, as FTI goes on to
the next level. At level 3 a rank file missing or refused is rebuilt from the other files of its group and FTI's parity
(:mod:`ftidask.tools.fti_l3`: FTI_Decode's code, every file checked before use and the result verified before it is
put in place), then read; too many losses or damaged parity is one more reason in the error, and level 4 is tried.
With MPI-IO (``ckpt_io = 2``) levels 1-3 are POSIX files and level 4 FTI's shared file, of which the rank's part is
read (:mod:`ftidask.ftiff.fti_mpiio`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..engine.filerecovery import PreparedFile
from ..ftiff.fti_mpiio import read_mpiio
from ..ftiff.posix import find_section, read_posix
from ..ftiff.reader import parse_ftiff, verify_data
from ..model.config import Config, load_config
from ..model.errors import ConfigError, FormatError, FTIError, NoCheckpointError, RecoveryError
from ..storage.files import open_read
from ..transport.collective import agree, agree_call, attempt
from .fti_l3 import l3_checkpoint_ids, rebuild_rank_file
from .fti_ranks import app_rank, global_rank

__all__ = ["FtiRunFile", "app_rank", "fti_run_files", "global_rank", "recover_fti_run"]


@dataclasses.dataclass(frozen=True)
class FtiRunFile:
    """One place FTI may keep a rank's checkpoint: its level, checkpoint id (a POSIX dCP file's file id), the file,
    and (POSIX I/O) the directory of the meta files that describe it (None for FTI-FF: they describe themselves);
    ``rank``: whose part of FTI's MPI-IO shared file (None for a file of one rank)."""

    level: int
    ckpt_id: int
    path: Path
    meta: Path | None
    rebuilt: bool = False  # level 3: rebuilt from the group's files and FTI's parity (ftidask.tools.fti_l3)
    rank: int | None = None


def _config(config: str | os.PathLike[str] | Config) -> Config:
    cfg = config if isinstance(config, Config) else load_config(config)
    if cfg.exec_id is None:
        raise ConfigError("[restart] exec_id names the FTI run to read (FTI writes it there with failure = 1 once "
                          "its run has a checkpoint); this config has none")
    if cfg.ckpt_io not in (1, 2, 3):
        raise ConfigError(f"ckpt_io = {cfg.ckpt_io}: only FTI's POSIX (1), MPI-IO (2) and FTI-FF (3) runs are read")
    return cfg


def _levels(cfg: Config) -> list[int]:
    """The levels FTI's restart tries, in order: level 4 only after a keep_last_ckpt finalize (``failure = 2``)."""
    return [4] if cfg.failure == 2 else [1, 2, 3, 4]


def _meta_dir(cfg: Config, level: int) -> Path | None:
    """The directory of the meta files of ``level`` (POSIX and MPI-IO runs); None for FTI-FF, whose files describe
    themselves."""
    return Path(cfg.meta_dir) / str(cfg.exec_id) / f"l{level}" if cfg.ckpt_io in (1, 2) else None


def _ids(folder: Path, pattern: str) -> list[tuple[int, Path]]:
    """``(checkpoint id, path)`` of the files in ``folder`` whose name matches ``pattern``, newest id first."""
    found = []
    try:  # a directory the OS refuses to list (permissions, a name too long) is said, not a traceback
        if not folder.is_dir():
            return []
        for path in folder.iterdir():
            named = re.fullmatch(pattern, path.name)
            if named and path.is_file():
                found.append((int(named[1]), path))
    except OSError as exc:
        raise RecoveryError(f"cannot list the FTI run's directory {folder}: {exc}") from None
    return sorted(found, reverse=True)


def fti_run_files(config: str | os.PathLike[str] | Config, rank: int, *,
                  comm: str | None = None) -> list[FtiRunFile]:
    """The files where the FTI run that ``config`` names (FTI's config file: its directories, topology,
    ``ckpt_io`` and ``[restart]``) keeps rank ``rank``'s checkpoint, in the order FTI_RecoverFiles tries them.

    ``comm``: which communicator ``rank`` is a rank of, ``"global"`` (the one given to FTI_Init, heads included, as
    in FTI's file names) or ``"app"`` (FTI_COMM_WORLD); it must be said for a run with heads (``head = 1``), where
    the two differ (:func:`global_rank`: ConfigError otherwise, and for a head's rank)."""
    cfg = _config(config)
    rank = global_rank(cfg, rank, comm)
    exec_id, per_node, group = cfg.exec_id, cfg.node_size, cfg.group_size
    node = rank // per_node
    right = node - node % group + (node % group + 1) % group  # FTI_Topo->right: next node of the group, a ring
    keeper = right * per_node + rank % per_node

    def local(n: int) -> Path:
        return Path(cfg.ckpt_dir) / (f"node{n}" if cfg.local_test else "") / str(exec_id)

    places = {1: [(local(node) / "l1", rf"Ckpt(\d+)-Rank{rank}\.fti")],
              2: [(local(node) / "l2", rf"Ckpt(\d+)-Rank{rank}\.fti"),
                  (local(right) / "l2", rf"Ckpt(\d+)-Pcof{keeper}\.fti")],
              3: [(local(node) / "l3", rf"Ckpt(\d+)-Rank{rank}\.fti")],
              4: [(Path(cfg.glbl_dir) / str(exec_id) / "l4", rf"Ckpt(\d+)-Rank{rank}\.fti")]}
    if cfg.ckpt_io == 2:  # MPI-IO: level 4 is one file of every rank's part (FTI_InitMPIO)
        places[4] = [(Path(cfg.glbl_dir) / str(exec_id) / "l4", r"Ckpt(\d+)-mpiio\.fti")]
    if cfg.ckpt_io == 1:  # POSIX dCP files: L1's dCP directory, L4's (inline L4), FTI_InitDCPPosix
        places[1].append((local(node) / "dCP", rf"dcp-id(\d+)-rank{rank}\.fti"))
        places[4].append((Path(cfg.glbl_dir) / str(exec_id) / "dCP", rf"dcp-id(\d+)-rank{rank}\.fti"))
    return [FtiRunFile(level, ckpt_id, path, _meta_dir(cfg, level),
                       rank=rank if path.name.endswith("-mpiio.fti") else None)
            for level in _levels(cfg) for folder, pattern in places[level] for ckpt_id, path in _ids(folder, pattern)]


def _copy_of_another(found: FtiRunFile, rank: int) -> str:
    """Why a POSIX partner copy is not rank ``rank``'s: the meta section it is read with (its keeper's left
    neighbour's) names another rank's file, as when the processes were not placed node by node; '' otherwise (the
    copy's own checks are then recover_file's)."""
    if found.meta is None or not found.path.name.startswith(f"Ckpt{found.ckpt_id}-Pcof"):
        return ""
    try:
        named = find_section(found.path, found.meta)[1].get("ckpt_file_name", "")
    except FormatError:
        return ""  # recover_file refuses it, saying why
    want = f"Ckpt{found.ckpt_id}-Rank{rank}.fti"
    return "" if named == want else (f"this copy holds {named} (its keeper's left neighbour in the meta file), not "
                                     f"{want}: the processes were not placed node by node as assumed")


def _sound(found: FtiRunFile) -> bool:
    """Whether a rank file verifies by itself (its hashes, or its meta file's MD5; the rank's part of FTI's MPI-IO
    file): one that a recovery refused for another reason (the protected arrays' sizes) is not rebuilt from the
    parity, which would replace it."""
    try:
        if found.rank is not None:
            read_mpiio(found.path, found.meta, found.rank)
        elif found.meta is not None:
            read_posix(found.path, found.meta)
        else:
            with open_read(found.path) as fh:
                verify_data(fh, parse_ftiff(fh, str(found.path)))
    except (FTIError, OSError):
        return False
    return True


def _run_ranks(cfg: Config, rank: int, comm: str | None, nranks: Any) -> list[int]:
    """The global ranks of the run's application processes, ``nranks`` processes numbered as ``comm`` numbers them
    (with heads and ``comm="global"``, heads included and passed over); [] without ``nranks``."""
    if nranks is None:
        return []
    if isinstance(nranks, bool) or not isinstance(nranks, int) or not 0 <= rank < nranks:
        raise ConfigError(f"nranks = {nranks!r}: the number of the run's processes (an int above rank {rank}"
                          + (f", counted in the {comm} communicator" if cfg.head else "") + ")")
    if cfg.head and comm == "global":
        return [r for r in range(nranks) if r % cfg.node_size]
    return [global_rank(cfg, r, comm) for r in range(nranks)]


def recover_fti_run(ctx: Any, config: str | os.PathLike[str] | Config, rank: int, *,
                    comm: str | None = None, nranks: int | None = None) -> FtiRunFile:
    """Fill ``ctx``'s protected arrays from the FTI run ``config`` names, rank ``rank``'s checkpoint, as FTI's
    restart finds it (:func:`fti_run_files`' order: the first file that verifies); the file read is returned.

    FTI's restart takes a level only when every rank can recover from it (an allreduce after each level's attempt),
    so that every rank gets the same checkpoint. With ``ctx`` on several MPI ranks (a collective call: every rank
    makes it, with its own ``rank``), the ranks agree so: each rank verifies its own file, every byte against its
    hashes, and checks it against its protected arrays; no rank writes an array before every rank's file is known
    to fit. One process that reads the ranks of a run of ``nranks`` processes one by one (``nranks`` counted as
    ``comm`` counts them) gives ``nranks`` to check theirs as well: every rank's files are read to verify them
    (whether they fit that rank's arrays is known only when that rank is read). Otherwise only this rank's files
    are looked at: its newest file that verifies, whatever the other ranks could recover.

    A level-2 checkpoint whose own file is missing or refused is read from its partner copy. At level 3, one whose
    rank file is missing or does not verify is rebuilt from its group's other files and FTI's parity (in place, as
    FTI_RecoverL3 does) and the rebuilt file read (``rebuilt`` True). None verifying is a
    :class:`NoCheckpointError` saying why each was refused (a rebuild too: too many losses, damaged parity), the
    arrays untouched. ``comm`` as for :func:`fti_run_files` (to be said with heads); the files are those of the
    global rank it gives."""
    guard = getattr(ctx, "_calls", None)  # one call of the context at a time, as its own recover_file
    with guard.enter("recover_fti_run") if guard is not None else contextlib.nullcontext():
        return _recover(ctx, config, rank, comm, nranks)


def _recover(ctx: Any, config: str | os.PathLike[str] | Config, rank: int, comm: str | None,
             nranks: int | None) -> FtiRunFile:
    t = ctx.transport
    many = t.size > 1
    refused: list[str] = []

    def start() -> tuple[dict[str, Any], tuple[Config, int, _Candidates, list[_Candidates]]]:
        ctx._file_checks()  # the context's own refusals (an iCP open) are the call's, before any file is looked at
        cfg = _config(config)
        me = global_rank(cfg, rank, comm)
        if many and nranks is not None:
            raise ConfigError(f"nranks = {nranks!r} is for one process that reads the ranks of a run one by one; "
                              f"with a context on {t.size} ranks, the ranks agree among themselves: leave it out")
        others = [_Candidates(cfg, r, []) for r in _run_ranks(cfg, rank, comm, nranks) if r != me]
        # the same run on every rank: ranks given other configs would look for other checkpoints (a raw error, a wait)
        run = {key: str(getattr(cfg, key)) for key in ("exec_id", "failure", "ckpt_io", "ckpt_dir", "glbl_dir",
                                                        "meta_dir", "node_size", "group_size", "head", "local_test")}
        return {"comm": comm} | run, (cfg, me, _Candidates(cfg, me, refused), others)

    # every rank's refusal (its config, its rank, a directory it cannot list) raised on every rank, never a wait
    cfg, me, mine, others = agree_call(t, "recover_fti_run", start, RecoveryError)
    keys = set(mine.keys)
    parts: list[Any] = []
    if many:
        parts = t.allgather([me, sorted(keys)])
        ranks = [r for r, _keys in parts]
        if len(set(ranks)) < len(ranks):  # two processes would read one rank's file, and none another's
            raise RecoveryError("recover_fti_run: the ranks of this context name the FTI run's ranks "
                                f"{ranks} (global ranks, by context rank): each must name a different one")
    for part in [k for _r, k in parts] if many else [c.keys for c in others]:
        keys |= {tuple(k) for k in part}
    order = {level: i for i, level in enumerate(_levels(cfg))}
    for key in sorted(keys, key=lambda k: (order[k[0]], k[1], -k[2])):  # a level's dCP files after its own
        what = f"level {key[0]} checkpoint {key[2]}"
        if many:  # an unexpected error of one rank (out of memory) is every rank's
            prepared, error = attempt(t.rank, lambda: mine.prepare(ctx, key))
            try:
                agree(t, error, RecoveryError, f"recovering {what} of the FTI run")
            except RecoveryError:
                if prepared is not None:
                    prepared[1].release()
                raise
            if not t.all_ok(prepared is not None):
                if prepared is not None:
                    prepared[1].release()
                    refused.append(f"{what}: another rank cannot recover it")
                continue
        else:
            prepared = mine.prepare(ctx, key)
        if prepared is not None and others and not all(c.usable(key) for c in others):
            prepared[1].release()
            refused.append(f"{what}: not every one of the {nranks} ranks can recover it")
            continue
        if prepared is None:
            continue
        found, ready = prepared
        if many:
            agree(t, attempt(t.rank, ready.load)[1], RecoveryError, f"recovering {what} of the FTI run failed while "
                  "loading, and the protected arrays may hold part of it: recover again")
        else:
            ready.load()
        return found
    raise NoCheckpointError(f"no checkpoint file of rank {rank} in the FTI run that {config} names can be "
                            "recovered" + ("" if not (many or others) else " by every rank")
                            + "".join(f"\n  {why}" for why in refused))


class _Candidates:
    """Rank ``rank``'s checkpoints of an FTI run: which ``(level, dCP, id)`` it may have (:attr:`keys`: a POSIX dCP
    file 1 else 0, the checkpoint id or dCP file id), the file of one prepared to be read into the arrays
    (:meth:`prepare`), or whether one verifies (:meth:`usable`, another rank's); a level-3 file rebuilt where it
    must be."""

    def __init__(self, cfg: Config, rank: int, refused: list[str]) -> None:
        self.cfg, self.rank, self.refused = cfg, rank, refused
        self.files = fti_run_files(cfg, rank, comm="global")
        keys = {_key(f) for f in self.files}
        if 3 in _levels(cfg):
            keys |= {(3, 0, ckpt_id) for ckpt_id in l3_checkpoint_ids(cfg, rank)}
        self.keys = sorted(keys)

    def _of(self, key: tuple[int, int, int]) -> list[FtiRunFile]:
        """The files of checkpoint ``key``, in FTI's order (a level-2 rank file, then its partner copy), but those
        that hold another rank's bytes (said in ``refused``)."""
        files = []
        for found in (f for f in self.files if _key(f) == key):
            other = _copy_of_another(found, self.rank)
            if other:
                self.refused.append(f"level {key[0]} {found.path}: {other}")
            else:
                files.append(found)
        return files

    def prepare(self, ctx: Any, key: tuple[int, int, int]) -> tuple[FtiRunFile, PreparedFile] | None:
        """The first file of checkpoint ``key`` that verifies and fits ``ctx``'s protected arrays, prepared to be
        loaded into them (nothing written yet), else None, why each was refused in ``refused``. Level 3: the rank's
        own file; rebuilt from the group when it is missing or does not verify (a sound one that does not fit the
        arrays is not rebuilt: nothing was lost)."""
        files = self._of(key)
        for found in files:
            prepared = self._prepare(ctx, found)
            if prepared is not None:
                return found, prepared
        if key[0] != 3 or (files and _sound(files[0])):
            return None
        rebuilt = self._rebuild(key[2])
        prepared = None if rebuilt is None else self._prepare(ctx, rebuilt)
        return None if prepared is None else (rebuilt, prepared)

    def usable(self, key: tuple[int, int, int]) -> bool:
        """Whether a file of checkpoint ``key`` verifies (every byte; a level-3 one rebuilt where it must be)."""
        files = self._of(key)
        if any(_sound(found) for found in files):
            return True
        return key[0] == 3 and self._rebuild(key[2]) is not None

    def _rebuild(self, ckpt_id: int) -> FtiRunFile | None:
        try:
            path = rebuild_rank_file(self.cfg, self.rank, ckpt_id)
        except RecoveryError as exc:
            self.refused.append(f"level 3 checkpoint {ckpt_id}, rank file rebuilt from FTI's parity: {exc}")
            return None
        return FtiRunFile(3, ckpt_id, path, _meta_dir(self.cfg, 3), True)

    def _prepare(self, ctx: Any, found: FtiRunFile) -> PreparedFile | None:
        try:
            return ctx._prepare_file(found.path, meta=found.meta,
                                     **({} if found.rank is None else {"rank": found.rank}))
        except RecoveryError as exc:
            self.refused.append(f"level {found.level} {found.path}: {exc}")
            return None


def _key(found: FtiRunFile) -> tuple[int, int, int]:
    return found.level, int(found.path.name.startswith("dcp-")), found.ckpt_id
