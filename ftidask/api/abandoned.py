"""Runs abandoned before their first commit: swept by the start of any later run in the same ``meta_dir``.

A run started beside a live one (a side run, see :mod:`ftidask.engine.claim`) has an exec_id of its own that no
restart without exec_id finds. Killed before its first commit, it had nothing to restart, and a start of the other
run never looks in its directories: its partial checkpoint (the size of the state) stayed for good. So every start,
once it has collected its own run's leftovers, removes the runs of its ``meta_dir`` that are all of:

* dead: no process holds their run lock, and this start takes it for as long as it removes them (no init adopts
  or restarts them meanwhile); and their last holder ran on this host (on a file system whose locks are
  node-local, Lustre's ``localflock``, a live run on another node holds a lock invisible here: such a run is
  kept, and swept by a later start on its host). On a file system without locks no run is provably dead:
  nothing is swept there;
* not finalized (``run.json`` says ``running``; a finalized run left nothing to sweep);
* without any record in their ``commits`` directory (no checkpoint to restart from, no fallback to the spares
  of a differential one, not even a damaged record), and without an ``l4_archive`` (``keep_l4_ckpt``: the
  archive outlives the run, and a finalize killed once it archived them leaves a run without records).

Every rank removes the run's directory on its node and the temporary files that its staging transfers noted
there left at their destinations (:mod:`ftidask.staging.journal`); then rank 0 what it sees of the other nodes,
the run's global directory and, last, its state in ``meta_dir``. The files in the run's stage directories are
the application's, never removed (as at finalize: only the empty directories go; a restart of the run by its
exec_id finds them there). Nodes that no rank of this start is on keep their directory of such a run. A failure
is logged and leaves the rest to a later start: the start goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.retention import Retention
from ..engine.runstate import RunState
from ..model.config import check_exec_id
from ..model.errors import ConfigError, FTIError
from ..staging import journal
from ..storage import files as storage
from ..storage import runlock
from ..storage.runlock import RunLock
from ..transport.collective import everywhere, on_root

log = logging.getLogger("ftidask")


def sweep(t: Any, paths: storage.RunPaths, retention: Retention) -> list[str]:
    """Collective (every rank of a start, after its own garbage collection): remove the abandoned runs of
    ``paths.meta_dir`` (see the module's docstring); their exec_ids."""
    locks: list[RunLock] = []

    def choose() -> list[str]:
        found = abandoned(paths)
        locks.extend(lock for _run, lock in found)
        return [run for run, _lock in found]

    try:
        runs = on_root(t, choose, FTIError, "cannot list the dead runs in meta_dir")
        if runs:
            everywhere(t, lambda: _remove_local(paths, runs, t.node, retention), FTIError,
                       "removing the dead runs' node directories failed")
            on_root(t, lambda: _remove_rest(paths, runs), FTIError, "removing the dead runs failed")
            log.info("removed %d dead run(s) that never committed a checkpoint: %s", len(runs), ", ".join(runs))
        return list(runs)
    except FTIError as exc:
        log.warning("%s; a later start removes them", exc)
        return []
    finally:
        for lock in locks:
            lock.release()


def abandoned(paths: storage.RunPaths) -> list[tuple[str, RunLock]]:
    """The abandoned runs of ``paths.meta_dir`` other than ``paths.exec_id``, each with its lock, now held."""
    meta = paths.meta_dir
    found: list[tuple[str, RunLock]] = []
    for entry in sorted(meta.iterdir()) if meta.is_dir() else ():
        try:
            run = check_exec_id(entry.name)
        except ConfigError:
            continue
        if run == paths.exec_id or not entry.is_dir() or entry.is_symlink() or not _never_committed(paths, run):
            continue
        lock = runlock.take_dead(entry)
        if lock is None:
            continue
        if not runlock.last_holder_here(entry):  # its lock may be another node's (node-local locks): kept
            lock.release()
            continue
        if _never_committed(paths, run):  # again under its lock: a restart may have committed in between
            found.append((run, lock))
        else:
            lock.release()
    return found


def _never_committed(paths: storage.RunPaths, run: str) -> bool:
    state = RunState(paths.meta_dir, run)
    try:
        records = any(state.records_dir.iterdir()) if state.records_dir.exists() else False
    except OSError:
        return False
    return (not records and state.run_info().get("state") == "running"
            and not (paths.glbl_dir / run / "l4_archive").exists())


def _of(paths: storage.RunPaths, run: str) -> storage.RunPaths:
    return storage.RunPaths(paths.ckpt_dir, paths.glbl_dir, paths.meta_dir, run)


def _remove_local(paths: storage.RunPaths, runs: list[str], node: int, retention: Retention) -> None:
    """On every rank: its node's directories of ``runs``."""
    for run in runs:
        stage = _of(paths, run).stage_root
        if paths.contains(stage):
            journal.tidy_stage(stage, paths.glbl_dir, f"node{node}")
    retention.remove_dead_runs(runs)


def _remove_rest(paths: storage.RunPaths, runs: list[str]) -> None:
    """On rank 0, once every rank removed its node's: what it sees of the other nodes, the global directory, the
    run's state last."""
    for run in runs:
        p = _of(paths, run)
        if paths.contains(p.stage_root):
            journal.tidy_stage(p.stage_root, paths.glbl_dir)
        for path in [*sorted(paths.ckpt_dir.glob(f"node*/{run}")), paths.glbl_dir / run, p.run_meta]:
            if paths.contains(path):
                storage.remove_tree(path)
