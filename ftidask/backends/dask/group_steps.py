"""The client's side of an L2/L3 step: one task per worker, sessions per group, abort on failure.

The client only places the members (:func:`member`) and waits; the blocks move between the
workers (:mod:`ftidask.backends.dask.channel`). When a task of the step fails or its worker is lost, the
client aborts the step's sessions on every worker (:func:`wait_step`): the members still waiting
for a peer raise at once instead of waiting for it, so no worker thread stays blocked.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from distributed import Future

from ...model.config import Config
from . import channel, group_tasks
from .cluster import Cluster, ClusterError

log = logging.getLogger("ftidask")


def session_tags(what: str, groups: Sequence[Sequence[int]]) -> list[str]:
    """One session tag per group, unique to this step (a retried checkpoint id gets new ones)."""
    token = uuid.uuid4().hex[:8]
    return [f"{what}-g{gi}-{token}" for gi in range(len(groups))]


def member(step: str, tag: str, group: Sequence[int], rank: int, hosts: Sequence[str] | dict[int, str],
           dep: int | None = None, **values: Any) -> dict[str, Any]:
    """Rank ``rank``'s member of the session ``tag`` of ``group`` (ranks), each rank on ``hosts[rank]``."""
    return {"step": step, "tag": tag, "index": list(group).index(rank), "peers": [hosts[r] for r in group],
            "rank": rank, "dep": dep, **values}


def submit_members(cluster: Cluster, cfg: Config, worker: str, members: list[dict[str, Any]], deps: Sequence[Any],
                   key: str) -> Future:
    """The task that runs ``worker``'s members of a step (:func:`ftidask.backends.dask.group_tasks.run_members`).

    L3 runs in stripes as large as L2's pieces (``transfer_size``), not ``block_size``: each stripe is a round
    trip between workers, milliseconds over their comms where MPI takes microseconds (2 workers x 256 MiB: an
    L3 checkpoint took 3.4 s in 1 MiB stripes, 1.0-1.6 s in 8-16 MiB ones). The parity bytes do not depend on
    the stripe; a member holds a few stripes per peer (see :mod:`.channel`).
    """
    cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, cfg.transfer_size << 10))
    return cluster.submit(group_tasks.run_members, members, cfg, *deps, key=key, worker=worker)


def abort(cluster: Cluster, tags: Sequence[str], why: str) -> None:
    """Abort sessions ``tags`` on every worker (best effort: a worker that is gone has nothing to abort)."""
    try:
        cluster.run(channel.abort_sessions, list(tags), why)
    except Exception as exc:  # noqa: BLE001 - the step already failed; its error is the one to report
        log.debug("could not abort the sessions %s: %s", list(tags), exc)


def wait_step(cluster: Cluster, futures: Sequence[Future], addresses: Any, what: str, tags: Sequence[str],
              ranks: Sequence[str] = (), gather: bool = True) -> list[Any]:
    """:meth:`Cluster.wait_all`, aborting the step's sessions everywhere when it fails."""
    try:
        return cluster.wait_all(futures, addresses, what, gather=gather, ranks=ranks)
    except ClusterError as exc:
        if tags:
            abort(cluster, tags, f"{what} failed: {exc.detail}")
        raise
