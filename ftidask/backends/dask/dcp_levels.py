"""The client's side of differential checkpoints (levels 5-8) on a Dask cluster.

Each worker (rank ``r``) patches its spare, ``{level dir of node r}/dcp/Spare-Rank{r}.fti``: the
file of its last retired differential checkpoint of that level, renamed there at retirement
(:meth:`DaskSpares.keep`). The client remembers each spare's FB hash from the retired commit record
and passes it to the write task, which trusts the spare's block digests only when its FB has that
hash; any other spare (none yet, a new rank-to-worker mapping, a torn file, a restarted client) is
rewritten in full, which is still a valid checkpoint. Levels:

* L1 (5) and L4 (8) write the differential file in the level's own directory (the global one
  for L4, so only changed blocks cross to the global file system);
* L2 (6) sends the partner only the changed ranges when it still holds the base file as its spare
  partner copy, else the whole file (:mod:`ftidask.levels.partner_delta`);
* L3 (7) updates every member's spare parity from the group's XOR deltas when every spare encodes
  the deltas' base files, else re-encodes the parity from the new files (:mod:`ftidask.levels.rs_delta`).

L2 and L3 run the level code shared with the MPI backend, one task per worker, the blocks going
worker to worker (:mod:`ftidask.backends.dask.group_steps`).

The commit record, written last by the engine, is the commit point, as for every checkpoint.
"""

from __future__ import annotations

import logging
import operator
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from distributed import Future

from ...engine.runstate import CommitRecord
from ...ftiff import blockhash
from ...levels import rs
from ...levels.topology import recorded_topology, worker_topology
from ...model.errors import FTIError
from ...storage import files as storage
from . import dcp_tasks, group_steps, recorded
from .plan import VarSpec, layout_to_json, plan_ranks

log = logging.getLogger("ftidask")


def spare_path(ctx: Any, level: int, rank: int) -> str:
    """Rank ``rank``'s spare file of ``level``: the file its differential checkpoints patch."""
    return str(ctx.paths.level_dir(level, rank) / storage.SPARE_DIR / storage.spare_file(rank))


def spare_parity_path(ctx: Any, rank: int) -> str:
    """Rank ``rank``'s spare L3 parity file, patched with its group's differential checkpoints."""
    return str(ctx.paths.level_dir(3, rank) / storage.SPARE_DIR / storage.spare_file(rank, "RSed"))


def spare_pcof_path(ctx: Any, rank: int) -> str:
    """The spare partner copy rank ``rank`` keeps, patched with its partner's differential checkpoints."""
    return str(ctx.paths.level_dir(2, rank) / storage.SPARE_DIR / storage.spare_file(rank, "Pcof"))


def sticky_owners(ctx: Any, level: int, owner: dict[tuple[int, tuple[int, ...]], int],
                  workers: list[str]) -> dict[tuple[int, tuple[int, ...]], int]:
    """Each chunk's writer: the rank that wrote it in the newest differential checkpoint of ``level``
    when the workers are the same, else the rank that holds it (``owner``).

    A file's layout follows the chunks its worker holds, and Dask may compute a new chunk on
    another worker than the last one: the file would then be rewritten from that container on.
    Moving the chunk to its previous writer (a worker-to-worker transfer, never via the client)
    keeps every file's layout, so only changed blocks are written.
    """
    prev = next((r for r in reversed(ctx.state.records())
                 if r.level == level and r.extra.get("dcp") and r.extra.get("workers") == workers), None)
    if prev is None:
        return owner
    try:
        chunks = recorded.layout(prev).chunks
    except recorded.DamagedRecord:  # a hint only: the chunks stay where they are
        return owner
    out = dict(owner)
    moved = moved_bytes = 0
    for vid, rows in chunks.items():
        for at in rows:
            key = (vid, at.index)
            if key in out and at.rank < len(workers) and out[key] != at.rank:
                out[key] = at.rank
                moved, moved_bytes = moved + 1, moved_bytes + at.nbytes
    if moved:
        log.debug("differential checkpoint: %d chunks (%d bytes) move to the worker that wrote them last time",
                 moved, moved_bytes)
    return out


def run_dcp_levels(ctx: Any, ckpt_id: int, level: int, seq: int, specs: list[VarSpec], futures: dict,
                   owner: dict, workers: list[str]) -> tuple[list, list[dict[str, Any]], list[list[int]]]:
    """Write differential checkpoint ``ckpt_id`` at ``level`` (1-4) on every worker, with its redundancy."""
    n = len(workers)
    ctx.spares.nranks = max(ctx.spares.nranks, n)
    plans = plan_ranks(specs, owner, n)
    topo = worker_topology(n, ctx.config.group_size)
    groups = topo.rank_groups()
    fs = [p.layout.fs for p in plans]
    tag = f"{ckpt_id}-{seq}-{uuid.uuid4().hex[:8]}"  # a key of this run's: another run on the cluster has ids too
    bid = blockhash.block_hash_id(ctx.config.dcp_mode)
    spares = ctx.spares.hints
    pinned = ctx.spares.left_alone(level)  # the spares are the checkpoint recovered: files written anew

    def own(r: int) -> str:
        return ctx.node_file(level, ckpt_id, seq, r, storage.rank_file(ckpt_id, r))

    writes = []
    for plan in plans:
        r = plan.rank
        meta = ctx.rank_meta(ckpt_id, level, seq, r, workers)
        partner = fs[topo.left_partner(r)] if level == 2 else fs[r]
        writes.append(ctx.cluster.submit(
            dcp_tasks.write_rank_dcp, spare_path(ctx, level, r), own(r),
            None if pinned else spares.pop((level, r), None),
            layout_to_json(plan.layout), [i.to_json() for i in plan.infos], meta, ctx.config.hash,
            ctx.config.dcp_block_size, bid, partner, max(fs[g] for g in topo.group_ranks(r)),
            [[c.var_id, c.dptr] for c in plan.chunks], *(futures[c.var_id, c.index] for c in plan.chunks),
            with_xor=level == 3, fresh=pinned, key=f"ftidask-dcp-write-{tag}-{r}", worker=workers[r]))
    deps = writes  # what each member's level task takes from its write (the delta, or the XOR bytes)
    if level == 3:  # (result, XOR bytes): the client takes the result, the bytes stay on the workers
        writes = [ctx.cluster.submit(operator.getitem, w, 0, key=f"ftidask-dcp-result-{tag}-{r}", worker=workers[r])
                  for r, w in enumerate(writes)]
    finals: list[Future] = []
    tags: list[str] = []
    if level in (2, 3):  # the shared level code over the workers' channels (see group_steps)
        tags = group_steps.session_tags(f"dcp{ckpt_id}-{seq}-l{level}", groups)
        for tag_g, group in zip(tags, groups, strict=True):
            for r in group:
                if level == 2:
                    m = group_steps.member("protect_delta", tag_g, group, r, workers, dep=0, own=own(r),
                                           pcof_name=storage.partner_file(ckpt_id, r), claim=not pinned)
                else:
                    m = group_steps.member("parity_delta", tag_g, group, r, workers, dep=0, level=3, ckpt_id=ckpt_id,
                                           own=own(r), parity_name=storage.parity_file(ckpt_id, r), claim=not pinned)
                finals.append(group_steps.submit_members(
                    ctx.cluster, ctx.config, workers[r], [m], [deps[r]],
                    key=f"ftidask-dcp-{'partner' if level == 2 else 'parity'}-{tag}-{r}"))
    results = group_steps.wait_step(ctx.cluster, writes + finals, workers, f"differential checkpoint {ckpt_id}", tags,
                                    ranks=workers)
    written = results[:n]
    done = {int(d[0]["rank"]): d[0] for d in results[n:]}
    if level == 2:  # what crossed to the partners: deltas, or whole files when a partner had no base
        for w in written:
            w["partner_bytes"] = done[w["rank"]]["sent"]
    elif level == 3:
        for group in groups:
            if not done[group[0]]["updated"]:  # the members agreed: all updated, or all re-encoded
                log.info("L3: group %s re-encodes its parity in full (%s)", group, done[group[0]]["why"])
    return plans, written, groups


class DaskSpares:
    """The client's knowledge of the workers' spares: (level, rank) -> the spare's FB hash (hex), the
    differential checkpoints known sound (written or recovered by this client: only their files become
    spares) and the levels whose spares hold the checkpoint a recovery fell back to (see :mod:`.fallback`)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.hints: dict[tuple[int, int], str] = {}
        self.nranks = 0  # the most workers a differential checkpoint of this run had
        self.sound: set[int] = set()  # seqs of the checkpoints committed or recovered by this client
        self.pinned: set[int] = set()  # levels whose spares are the checkpoint recovered: never patched now
        self.read: dict[int, CommitRecord] = {}  # level -> the fallback recovered, while live arrays may read it

    def written(self, record: CommitRecord) -> None:
        """This client committed ``record``: its files are sound (they may become spares)."""
        self.sound.add(record.seq)

    def recovered(self, record: CommitRecord) -> None:
        """``record``'s files were verified and read. A fallback's spares are all that a crash would recover:
        the next checkpoint of their level leaves them alone (written in full, in its own directory) until a
        newer checkpoint of that level or above is committed (it retires one: :meth:`keep`)."""
        self.nranks = max(self.nranks, record.nranks)
        if record.fallback:
            self.pinned.add(record.level)
            self.read[record.level] = record
            for f in record.files:  # the spares' state is known: once unpinned they are patched again
                self.hints[record.level, f.rank] = f.fb_hash
        else:
            self.pinned.discard(record.level)  # a sound committed checkpoint: the spares may be patched again
            self.sound.add(record.seq)

    def distrust(self, level: int) -> None:
        """A recovery found the spares of ``level`` (a fallback) damaged or not the files its record names: the next
        differential checkpoint of the level writes every block. Patched from the FB hashes noted, a damaged block
        that checkpoint does not change was kept as it was: committed, reported written, and never verified."""
        for key in [k for k in self.hints if k[0] == level]:
            del self.hints[key]

    def left_alone(self, level: int) -> bool:
        """Must the spares of ``level`` stay as they are (neither patched nor replaced)? After a recovery from
        them, until a newer checkpoint of the level or above is committed, and while live arrays may still
        read chunks back from them (their lineage, see :class:`~ftidask.backends.dask.lineage.Pins`)."""
        if level in self.pinned:
            return True
        record = self.read.pop(level, None)
        if record is None:
            return False
        pins = self.ctx._dask_retention.pins
        if pins.read([record]):
            self.read[level] = record
            return True
        pins.forget(record)
        return False

    def keep(self, record: CommitRecord, named: Callable[[bool], None] = lambda keeping: None) -> bool:
        """Before retired checkpoint ``record`` is removed: if it is a differential one known sound, rename each
        rank's file (and, at L2, each partner copy) to its spare name, on the worker that sees it, and note their
        FB hashes. True when every rank's file is now its spare (recovery may fall back to them). The files of a
        checkpoint not known sound (perhaps the damaged one a recovery passed over) never replace a spare.

        ``named(keeping)`` is called first, before any file moves (the client writes the fallback record there):
        a client killed once the files were the spares and before the fallback record was written left the
        checkpoint named by its commit record only, which points at its directories, so a damaged newest one
        left nothing to recover. Until the moves, the fallback record names spares that still hold older files
        (they fail the FB hash check: passed over) and the commit record the checkpoint's own files."""
        self.nranks = max(self.nranks, record.nranks)
        self.pinned.discard(record.level)  # a newer checkpoint of this level or above is committed
        sound = record.seq in self.sound
        self.sound.discard(record.seq)
        if not record.extra.get("dcp") or not sound or self.left_alone(record.level):
            named(False)
            return False
        ctx = self.ctx
        live = set(ctx.cluster.workers())
        workers: Sequence[str] = record.extra.get("workers") or []
        groups = record.extra.get("groups") or []
        moves: dict[str, list[list[str]]] = {}
        kept: dict[str, list[tuple[int, int, str]]] = {}

        def move(worker: str, src: str, dst: str, hint: tuple[int, int, str]) -> None:
            moves.setdefault(worker, []).append([src, dst])
            kept.setdefault(worker, []).append(hint)

        for f in record.files:
            if f.rank >= len(workers) or workers[f.rank] not in live:
                continue
            move(workers[f.rank], ctx.node_file(record.level, record.ckpt_id, record.seq, f.rank,
                                            storage.rank_file(record.ckpt_id, f.rank)),
                 spare_path(ctx, record.level, f.rank), (record.level, f.rank, f.fb_hash))
            if record.level == 3:  # its parity and record, for the next parity update
                parity = ctx.node_file(3, record.ckpt_id, record.seq, f.rank,
                                       storage.parity_file(record.ckpt_id, f.rank))
                spare = spare_parity_path(ctx, f.rank)
                move(workers[f.rank], parity, spare, (0, f.rank, ""))
                move(workers[f.rank], str(rs.hash_path(Path(parity))), str(rs.hash_path(Path(spare))), (0, f.rank, ""))
            if record.level == 2 and groups:
                holder = recorded_topology(groups).right_partner(f.rank)
                if holder < len(workers) and workers[holder] in live:
                    move(workers[holder], ctx.node_file(2, record.ckpt_id, record.seq, holder,
                                                    storage.partner_file(record.ckpt_id, holder)),
                         spare_pcof_path(ctx, holder), (0, holder, ""))  # the holder reports its hash itself
        moving = {f.rank for f in record.files if f.rank < len(workers) and workers[f.rank] in live}
        named(moving == set(range(record.nranks)) == {f.rank for f in record.files})  # before any move
        token = uuid.uuid4().hex[:8]  # keys of this run's (another run on the cluster has seqs too)
        futures = {w: ctx.cluster.submit(dcp_tasks.keep_as_spares, m, key=f"ftidask-dcp-keep-{record.seq}-{token}-{i}",
                                         worker=w) for i, (w, m) in enumerate(sorted(moves.items()))}
        try:
            done = ctx.cluster.wait_all(list(futures.values()), list(futures), "keeping spares")
        except FTIError:  # no spare only means that the next differential checkpoint writes in full
            return False
        spares = set()
        for w, ok in zip(futures, done, strict=True):
            for (lv, rank, fb_hash), moved in zip(kept[w], ok, strict=True):
                if moved and lv > 0:
                    self.hints[lv, rank] = fb_hash
                    spares.add(rank)
        return spares == set(range(record.nranks)) == {f.rank for f in record.files}

    def discard(self) -> None:
        """A checkpoint failed: the spares it was patching are unknown now."""
        self.hints.clear()

    def clear(self) -> None:
        """The run is over: remove every spare directory on every worker."""
        nranks = max(self.nranks, len(self.ctx.cluster.workers()))  # a restarted client wrote none yet
        dirs = [str(self.ctx.paths.level_dir(level, r) / storage.SPARE_DIR) for level in (1, 2, 3, 4)
                for r in range(nranks)]
        if dirs:
            self.ctx.cluster.run(dcp_tasks.remove_spare_dirs, dirs)
        self.hints.clear()
        self.pinned.clear()
        self.sound.clear()
        self.read.clear()

    def close(self) -> None:
        """Nothing to release: the spares live on the workers (:meth:`clear` removes them at the run's end)."""
        return None
