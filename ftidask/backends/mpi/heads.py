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
import logging
import os
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ...engine.dcpstore import write_spare_hint
from ...engine.retention import to_retire
from ...engine.runstate import CommitRecord, RunState
from ...levels import multilevel
from ...model.config import Config
from ...model.errors import FTIError
from ...storage import files as storage
from ...transport.collective import agree, guarded, on_root
from .stage_heads import serve_stage_request
from .transport import _TAG_REPLY, _TAG_REQ, MpiTransport, recv_json, send_json

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
    while True:
        requests: list[Any] = []
        while len(requests) < napp:
            msg, source = recv_json(t.node_comm, MPI.ANY_SOURCE, _TAG_REQ)
            if msg.get("op") == "stage":  # FTI_SendFile: the head moves the file, between post-processing
                serve_stage_request(t.node_comm, msg, source)
                continue
            requests.append(msg)
        if any(r.get("op") != "post" for r in requests):
            break
        req = requests[0]
        try:
            reply = post_process(cfg, t, CommitRecord.from_json(req["record"]), int(req["level"]),
                                 str(req["exec_id"]))
        except Exception as exc:  # noqa: BLE001 - reported to the application, the head keeps serving
            reply = {"ok": False, "error": f"head of node {t.node}: {exc}"}
        for app in range(1, napp + 1):
            send_json(t.node_comm, reply, app, _TAG_REPLY)
    t.close()


def post_process(cfg: Config, t: MpiTransport, record: CommitRecord | None, level: int, exec_id: str
                 ) -> dict[str, Any]:
    """Collectively (all heads) raise an L1 checkpoint to ``level``; every head returns the same outcome: ``ok``
    once the raised commit record is written (``error`` then names a failure of the clean-up after it).

    A local exception on one head is agreed on (:mod:`ftidask.transport.collective`): every head fails alike.
    """
    if record is None:
        return {"ok": False, "error": "malformed request"}
    topo, node = t.topo, t.node
    paths = storage.RunPaths(Path(cfg.ckpt_dir), Path(cfg.glbl_dir), Path(cfg.meta_dir), exec_id)
    sizes = {f.rank: f.size for f in record.files}
    src_dir = paths.level_dir(1, node) / record.dirname
    dst_dir = paths.level_dir(level, node) / record.dirname
    error = ""
    for pos in range(topo.app_per_node):
        app = topo.app_rank_at(node, pos)
        name = storage.rank_file(record.ckpt_id, app)
        # A differential L1 file is copied, not linked, so that it can become the rank's spare below.
        place = storage.copy_file_atomic if level == 4 or record.extra.get("dcp") else _link_or_copy
        failed: list[str] = []
        guarded(failed, functools.partial(place, src_dir / name, dst_dir / name), None, f"node {node}")
        error = error or "; ".join(failed)
        if level == 4:
            continue
        assert t.group is not None  # L2/L3 were validated when the run started
        problem = multilevel.protect(t.group, cfg, level, record.ckpt_id, app, dst_dir / name, dst_dir,
                                     [sizes[r] for r in topo.group_ranks(app)])
        error = error or (f"node {node}: {problem}" if problem else "")
    state = RunState(Path(cfg.meta_dir), exec_id)
    raised = dataclasses.replace(record, level=level)
    what = f"raising checkpoint {record.ckpt_id} to level {level} failed"
    try:
        agree(t, error, FTIError, what)
        on_root(t, functools.partial(state.write_record, raised), FTIError, what)  # the commit point
    except FTIError as exc:  # agreed: the same on every head
        storage.remove_tree(dst_dir)
        return {"ok": False, "error": str(exc)}
    if record.extra.get("dcp"):  # the L1 file is now a copy: each rank's next differential checkpoint
        _keep_as_spares(paths, topo, node, record, src_dir)  # patches it instead of writing anew
    storage.remove_tree(src_dir)
    cleanup = ""
    try:
        _retire_older(cfg, t, state, paths, raised)
    except FTIError as exc:  # agreed (on_root): the same on every head; the raised checkpoint is committed
        cleanup = (f"checkpoint {record.ckpt_id} is raised to level {level} and recoverable, but cleaning up "
                   f"after it failed: {exc}")
    log.info("head of node %d: checkpoint %d raised to level %d", node, record.ckpt_id, level)
    return {"ok": True, "error": cleanup, "level": level, "ckpt_id": record.ckpt_id}


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


def _retire_older(cfg: Config, t: MpiTransport, state: RunState, paths: storage.RunPaths,
                  record: CommitRecord) -> None:
    raw = on_root(t, lambda: [r.to_json() for r in state.records()], FTIError, "cannot read the commit records")
    for old in to_retire(map(CommitRecord.from_json, raw), record, bool(cfg.keep_l4_ckpt)):
        on_root(t, functools.partial(state.delete_record, old.seq), FTIError,
                f"removing checkpoint {old.ckpt_id} (level {old.level}) failed")
        for level in {old.level, 1, 2, 3}:
            storage.remove_tree(paths.level_dir(level, t.node) / old.dirname)
        if t.rank == 0:
            storage.remove_tree(paths.level_dir(4, 0) / old.dirname)
