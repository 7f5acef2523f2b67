"""FTI's heads: one process per node that raises L1 checkpoints to L2-L4 while the application runs on.

With ``head = 1`` and ``inline_lN = 0``, the application ranks write their L1 files, commit
the checkpoint as L1 and hand it to their node's head (a JSON message). The heads, together,
add the partner copies or parity (or copy to the global directory), then rewrite the commit
record at the target level and remove the L1 files; until then the checkpoint is a valid L1
one. The application waits for the head only at its next checkpoint (as FTI does), or when it
asks (``ctx.wait_post_processing()``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from ...engine.dcpstore import write_spare_hint
from ...engine.recovery import check_file
from ...engine.retention import move_to_spares, to_retire
from ...engine.runstate import CommitRecord, RunState
from ...levels import multilevel
from ...model.config import Config
from ...model.errors import FTIError
from ...storage import files as storage
from ...transport.collective import agree, guarded, on_root, reason
from .head_parity import previous_l3, update_parity
from .stage_heads import StageInbox
from .transport import _TAG_REPLY, MpiTransport, send_json

log = logging.getLogger("ftidask")


def _link_or_copy(src: Path, dst: Path) -> None:
    storage.makedirs(dst.parent)
    tmp = dst.with_name(f".{dst.name}.link")
    try:
        if tmp.exists():
            tmp.unlink()
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        storage.copy_file_atomic(src, dst)


def serve(cfg: Config, t: MpiTransport) -> None:
    """The head's loop: serve post-processing requests until every application rank of the node ends."""
    assert t.node_comm is not None
    napp = t.node_comm.size - 1
    states: dict[str, RunState] = {}  # by exec_id: its commit records parsed once while their files stay the same
    inbox = StageInbox(t.node_comm)  # FTI_SendFile: the head moves the files on the way, between post-processing
    while True:
        requests: list[Any] = []
        while len(requests) < napp:
            requests.append(inbox.next()[0])
        if any(r.get("op") != "post" for r in requests):
            break
        try:
            reply = post_process(cfg, t, requests[0], states)
        except Exception as exc:  # noqa: BLE001 - after the heads' last collective: reported, the head keeps serving
            log.error("head of node %d: post-processing failed", t.node, exc_info=True)
            reply = {"ok": False, "error": f"head of node {t.node}: {reason(exc)}"}
        for app in range(1, napp + 1):
            send_json(t.node_comm, reply, app, _TAG_REPLY)
    t.close()


@dataclasses.dataclass(frozen=True)
class _Job:
    """One post-processing request, checked: the checkpoint, its target level, and where its files go."""

    record: CommitRecord
    level: int
    exec_id: str
    paths: storage.RunPaths

    @classmethod
    def of(cls, cfg: Config, t: MpiTransport, request: Any) -> _Job:
        record = CommitRecord.from_json(request["record"])
        level = int(request["level"])
        if (record is None or level not in (2, 3, 4) or record.level != 1 or record.nranks != len(t.topo.app_world)
                or (level in (2, 3) and t.group is None)):
            raise FTIError(f"malformed post-processing request (checkpoint level {getattr(record, 'level', None)} "
                           f"to {level})")
        exec_id = str(request["exec_id"])
        return cls(record, level, exec_id,
                   storage.RunPaths(Path(cfg.ckpt_dir), Path(cfg.glbl_dir), Path(cfg.meta_dir), exec_id))

    def key(self) -> list[Any]:
        """What every head must have been asked for alike."""
        return [self.record.seq, self.record.ckpt_id, self.level, self.exec_id]


def post_process(cfg: Config, t: MpiTransport, request: Any,
                 states: dict[str, RunState] | None = None) -> dict[str, Any]:
    """Collectively (all heads) raise the L1 checkpoint of ``request`` to its level; every head returns the same
    outcome: ``ok`` once the raised commit record is written (``error`` then names a failure of the clean-up after it).

    A local exception on one head (a malformed request, a full disk, a bug) is agreed on
    (:mod:`ftidask.transport.collective`): every head fails alike, none waits for another in an exchange.
    ``states``: the run states of earlier requests, by exec_id (kept by :func:`serve`: a run that keeps every L4
    checkpoint keeps thousands of commit records, which a new :class:`RunState` would parse again at every request).
    """
    failed: list[str] = []
    job = guarded(failed, lambda: _Job.of(cfg, t, request), None, f"head of node {t.node}")
    try:  # before any exchange: every head has the same checkpoint to raise, or none raises it
        keys = agree(t, "; ".join(failed), FTIError, "post-processing failed", None if job is None else job.key())
        if any(k != keys[0] for k in keys):
            raise FTIError(f"post-processing failed: the heads were asked for different checkpoints: {keys}")
    except FTIError as exc:
        return {"ok": False, "error": str(exc)}
    assert job is not None
    states = {} if states is None else states
    if job.exec_id not in states:
        states.clear()  # a head serves one run: never more than one kept
        states[job.exec_id] = RunState(Path(cfg.meta_dir), job.exec_id)
    return _raise(cfg, t, job, states[job.exec_id])


def _raise(cfg: Config, t: MpiTransport, job: _Job, state: RunState) -> dict[str, Any]:
    """:func:`post_process` of a request that every head accepted, with the run's ``state``."""
    topo, node, record, level, paths = t.topo, t.node, job.record, job.level, job.paths
    sizes = {f.rank: f.size for f in record.files}
    fb = {f.rank: f.fb_hash for f in record.files}
    src_dir = paths.level_dir(1, node) / record.dirname
    dst_dir = paths.level_dir(level, node) / record.dirname
    errors: list[str] = []
    prev = _previous_l3(t, state, record) if level == 3 else None
    for pos in range(topo.app_per_node):
        app = topo.app_rank_at(node, pos)
        name = storage.rank_file(record.ckpt_id, app)
        # A differential L1 file is copied, not linked, so that it can become the rank's spare below.
        place = storage.copy_file_atomic if level == 4 or record.extra.get("dcp") else _link_or_copy
        placed = guarded(errors, functools.partial(place, src_dir / name, dst_dir / name), False, f"node {node}")
        if placed is not False:
            # The L1 file has lived on disk since the rank wrote it: checked as a recovery would before it is raised
            # (a damaged one raised, and the older checkpoints retired, would leave nothing recoverable). As placed:
            # a copy's own errors are caught too. The levels then read it again from the page cache.
            verdict = check_file(dst_dir / name, record, app)
            errors += [] if verdict.kind == "ok" else [f"node {node}: rank {app}'s level-1 file: {verdict.message}"]
        if level == 4:
            continue
        assert t.group is not None  # L2/L3 were validated when the run started
        group = topo.group_ranks(app)
        # The parity's record lists the FB hashes of the files it encodes, as without heads: what lets a
        # differential L3 checkpoint update it instead of encoding it anew (rs_delta).
        done, problem = False, ""
        if prev is not None:  # a differential L3: the previous parity updated where the files did not change
            done, problem = update_parity(cfg, t.group, prev, paths.level_dir(3, node) / prev.dirname, app,
                                          dst_dir / name, dst_dir / storage.parity_file(record.ckpt_id, app),
                                          [sizes[r] for r in group], [fb[r] for r in group])
        if not done:  # the same on every member of the group
            problem = multilevel.protect_in_step(t.group, cfg, level, record.ckpt_id, app, dst_dir / name, dst_dir,
                                                 [sizes[r] for r in group],
                                                 [fb[r] for r in group] if level == 3 else None)
        errors += [f"node {node}: {problem}"] if problem else []
    raised = dataclasses.replace(record, level=level)
    what = f"raising checkpoint {record.ckpt_id} to level {level} failed"
    try:
        agree(t, "; ".join(errors), FTIError, what)
        # the commit point, written by one head (named as such in an error, not "rank 0": an application rank)
        on_root(t, functools.partial(state.write_record, raised), FTIError, what, who=f"head of node {t.node}")
    except FTIError as exc:  # agreed: the same on every head
        storage.remove_tree(dst_dir)
        return {"ok": False, "error": str(exc)}
    if record.extra.get("dcp"):  # the L1 file is now a copy: each rank's next differential checkpoint
        guarded([], lambda: _keep_as_spares(paths, topo, node, record, src_dir))  # patches it instead of writing anew
    guarded([], lambda: storage.remove_tree(src_dir), None, f"removing {src_dir}")
    cleanup = ""
    try:
        _retire_older(cfg, t, state, paths, raised)
    except FTIError as exc:  # agreed (on_root): the same on every head; the raised checkpoint is committed
        cleanup = (f"checkpoint {record.ckpt_id} is raised to level {level} and recoverable, but cleaning up "
                   f"after it failed: {exc}")
    log.info("head of node %d: checkpoint %d raised to level %d", node, record.ckpt_id, level)
    return {"ok": True, "error": cleanup, "level": level, "ckpt_id": record.ckpt_id}


def _previous_l3(t: MpiTransport, state: RunState, record: CommitRecord) -> CommitRecord | None:
    """The committed L3 checkpoint whose parity the heads update for differential ``record`` (collective: the same
    on every head; None when there is none, or the records cannot be read: the parity is then encoded in full)."""
    if not record.extra.get("dcp"):
        return None
    def find() -> dict[str, Any] | None:  # only the one found crosses to the heads, not every record
        prev = previous_l3(state.records(), record)
        return None if prev is None else prev.to_json()

    try:
        raw = on_root(t, find, FTIError, "cannot read the commit records", who=f"head of node {t.node}")
    except FTIError:
        return None
    return None if raw is None else CommitRecord.from_json(raw)


def _keep_as_spares(paths: storage.RunPaths, topo: Any, node: int, record: CommitRecord, src_dir: Path) -> None:
    """Move this node's L1 files of ``record`` (raised to its level by a copy) to their ranks' L1 spares, with the
    hint that lets the rank trust them (:mod:`ftidask.engine.dcpstore`). Best effort: a rank without one writes in
    full. The head pays a copy of the file in the background so that the application writes only what changed."""
    fb = {f.rank: f.fb_hash for f in record.files}
    for pos in range(topo.app_per_node):
        app = topo.app_rank_at(node, pos)
        spare = paths.level_dir(1, node) / storage.SPARE_DIR / storage.spare_file(app)
        try:
            storage.makedirs(spare.parent)
            os.replace(src_dir / storage.rank_file(record.ckpt_id, app), spare)
        except OSError as exc:
            log.debug("head of node %d: no spare for rank %d: %s", node, app, exc)
            continue
        write_spare_hint(spare, fb[app])


def _keep_as_fallback(paths: storage.RunPaths, topo: Any, node: int, old: CommitRecord) -> None:
    """Move this node's files of the retired differential checkpoint ``old`` (L2-L4) to its level's spares, where
    its fallback record points (:func:`~ftidask.engine.retention.rank_path`), as a rank does without heads.

    Best effort, as :meth:`~ftidask.engine.dcpstore.DcpStore.retire`: a file that is gone (a lost node) or cannot
    be moved leaves a spare that fails the fallback's FB hash check, passed over by a recovery.

    The files are those ``old`` records, on the nodes it records: written on another layout (a restart on another
    number of ranks), its ranks are not this run's, and a recovery redistributes the fallback from where its record
    says. Node 0's head also moves those of nodes this run does not have (seen with ``local_test``)."""
    mine = [f for f in old.files if (f.node if f.node < topo.nnodes else 0) == node]
    move_to_spares(paths, old, mine, who=f"head of node {node}: ")


def _retire_older(cfg: Config, t: MpiTransport, state: RunState, paths: storage.RunPaths,
                  record: CommitRecord) -> None:
    """Drop the checkpoints that ``record`` retires (collective over the heads). With differential checkpoints, as
    without heads (:meth:`~ftidask.engine.retention.Retention.remove_checkpoint`): a retired differential
    checkpoint of L2-L4 keeps its files as its level's spares, named its level's fallback first (killed in
    between, its commit record or the fallback names it), which a recovery tries when no newer checkpoint verifies."""
    keep_l4 = bool(cfg.keep_l4_ckpt)  # only those retired cross to the heads (keep_l4_ckpt keeps thousands)
    raw = on_root(t, lambda: [r.to_json() for r in to_retire(state.records(), record, keep_l4)], FTIError,
                  "cannot read the commit records", who=f"head of node {t.node}")
    failed: list[str] = []
    for old in map(CommitRecord.from_json, raw):
        what = f"removing checkpoint {old.ckpt_id} (level {old.level}) failed"
        kept = bool(cfg.enable_dcp) and bool(old.extra.get("dcp")) and old.level in (2, 3, 4)
        if cfg.enable_dcp:
            on_root(t, functools.partial(state.note_retired, old, kept), FTIError, what, who=f"head of node {t.node}")
        if kept:  # local, between collectives: never raises
            guarded([], functools.partial(_keep_as_fallback, paths, t.topo, t.node, old))
        # After every head moved its files (a collective): the global L4 directory goes below.
        on_root(t, functools.partial(state.delete_record, old.seq), FTIError, what, who=f"head of node {t.node}")
        # This node's, and on node 0 those of nodes this run does not have (written on more nodes: local_test).
        nodes = {t.node} | ({f.node for f in old.files if f.node >= t.nnodes} if t.node == 0 else set())
        for level, n in itertools.product({old.level, 1, 2, 3} - {4}, sorted(nodes)):  # local, between collectives:
            guarded(failed, functools.partial(storage.remove_tree, paths.level_dir(level, n) / old.dirname))  # agreed
        if t.rank == 0:
            guarded(failed, functools.partial(storage.remove_tree, paths.level_dir(4, 0) / old.dirname))
    agree(t, "; ".join(failed), FTIError, "removing the checkpoints it retires failed")
