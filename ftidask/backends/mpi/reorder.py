"""FTI_ReorderNodes: a run restarted on the same hosts in another order gets its node ids back.

Node-local files (``ckpt_dir`` on each node's own disk: levels 1-3) sit in the directory of the node id their host
had when they were written. A job restarted on the same hosts usually gets them in another order, and numbering
nodes by the order of the hosts would send every rank to a node directory its host does not hold: every file lost
at once, more than L2 or L3 can rebuild. As FTI does at a restart, each host takes back its old node id (read from
the newest commit record, which lists the host of each node), a spare host that replaced a failed one takes the
failed node's id (its files come back from the partner copies or the parity), and the application's ranks are
renumbered to match: ``ctx.comm`` (FTI_COMM_WORLD) gives each process the rank whose files its host holds, so an
application must use ``ctx.comm``, not ``MPI.COMM_WORLD``. With ``local_test`` (nodes simulated on one machine)
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

log = logging.getLogger("ftidask")


def processor_name() -> str:
    """This process's host (``MPI_Get_processor_name``; a seam for tests that simulate hosts)."""
    return str(MPI.Get_processor_name())


def recorded_hosts(cfg: Config) -> list[str] | None:
    """The host of each node id in the newest commit record of the run a restart would continue (the configured
    ``exec_id``, else the current one), None when there is none (a fresh start, or records from before ftidask kept
    hosts). Read on one rank; a record or run state that cannot be read is no reason to refuse the start."""
    try:
        meta_dir = Path(cfg.meta_dir)
        exec_id = cfg.exec_id or read_current_exec_id(meta_dir)
        if exec_id is None:
            return None
        for record in sorted(RunState(meta_dir, exec_id).records(), key=lambda r: r.seq, reverse=True):
            hosts = record.extra.get("hosts")
            if isinstance(hosts, list) and hosts and all(isinstance(h, str) for h in hosts):
                return hosts
            return None  # the newest record is what a restart recovers first: its hosts or none
    except Exception as exc:  # noqa: BLE001 - the claim that follows says what is wrong with the run, if anything
        log.debug("no node order to restore: %s", exc)
    return None


def reorder_world(cfg: Config, world: Any, names: list[str],
                  share: Callable[[Any], Any]) -> tuple[Any, list[str]]:
    """``(world, hostnames by its ranks)``: ``world`` (``names``: the host of each of its ranks) renumbered so that
    each node gets its recorded id back (collective over ``world``; ``share(value)``: rank 0's JSON ``value`` on every
    rank). The communicator given is freed when a new one replaces it."""
    old = recorded_hosts(cfg) if world.rank == 0 else None
    keys = share(reordered(old, names) if old is not None else None)
    if keys is None:
        return world, names
    new = world.Split(0, keys[world.rank])
    world.Free()
    order = sorted(range(len(names)), key=keys.__getitem__)
    if new.rank == 0:
        log.warning("restart on the run's hosts in another order: nodes renumbered as when the checkpoint was "
                    "written (FTI_ReorderNodes), so each rank finds its node-local files; ctx.comm rank r is "
                    "MPI.COMM_WORLD rank %s", order[:16])
    return new, [names[w] for w in order]
