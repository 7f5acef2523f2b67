"""Recovery on a Dask cluster, first step: a verified file for every rank of a checkpoint, on a worker that
sees it; files lost with their workers rebuilt from the level's L2 copies or L3 parity (each group's
members on the workers that hold its files), missing redundancy rebuilt when every own file is sound."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from ...engine.runstate import CommitRecord
from ...levels.topology import Topology, recorded_topology
from ...model.errors import FTIError, LevelError, RecoveryError
from ...storage import files as storage
from . import group_steps, recorded, redundancy, tasks
from .cluster import WorkerLost
from .fallback import Placer, Unrecoverable, check_files, restore_spares

if TYPE_CHECKING:
    from .context import DaskContext

log = logging.getLogger("ftidask")


class Unreadable(RecoveryError):
    """A checkpoint whose files need a package this cluster lacks: the recovery stops, never goes back past it."""


def restore_files(ctx: DaskContext, record: CommitRecord, data: bool = True,
                  decode: bool = True) -> dict[int, tuple[str, str]]:
    """rank -> (worker, path) of a verified file, for every rank of ``record``; rebuilds lost files (never a
    fallback's: its spares are read as they are). ``data`` False verifies the files' metadata only: the
    reads that follow check the data (see :func:`recover`); ``decode`` False checks the data's hashes but
    decodes no compressed container (the reads do, once)."""
    if record.fallback:
        return restore_spares(ctx, record, data, decode)
    cl = ctx.cluster
    workers = cl.workers()
    if not workers:
        raise RecoveryError("the cluster has no workers")
    n, level, cid, seq = record.nranks, record.level, record.ckpt_id, record.seq
    recorded.layout(record)  # a damaged record: this checkpoint cannot be recovered (before any stat)
    topo = record_topology(record)
    groups = topo.rank_groups()
    own = {r: ctx.node_file(level, cid, seq, r, storage.rank_file(cid, r)) for r in range(n)}
    pcof = {r: ctx.node_file(2, cid, seq, r, storage.partner_file(cid, r)) for r in range(n)} if level == 2 else {}
    rsed = {r: ctx.node_file(3, cid, seq, r, storage.parity_file(cid, r)) for r in range(n)} if level == 3 else {}
    red = redundancy.Redundancy(level, topo, {f.rank: f.size for f in record.files}, pcof if level == 2 else rsed)
    paths = list(own.values()) + red.paths()
    stats = cl.run(tasks.sizes, paths)  # stats only: which worker sees what, and the redundancy's sizes
    placer = Placer(workers, stats, paths)
    tag = f"{cid}-{seq}-{uuid.uuid4().hex[:8]}"
    hosts, verdicts = check_files(ctx, record, own, placer, tag, data, decode)
    unreadable = next((v["message"] for v in verdicts.values() if v.get("unreadable")), None)
    if unreadable is not None:
        raise Unreadable(f"checkpoint {cid} (level {level}) cannot be read: {unreadable}; nothing was recovered, and "
                         "no older checkpoint in its place (the next checkpoint would retire this one)")
    ok = {r for r, v in verdicts.items() if v["ok"]}
    bad = [r for r in range(n) if r not in ok]
    short = red.missing({r: hosts[r] for r in ok}, stats, paths)  # its group rebuilds it, as FTI does
    if not data and level in (2, 3) and (bad or short):  # a rebuild reads the group's files: data checked first
        # (their hashes: a rebuild copies or encodes the stored bytes, it never decodes them; the reads do)
        return restore_files(ctx, record, True, decode=False)
    if not bad:
        if short:
            _rebuild_redundancy(ctx, record, groups, hosts, short, tag, red, paths, decode)
        return {r: (hosts[r], own[r]) for r in range(n)}
    why = "; ".join(verdicts[r]["message"] if r in verdicts else f"rank {r}'s file is on no live worker"
                    for r in bad[:4])
    if level in (1, 4):
        raise Unrecoverable(f"files of rank(s) {bad} are lost or damaged ({why}); level {level} keeps no copy")
    _check_rebuildable(level, topo, bad, ok, placer, pcof, rsed)
    side = pcof if level == 2 else rsed
    for r in bad:  # a stand-in: a worker that sees the rank's partner copy or parity if any, else the least loaded
        hosts[r] = placer.pick(side[r]) or placer.any()
    why: dict[int, list[str]] = {}
    rebuilt = _rebuild(ctx, record, groups, hosts, set(bad), short, tag, decode, why)
    failed = [r for r in bad if not rebuilt.get(r)]
    if failed:
        errors = [e for r in failed for e in why.get(r, [])]  # a full disk, a read error: said, not guessed
        raise Unrecoverable(f"the file(s) of rank(s) {failed} could not be rebuilt from level {level} " + (
            f"({'; '.join(errors)})" if errors else
            "(too many of their group's files are lost or damaged, or the rebuilt file does not verify)"))
    log.info("checkpoint %d: rebuilt the files of rank(s) %s from level %d", cid, bad, level)
    return {r: (hosts[r], own[r]) for r in range(n)}


def record_topology(record: CommitRecord) -> Topology:
    """The groups ``record`` was written with (one group of every worker when it lists none); LevelError when they
    do not hold its workers once each (a forged record: groups naming a worker it has not broke the rebuild of an
    L2/L3 file with a raw KeyError)."""
    topo = recorded_topology(record.extra.get("groups", [list(range(record.nranks))]))
    if sorted(r for g in topo.rank_groups() for r in g) != list(range(record.nranks)):
        raise LevelError(f"groups {record.extra.get('groups')!r} do not hold the {record.nranks} workers once each")
    return topo


def _check_rebuildable(level: int, topo: Topology, bad: list[int], ok: set[int], placer: Placer,
                       pcof: dict[int, str], rsed: dict[int, str]) -> None:
    """Refuse at once (no session started) when the files that survive cannot bring back the lost ones."""
    for group in topo.rank_groups():
        lost = [r for r in group if r in bad]
        if not lost:
            continue
        if level == 2:
            for r in lost:
                holder = topo.right_partner(r)
                if not placer.visible.get(pcof[holder]):
                    raise Unrecoverable(f"rank {r}'s file and its partner copy (on rank {holder}) are both lost")
        else:
            k = len(group)
            available = sum(r in ok for r in group) + sum(bool(placer.visible.get(rsed[r])) for r in group)
            if available < k:
                raise Unrecoverable(f"group {group} lost {len(lost)} of {k} workers: only {available} of its "
                                    f"{2 * k} files remain, {k} are needed")


def _rebuild_redundancy(ctx: DaskContext, record: CommitRecord, groups: list[list[int]], hosts: dict[int, str],
                        short: set[int], tag: str, red: redundancy.Redundancy, paths: list[str],
                        decode: bool = True) -> None:
    """Every own file is sound: rebuild the missing partner copies or parity of ranks ``short``, so that the
    checkpoint survives the next loss. Best effort: the checkpoint is recoverable as it is."""
    what = "partner copies" if record.level == 2 else "parity files"
    try:
        _rebuild(ctx, record, groups, hosts, set(), short, tag, decode)
    except WorkerLost:
        raise  # a worker that serves a file is gone: check again (_restore_retrying)
    except FTIError as exc:
        log.warning("checkpoint %d: the missing %s of rank(s) %s could not be rebuilt (%s); the next level %d "
                    "checkpoint writes them", record.ckpt_id, what, sorted(short), exc, record.level)
        return
    still = red.missing({r: hosts[r] for r in short}, ctx.cluster.run(tasks.sizes, paths), paths)
    if still:  # the level code reports no error of its own: a stat says what it left missing
        log.warning("checkpoint %d: the missing %s of rank(s) %s could not be rebuilt; the next level %d "
                    "checkpoint writes them", record.ckpt_id, what, sorted(still), record.level)
    else:
        log.info("checkpoint %d: rebuilt the missing %s of rank(s) %s", record.ckpt_id, what, sorted(short))


def _rebuild(ctx: DaskContext, record: CommitRecord, groups: list[list[int]], hosts: dict[int, str], bad: set[int],
             short: set[int], tag: str, decode: bool = True,
             why: dict[int, list[str]] | None = None) -> dict[int, bool]:
    """Run the level's rebuild (:func:`ftidask.levels.multilevel.rebuild`) in every group that lost a file
    (``bad``: own files; ``short``: partner copies or parity), each rank on ``hosts[rank]``; rank -> whether
    its file verifies now (``decode`` False: its hashes, its compressed containers left to the reads).
    ``why``: filled with each rank's I/O errors of the rebuild (a full disk, a read error)."""
    cid, seq, level = record.ckpt_id, record.seq, record.level
    fb = {f.rank: f.fb_hash for f in record.files}
    sizes = {f.rank: f.size for f in record.files}
    hit = [g for g in groups if (bad | short) & set(g)]
    tags = group_steps.session_tags(f"rebuild{cid}-{seq}-l{level}", hit)
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for tag_g, group in zip(tags, hit, strict=True):
        for pos, r in enumerate(group):
            left = group[(pos - 1) % len(group)]
            by_worker.setdefault(hosts[r], []).append(group_steps.member(
                "rebuild", tag_g, group, r, hosts, level=level, ckpt_id=cid,
                own=ctx.node_file(level, cid, seq, r, storage.rank_file(cid, r)), ok=r not in bad,
                sizes=[sizes[g] for g in group], fb_hash=fb[r], left_fb_hash=fb[left],
                parity_name=storage.parity_file(cid, r), decode=decode))
    futures = [group_steps.submit_members(ctx.cluster, ctx.config, w, members, (), key=f"ftidask-rebuild-{tag}-{i}")
               for i, (w, members) in enumerate(sorted(by_worker.items()))]
    results = group_steps.wait_step(ctx.cluster, futures, list(by_worker), f"rebuilding checkpoint {cid}", tags)
    if why is not None:
        why.update({int(m["rank"]): [str(e) for e in m.get("errors", [])] for done in results for m in done})
    return {int(m["rank"]): bool(m["ok"]) for done in results for m in done}
