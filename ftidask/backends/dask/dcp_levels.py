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
  partner copy, else the whole file (the holder reports what it has first, in the same graph);
* L3 (7) re-encodes the group's parity from the new files.

The commit record, written last by the engine, is the commit point, as for every checkpoint.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distributed import Future

from ...engine.runstate import CommitRecord
from ...ftiff import blockhash
from ...levels import rs
from ...levels.ring_groups import copy_holder, copy_source, group_of, make_groups
from ...model.errors import FTIError
from ...storage import files as storage
from . import dcp_tasks, tasks
from .plan import VarSpec, layout_to_json, plan_ranks

log = logging.getLogger("ftidask")


def spare_path(ctx: Any, level: int, rank: int) -> str:
    return str(ctx.paths.level_dir(level, rank) / storage.SPARE_DIR / storage.spare_file(rank))


def spare_parity_path(ctx: Any, rank: int) -> str:
    return str(ctx.paths.level_dir(3, rank) / storage.SPARE_DIR / storage.spare_file(rank, "RSed"))


def spare_pcof_path(ctx: Any, rank: int) -> str:
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
    out = dict(owner)
    moved = moved_bytes = 0
    for vid, rows in (prev.extra.get("chunks") or {}).items():
        for index, rank, _dptr, nbytes in rows:
            key = (int(vid), tuple(index))
            if key in out and 0 <= rank < len(workers) and out[key] != rank:
                out[key] = rank
                moved, moved_bytes = moved + 1, moved_bytes + int(nbytes)
    if moved:
        log.debug("differential checkpoint: %d chunks (%d bytes) move to the worker that wrote them last time",
                 moved, moved_bytes)
    return out


def run_dcp_levels(ctx: Any, ckpt_id: int, level: int, seq: int, specs: list[VarSpec], futures: dict,
                   owner: dict, workers: list[str]) -> tuple[list, list[dict[str, Any]], list[list[int]]]:
    """Write differential checkpoint ``ckpt_id`` at ``level`` (1-4) on every worker, with its redundancy."""
    n = len(workers)
    ctx._dcp.nranks = max(ctx._dcp.nranks, n)
    plans = plan_ranks(specs, owner, n)
    groups = make_groups(n, ctx.config.group_size)
    fs = [p.layout.fs for p in plans]
    tag = f"{ckpt_id}-{seq}"
    bid = blockhash.block_hash_id(ctx.config.dcp_mode)
    spares = ctx._dcp.hints

    def own(r: int) -> str:
        return ctx._file(level, ckpt_id, seq, r, storage.rank_file(ckpt_id, r))

    writes = []
    for plan in plans:
        r = plan.rank
        meta = {"format": "ftidask", "exec_id": ctx.exec_id, "ckpt_id": ckpt_id, "level": level, "seq": seq,
                "rank": r, "nranks": n, "node": r, "backend": "dask", "worker": workers[r], "time": time.time()}
        partner = fs[copy_source(groups, r)] if level == 2 else fs[r]
        writes.append(ctx.cluster.submit(
            dcp_tasks.write_rank_dcp, spare_path(ctx, level, r), own(r), spares.pop((level, r), None),
            layout_to_json(plan.layout), [i.to_json() for i in plan.infos], meta, ctx.config.hash,
            ctx.config.dcp_block_size, bid, partner, max(fs[g] for g in group_of(groups, r)),
            [[c.var_id, c.dptr] for c in plan.chunks], *(futures[c.var_id, c.index] for c in plan.chunks),
            with_xor=level == 3, key=f"ftidask-dcp-write-{tag}-{r}", worker=workers[r]))
    payloads: list[Future] = []
    if level == 3:  # (result, XOR bytes): the client takes the result, the bytes stay on the workers
        payloads = [ctx.cluster.submit(operator.getitem, w, 1, key=f"ftidask-dcp-xor-{tag}-{r}", worker=workers[r])
                    for r, w in enumerate(writes)]
        writes = [ctx.cluster.submit(operator.getitem, w, 0, key=f"ftidask-dcp-result-{tag}-{r}", worker=workers[r])
                  for r, w in enumerate(writes)]
    finals: list[Future] = []
    if level == 2:
        for r in range(n):
            holder = copy_holder(groups, r)
            has = ctx.cluster.submit(dcp_tasks.spare_fb_hash, spare_pcof_path(ctx, holder),
                                     key=f"ftidask-dcp-partner-has-{tag}-{holder}", worker=workers[holder])
            sent = ctx.cluster.submit(dcp_tasks.partner_payload, own(r), writes[r], has,
                                      key=f"ftidask-dcp-partner-send-{tag}-{r}", worker=workers[r])
            finals.append(ctx.cluster.submit(
                dcp_tasks.partner_apply, ctx._file(2, ckpt_id, seq, holder, storage.partner_file(ckpt_id, holder)),
                spare_pcof_path(ctx, holder), sent, key=f"ftidask-dcp-partner-store-{tag}-{holder}",
                worker=workers[holder]))
    elif level == 3:
        finals = _parity(ctx, ckpt_id, seq, tag, groups, workers, writes, payloads, own)
    results = ctx.cluster.wait_all(writes + finals, workers, f"differential checkpoint {ckpt_id}", ranks=workers)
    written = results[:n]
    if level == 2:  # what crossed to the partners: deltas, or whole files when a partner had no base
        for w, stored in zip(written, results[n:], strict=True):
            w["partner_bytes"] = stored.get("sent", stored["size"])
    return plans, written, groups


def _parity(ctx: Any, ckpt_id: int, seq: int, tag: str, groups: list[list[int]], workers: list[str],
            writes: list[Future], payloads: list[Future], own: Any) -> list[Future]:
    """L3 of a differential checkpoint: per group, update every member's spare parity from the
    members' XOR deltas when every spare encodes the deltas' base files (see
    :mod:`ftidask.levels.rs_delta`), else encode the parity from the new files."""
    n = len(workers)
    has = [ctx.cluster.submit(dcp_tasks.parity_record, spare_parity_path(ctx, r),
                              key=f"ftidask-dcp-parity-has-{tag}-{r}", worker=workers[r]) for r in range(n)]
    done = ctx.cluster.wait_all(writes + has, workers, f"differential checkpoint {ckpt_id}", ranks=workers)
    results, records = done[:n], done[n:]
    finals = []
    for group in groups:
        bases = [results[r]["xor"]["base"] if results[r].get("xor") else None for r in group]
        max_fs = max(results[r]["size"] for r in group)
        new_hashes = [results[r]["fb_hash"] for r in group]
        update = all(bases) and all(records[r] is not None and records[r]["fb_hashes"] == bases for r in group)
        if not update:
            log.info("L3: group %s re-encodes its parity in full (a spare parity does not encode the bases)", group)
            sent = [ctx.cluster.submit(tasks.read_bytes, own(r), writes[r], key=f"ftidask-parity-send-{tag}-{r}",
                                       worker=workers[r]) for r in group]
        for pos, r in enumerate(group):
            parity = ctx._file(3, ckpt_id, seq, r, storage.parity_file(ckpt_id, r))
            if update:
                finals.append(ctx.cluster.submit(
                    dcp_tasks.parity_apply, spare_parity_path(ctx, r), parity, pos,
                    [results[i]["xor"]["ranges"] for i in group], max_fs, ctx.config.hash, new_hashes,
                    *(payloads[i] for i in group), key=f"ftidask-dcp-parity-apply-{tag}-{r}", worker=workers[r]))
            else:
                finals.append(ctx.cluster.submit(
                    tasks.encode_parity, parity, pos, sent, ctx.config.hash, new_hashes,
                    key=f"ftidask-parity-encode-{tag}-{r}", worker=workers[r]))
    return finals


class DaskSpares:
    """The client's knowledge of the workers' spares: (level, rank) -> the spare's FB hash (hex)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.hints: dict[tuple[int, int], str] = {}
        self.nranks = 0  # the most workers a differential checkpoint of this run had

    def keep(self, record: CommitRecord) -> None:
        """Before retired differential checkpoint ``record`` is removed, rename each rank's file (and,
        at L2, each partner copy) to its spare name, on the worker that sees it; note their FB hashes."""
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
            move(workers[f.rank], ctx._file(record.level, record.ckpt_id, record.seq, f.rank,
                                            storage.rank_file(record.ckpt_id, f.rank)),
                 spare_path(ctx, record.level, f.rank), (record.level, f.rank, f.fb_hash))
            if record.level == 3:  # its parity and record, for the next parity update
                parity = ctx._file(3, record.ckpt_id, record.seq, f.rank, storage.parity_file(record.ckpt_id, f.rank))
                spare = spare_parity_path(ctx, f.rank)
                move(workers[f.rank], parity, spare, (0, f.rank, ""))
                move(workers[f.rank], str(rs.hash_path(Path(parity))), str(rs.hash_path(Path(spare))), (0, f.rank, ""))
            if record.level == 2 and groups:
                holder = copy_holder(groups, f.rank)
                if holder < len(workers) and workers[holder] in live:
                    move(workers[holder], ctx._file(2, record.ckpt_id, record.seq, holder,
                                                    storage.partner_file(record.ckpt_id, holder)),
                         spare_pcof_path(ctx, holder), (0, holder, ""))  # the holder reports its hash itself
        futures = {w: ctx.cluster.submit(dcp_tasks.keep_as_spares, m, key=f"ftidask-dcp-keep-{record.seq}-{i}",
                                         worker=w) for i, (w, m) in enumerate(sorted(moves.items()))}
        try:
            done = ctx.cluster.wait_all(list(futures.values()), list(futures), "keeping spares")
        except FTIError:  # no spare only means that the next differential checkpoint writes in full
            return
        for w, ok in zip(futures, done, strict=True):
            for (lv, rank, fb_hash), moved in zip(kept[w], ok, strict=True):
                if moved and lv > 0:
                    self.hints[lv, rank] = fb_hash

    def discard(self) -> None:
        """A checkpoint failed: the spares it was patching are unknown now."""
        self.hints.clear()

    def clear(self) -> None:
        """The run is over: remove every spare directory on every worker."""
        dirs = [str(self.ctx.paths.level_dir(level, r) / storage.SPARE_DIR) for level in (1, 2, 3, 4)
                for r in range(self.nranks)]
        if dirs:
            self.ctx.cluster.run(dcp_tasks.remove_spare_dirs, dirs)
        self.hints.clear()

    def close(self) -> None:
        return None
