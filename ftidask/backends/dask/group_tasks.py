"""The L2/L3 steps of the Dask backend: one task per worker runs the shared level code over a
:class:`~ftidask.backends.dask.channel.WorkerChannel`.

The level code (:mod:`ftidask.levels.multilevel`, :mod:`~ftidask.levels.partner_delta`,
:mod:`~ftidask.levels.rs_delta`) is the one the MPI backend runs; here each member of a group is a
worker, and its blocks go straight to the other members' workers. A worker runs all its members of a
step in one task (:func:`run_members`): at a checkpoint that is one member (a worker is one rank),
but at a recovery on fewer workers a worker may stand in for a lost rank too, of the same group or of
another one. Its members then run in threads of that task, all at once: with ``nthreads = 1`` two
tasks on one worker would run one after the other, and a member waiting for its peers would keep its
worker's other member, and so the whole step, from running.

A member that fails raises (after telling its peers, see the channel); the client turns that into
one error and aborts the step's sessions on every worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distributed import get_worker, rejoin, secede

from ...dcp.delta import FileDelta, XorDelta, file_fb_hash
from ...ftiff import hashing
from ...levels import multilevel, partner_delta, rs, rs_delta
from ...model.config import Config
from ...model.errors import FTIError
from ...storage import files as storage
from ...transport.collective import guarded
from . import dcp_tasks, fence, tasks
from .channel import WorkerChannel

log = logging.getLogger("ftidask")


class LevelFailed(FTIError):
    """A member's part of an L2/L3 step failed (the level's own error message)."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # still takes part: the peers' loops need every member


def _verify(path: Path, fb_hash: str, decode: bool = True) -> bool:
    # Between the group's collectives: never raises.
    return bool(guarded([], lambda: tasks.check_file(str(path), fb_hash, decode=decode)["ok"], False,
                        f"checking {path}"))


def protect(ch: WorkerChannel, m: dict[str, Any], cfg: Config, dep: Any) -> dict[str, Any]:
    """Full checkpoint: L2 partner copy or L3 parity of this member's file (sizes and FB hashes gathered)."""
    own, level = Path(m["own"]), int(m["level"])
    errors: list[str] = []
    fb_hash = guarded(errors, lambda: file_fb_hash(own), "") if level == 3 else ""
    fb_hashes = ch.allgather(fb_hash) if level == 3 else None
    sizes = ch.allgather(_size(own))
    error = multilevel.protect(ch, cfg, level, int(m["ckpt_id"]), int(m["rank"]), own, own.parent, sizes, fb_hashes)
    if not (error or errors):  # the rank file was renamed unsynced (tasks.write_rank): durable before the record
        guarded(errors, lambda: storage.make_durable(own), None, f"cannot make {own} durable")
    if error or errors:
        raise LevelFailed("; ".join([*errors, error] if error else errors))
    return {"rank": m["rank"]}


def _adopt_old_parity(parity: Path, max_fs: int, hash_id: int) -> None:
    """A parity written before the Dask backend kept its ``.hash`` record: record it as it is.

    :func:`ftidask.levels.rs.rebuild` trusts only a parity that matches its record; such a parity was
    never checked by anything, as before, and a file rebuilt from it is verified against the commit
    record's FB hash all the same.
    """
    if rs.hash_path(parity).exists() or not parity.is_file() or parity.stat().st_size != max_fs:
        return
    hasher = hashing.new_hasher(hash_id)
    with storage.open_read(parity) as fh:
        while block := fh.read(16 << 20):
            hasher.update(block)
    errors: list[str] = []
    rs.write_record(parity, hash_id, hasher.hexdigest(), max_fs, errors)
    if not errors:
        log.info("%s: parity of an older checkpoint without its hash record; recorded as it is", parity)


def rebuild(ch: WorkerChannel, m: dict[str, Any], cfg: Config, dep: Any) -> dict[str, Any]:
    """Recovery: rebuild what the group lost (own files, partner copies, parity); whether own verifies
    (``m["decode"]`` False: its hashes; the recovery's reads decode its compressed containers, once)."""
    own, level, decode = Path(m["own"]), int(m["level"]), bool(m.get("decode", True))
    sizes = [int(s) for s in m["sizes"]]
    if level == 3:
        guarded([], lambda: _adopt_old_parity(own.parent / m["parity_name"], max(sizes), hashing.hash_id(cfg.hash)))
    errors: list[str] = []
    ok = multilevel.rebuild(ch, cfg, level, int(m["ckpt_id"]), int(m["rank"]), own, own.parent, sizes, bool(m["ok"]),
                            verify_own=lambda p: _verify(p, m["fb_hash"], decode),
                            verify_partner=lambda p: _verify(p, m["left_fb_hash"], decode), errors=errors)
    return {"rank": m["rank"], "ok": bool(ok), "errors": errors}  # errors: why it could not (a full disk...)


def protect_delta(ch: WorkerChannel, m: dict[str, Any], cfg: Config, dep: Any) -> dict[str, Any]:
    """Differential L2: the partner gets only the changed ranges when it holds the base.

    ``dep``: the write's result (its ``delta``)."""
    own, rank = Path(m["own"]), int(m["rank"])
    delta = FileDelta.from_json(dep["delta"]) if dep.get("delta") is not None else None
    with _claimed(partner_delta.spare_partner_path(own.parent, rank), own, take=m.get("claim", True)) as spare:
        error = partner_delta.protect(ch, own, own.parent / m["pcof_name"], spare, _size(own), delta,
                                      cfg.transfer_size << 20)
    if error:
        raise LevelFailed(error)
    return {"rank": rank, "sent": ch.bytes_sent}


def parity_delta(ch: WorkerChannel, m: dict[str, Any], cfg: Config, dep: Any) -> dict[str, Any]:
    """Differential L3: patch the spare parity from the group's XOR deltas, else encode in full
    (``dep``: the write's ``(result, XorDelta or None)``, made on this worker; its scratch file closed here)."""
    own, rank = Path(m["own"]), int(m["rank"])
    _result, xor = dep
    if xor is not None and not isinstance(xor, XorDelta):
        raise LevelFailed(f"rank {rank}: the write's delta is a {type(xor).__name__}, not an XorDelta")
    errors: list[str] = []
    own_hash = guarded(errors, lambda: file_fb_hash(own), "")
    try:
        with _claimed(rs_delta.spare_parity_path(own.parent, rank), own, record=True,
                      take=m.get("claim", True)) as spare:
            why = rs_delta.update(ch, xor, own_hash, spare, own.parent / m["parity_name"], ch.allgather(_size(own)),
                                  hashing.hash_id(cfg.hash))
    finally:  # patched or not: its scratch file goes now, not when Dask releases the write's result
        if xor is not None:
            xor.close()
    if why is None:
        if errors:
            raise LevelFailed("; ".join(errors))
        return {"rank": rank, "updated": True}
    return protect(ch, m | {"level": 3}, cfg, dep) | {"updated": False, "why": why}


@contextlib.contextmanager
def _claimed(spare: Path, own: Path, record: bool = False, take: bool = True) -> Iterator[Path]:
    """The spare partner copy or parity (with its ``record``), claimed into ``own``'s directory (see
    :func:`ftidask.backends.dask.fence.claim`): what the level code patches. Removed after, unless it was renamed
    into the checkpoint (the whole file was sent or encoded instead, or the step failed).

    ``take`` False (the spares are the checkpoint a recovery fell back to, every file of the step is written in
    full: nothing is patched): the spare stays where it is, untouched, and the level code gets a path where there
    is none (it sends the whole file, or encodes the parity anew)."""
    work = dcp_tasks.claimed(spare, own)
    if take:
        fence.claim([(spare, work)] + ([(rs.hash_path(spare), rs.hash_path(work))] if record else []))
    try:
        yield work
    finally:
        for path in [work] + ([rs.hash_path(work)] if record else []):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


STEPS = {"protect": protect, "rebuild": rebuild, "protect_delta": protect_delta, "parity_delta": parity_delta}


def _run_one(m: dict[str, Any], cfg: Config, deps: tuple[Any, ...], worker: Any,
             owner: tuple[str, str] | None) -> dict[str, Any]:
    dep = deps[m["dep"]] if m.get("dep") is not None else None
    with fence.acting(owner), WorkerChannel(m["tag"], int(m["index"]), m["peers"], worker) as ch:
        return STEPS[m["step"]](ch, m, cfg, dep)


def run_members(members: list[dict[str, Any]], cfg: Config, *deps: Any) -> list[dict[str, Any]]:
    """Run this worker's members of an L2/L3 step, all at once; their results, in order.

    Each member: ``step`` (a key of :data:`STEPS`), ``tag``, ``index``, ``peers`` (its session),
    ``dep`` (index into ``deps``: the result of a task it needs, or None) and the step's values.
    """
    worker, owner = get_worker(), fence.owner()  # in the task's thread: the member threads below are not Dask's
    # Out of the worker's task slots while the members wait for their peers: two runs checkpointing on one cluster
    # (or any pinned task that waits for others) deadlocked on workers of one thread, each holding one run's member
    # while its peers queued behind the other run's members on the other workers.
    secede()
    try:
        if len(members) == 1:
            return [_run_one(members[0], cfg, deps, worker, owner)]
        with ThreadPoolExecutor(len(members), thread_name_prefix="ftidask-member") as pool:
            futures = [pool.submit(_run_one, m, cfg, deps, worker, owner) for m in members]
        return [f.result() for f in futures]  # the first failure raised, once every member ended
    finally:
        rejoin()
