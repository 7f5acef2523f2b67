"""FTI_ReorderNodes: a run restarted on the same hosts in another order gets its node ids back.

Node-local files (``ckpt_dir`` on each node's own disk: levels 1-3) sit in the directory of the node id their host
had when they were written. A job restarted on the same hosts usually gets them in another order, and numbering
nodes by the order of the hosts would send every rank to a node directory its host does not hold: every file lost
at once, more than L2 or L3 can rebuild. As FTI does at a restart, each host takes back its old node id and each of
its processes the place one of its processes had (read from the newest commit record, which lists the host of each
node and the node of each process), a spare host that replaced a failed one takes the failed node's places (its files
come back from the partner copies or the parity), and the application's ranks are renumbered to match:
``ctx.comm`` (FTI_COMM_WORLD) gives each process the rank whose files its host holds, so an application must use
``ctx.comm``, not ``MPI.COMM_WORLD``. With ``local_test`` (nodes simulated on one machine)
nothing is reordered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ...engine.runstate import RunState, read_current_exec_id
from ...levels.topology import reordered
from ...model.config import Config
from ...storage import runlock

log = logging.getLogger("ftidask")


def processor_name() -> str:
    """This process's host (``MPI_Get_processor_name``; a seam for tests that simulate hosts)."""
    return str(MPI.Get_processor_name())


def recorded_placement(cfg: Config) -> tuple[list[str], list[int]] | None:
    """``(host of each node id, node of each world rank)`` in the newest commit record of the run a restart would
    continue (the configured ``exec_id``, else the current one unless a live process holds it), None when there is
    none (a fresh start, or records from before ftidask kept hosts). Read on one rank; a record or run state that
    cannot be read is no reason to refuse the start (the claim that follows says what is wrong with the run)."""
    try:
        meta_dir = Path(cfg.meta_dir)
        exec_id = cfg.exec_id or read_current_exec_id(meta_dir)
        if exec_id is None or (cfg.exec_id is None and runlock.is_live(meta_dir / exec_id)):
            return None  # no run to restart, or a live run this one starts beside
        records = RunState(meta_dir, exec_id).records()
        if not records:
            return None
        placed = max(records, key=lambda r: r.seq).extra.get("hosts")  # what a restart recovers first
        if isinstance(placed, dict):
            names, nodes = placed.get("names"), placed.get("world")
            if (isinstance(names, list) and all(isinstance(h, str) for h in names) and isinstance(nodes, list)
                    and all(type(n) is int for n in nodes)):
                return names, nodes
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("no node order to restore: %s", exc)
    return None


def reorder_world(cfg: Config, world: Any, names: list[str],
                  share: Callable[[Any], Any]) -> tuple[Any, list[str]]:
    """``(world, hostnames by its ranks)``: ``world`` (``names``: the host of each of its ranks) renumbered so that
    each node gets its recorded id back (collective over ``world``; ``share(value)``: rank 0's JSON ``value`` on every
    rank). The communicator given is freed when a new one replaces it."""
    keys = None
    if world.rank == 0:
        try:
            old = recorded_placement(cfg)
            keys = reordered(*old, names) if old is not None else None
        except Exception as exc:  # noqa: BLE001 - rank 0 must reach share() as every other rank does
            log.warning("the node order of the run to restart is not restored: %s", exc)
    keys = share(keys)
    if keys is None:
        return world, names
    new = world.Split(0, keys[world.rank])
    world.Free()
    order = sorted(range(len(names)), key=keys.__getitem__)
    if new.rank == 0:
        shown = ", ".join(map(str, order[:16])) + (", ..." if len(order) > 16 else "")
        log.warning("restart on the run's hosts in another order (or with a spare host): processes renumbered as the "
                    "checkpoint placed them (FTI_ReorderNodes), so that each rank finds its node-local files; use "
                    "ctx.comm. Rank r of the run's communicator (heads included) is rank [%s][r] of the one given "
                    "to init", shown)
    return new, [names[w] for w in order]
