"""The client's side of a full checkpoint (levels 1-4) on a Dask cluster: which worker writes what, and
the level's redundancy as tasks.

Every worker (rank ``r``, its position in the sorted addresses) writes the chunks it holds into its
rank file (at L4 straight into the global directory, as an MPI rank does); L2 and L3 then run the level
code shared with the MPI backend, one task per worker, the blocks going worker to worker
(:mod:`ftidask.backends.dask.group_steps`). The commit record, written last by the engine's
:meth:`~ftidask.engine.commit.Committer.seal`, is the commit point. Differential checkpoints (levels
5-8) are :mod:`ftidask.backends.dask.dcp_levels`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distributed import Future

from ...levels.topology import worker_topology
from ...storage import files as storage
from . import group_steps, tasks
from .plan import RankPlan, VarSpec, layout_to_json, plan_ranks

if TYPE_CHECKING:
    from .context import DaskContext


def run_full_levels(ctx: DaskContext, ckpt_id: int, level: int, seq: int, specs: list[VarSpec], futures: dict,
                    owner: dict, workers: list[str], codecs: Mapping[int, dict[str, Any]] | None = None,
                    discards: list[str] | None = None) -> tuple[list[RankPlan], list[dict[str, Any]], list[list[int]]]:
    """Write full checkpoint ``ckpt_id`` (sequence ``seq``) at ``level`` on ``workers``: each rank's chunks
    (``futures`` by (var id, grid index), held by rank ``owner[...]``), then the level's redundancy.
    ``codecs``: var id -> numcodecs config of the variables whose containers the workers compress. ``discards``:
    directories of retired checkpoints, which every write task discards first (every live worker has one).
    Returns the rank plans, what each rank's file task reported, and the L2/L3 groups."""
    n = len(workers)
    plans = plan_ranks(specs, owner, n, codecs)
    topo = worker_topology(n, ctx.config.group_size)
    groups = topo.rank_groups()
    fs = [p.layout.fs for p in plans]
    tag = f"{ckpt_id}-{seq}-{uuid.uuid4().hex[:8]}"  # a key of this run's: another run on the cluster has ids too

    def own(r: int) -> str:  # at L4 in the global directory, written once
        return ctx.node_file(level, ckpt_id, seq, r, storage.rank_file(ckpt_id, r))

    writes = []
    for plan in plans:
        r = plan.rank
        meta = ctx.rank_meta(ckpt_id, level, seq, r, workers)
        partner = fs[topo.left_partner(r)] if level == 2 and len(workers) > 1 else fs[r]
        writes.append(ctx.cluster.submit(
            tasks.write_rank, own(r),
            layout_to_json(plan.layout), [i.to_json() for i in plan.infos], meta, ctx.config.hash, partner,
            max(fs[g] for g in topo.group_ranks(r)), [[c.var_id, c.dptr] for c in plan.chunks],
            *(futures[c.var_id, c.index] for c in plan.chunks), durable=level not in (2, 3), discards=discards or [],
            direct=ctx.config.direct_writes(level), key=f"ftidask-write-{tag}-{r}", worker=workers[r]))
    finals: list[Future] = []
    tags: list[str] = []
    if level in (2, 3):  # the shared level code, its blocks sent worker to worker (group_steps)
        tags = group_steps.session_tags(f"ckpt{ckpt_id}-{seq}-l{level}", groups)
        name = "partner" if level == 2 else "parity"
        for tag_g, group in zip(tags, groups, strict=True):
            for r in group:
                m = group_steps.member("protect", tag_g, group, r, workers, dep=0, level=level, ckpt_id=ckpt_id,
                                       own=own(r))
                finals.append(group_steps.submit_members(ctx.cluster, ctx.config, workers[r], [m], [writes[r]],
                                                         key=f"ftidask-{name}-{tag}-{r}"))
    written = group_steps.wait_step(ctx.cluster, writes + finals, workers, f"checkpoint {ckpt_id}", tags,
                                    ranks=workers)[:n]
    return plans, written, groups
