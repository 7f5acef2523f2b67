"""Asynchronous checkpoints of one context: snapshot at the call, the rest on a background thread.

``checkpoint(id, level, wait=False)`` encodes the Python states and takes a snapshot of every
protected variable (:mod:`ftidask.engine.snapshot`), then queues the checkpoint on the context's
background thread (:mod:`ftidask.engine.inflight`) and returns its handle. The background thread
runs the same protocol as a blocking checkpoint (:meth:`Committer.checkpoint`: plan, write, the
level's redundancy, commit record last, retire), on a committer of its own that reads the
snapshot, over the transport's *background* channel: a duplicate of the ranks' communicator, so that
its collectives never mix with the application's or the context's (MPI needs
``MPI_THREAD_MULTIPLE`` for it; a transport that cannot give one makes every checkpoint blocking).

While a checkpoint is in flight the context makes no collective call on its own transport that the
background could race with: recovery, iCP, a blocking checkpoint and finalize wait for the
checkpoints in flight first (:meth:`AsyncCheckpoints.settle`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..model.arrays import ArrayBytes
from ..model.level import Level
from ..transport.base import Transport
from ..transport.collective import reason
from . import memavail, snapshot
from .checkpointing import CheckpointInfo
from .commit import Committer
from .device import holders
from .inflight import CheckpointHandle, Inflight
from .recovering import Progress
from .retention import Retention
from .run import Run
from .variables import Protected, encode_states
from .writing import Writer

log = logging.getLogger("ftidask")


def _default_buffer_limit() -> int:
    """Half the memory this process can take now (:mod:`.memavail`), or 1 GiB when it cannot be read."""
    return (memavail.available_bytes() or 2 << 30) // 2


class AsyncCheckpoints:
    """The context's asynchronous checkpoints: the snapshot, the background committer, the handles."""

    def __init__(self, run: Run, progress: Progress, make_retention: Callable[[Run], Retention],
                 hash_id: int) -> None:
        self.run, self.progress, self.make_retention, self.hash_id = run, progress, make_retention, hash_id
        config = run.config
        self.inflight = Inflight(config.max_inflight)
        self.pool = snapshot.CopyPool((config.async_buffer_mb << 20) or _default_buffer_limit())
        self._committer: Committer | None = None
        self._transport: Transport | None = None
        self._unavailable = ""  # why the transport has no background channel ('' : not asked yet / has one)
        self.next_id = 0  # the id after the last one submitted (snapshot's next id while some are in flight)

    def background_committer(self) -> Committer | None:
        """The committer of the background thread, made at the first asynchronous checkpoint (collective:
        every rank makes its background channel then), or None when the transport has none."""
        if self._committer is None and not self._unavailable:
            transport = self.run.transport.background()
            if transport is None:
                self._unavailable = self.run.transport.no_background()
                log.warning("asynchronous checkpoints are written before the call returns: %s", self._unavailable)
                return None
            self._transport = transport
            bg_run = dataclasses.replace(self.run, transport=transport)
            writer = Writer(self.run.config, transport, self.run.paths, {}, self.hash_id)
            self._committer = Committer(bg_run, {}, self.progress, writer, self.make_retention(bg_run))
        return self._committer

    def encode_at_call(self, variables: dict[int, Protected], level: Level, rank: int) -> tuple[dict[int, Any], str]:
        """The values of the call that are not in host memory yet: each CuPy array copied in device memory where
        it fits (the application then waits for that copy only; not for a differential checkpoint, whose page
        tracking must see the mirror written at the call), the others brought into their mirrors (after the
        checkpoints in flight, which may still write one from a device copy), the Python states encoded.
        Returns the device copies by id and why a value could not be taken ('')."""
        copies: dict[int, Any] = {}
        if self.background_committer() is None:  # written before the call returns: it takes the values itself
            return copies, ""
        devices = holders(variables)
        if not level.differential and self.run.config.async_snapshot != "blocking":
            copies = {vid: c for vid, d in devices.items() if (c := d.device_copy()) is not None}
        # An empty array has no bytes for a job in flight to write into its mirror: it makes nothing wait
        if any(vid not in copies and d.mirror.nbytes for vid, d in devices.items()) and self.inflight.busy:
            self.drain()
        return copies, encode_states(variables, rank, bool(self.run.config.enable_dcp), skip=copies)

    def submit(self, ckpt_id: int, level: Level, variables: dict[int, Protected], state_error: str,
               blocking: Callable[[], CheckpointInfo], device_copies: dict[int, Any] | None = None) -> CheckpointHandle:
        """Snapshot ``variables`` (states already encoded, ``device_copies`` taken: :meth:`encode_at_call`) and
        queue checkpoint ``ckpt_id``; its handle. ``blocking`` writes it as a blocking checkpoint, when no
        background channel exists."""
        self.inflight.make_room()
        committer = self.background_committer()
        if committer is None:
            return self.inflight.done_now(ckpt_id, level.number, "blocking", blocking)
        config = self.run.config
        tracking = None
        snap: snapshot.Snapshot | None = None
        job: Callable[[], CheckpointInfo] | None = None
        try:
            if level.differential and not self.inflight.busy:
                # The pages written since the last checkpoint are those of the live arrays: scanned now,
                # the background hashes only their blocks in the snapshot.
                tracking = self.run.spares.get().tracking
                for vid, p in variables.items():
                    if p.state is None:
                        tracking.prescan(vid, ArrayBytes(p.array).view(0, p.array.nbytes))
            cow_ok = not level.differential and not (level.base == 4 and config.l4_format == "zarr")
            snap = snapshot.take(variables, config.async_snapshot, self.pool, cow_ok=cow_ok,
                                 device_copies=device_copies)
            log.debug("checkpoint %d: %s snapshot (%d bytes copied)", ckpt_id, snap.mechanism, snap.extra_bytes)
            self.next_id = max(self.next_id, ckpt_id + 1)
            job = self._job(ckpt_id, level, snap, tracking, state_error, committer)
            handle = self.inflight.submit(job, ckpt_id, level.number, snap.mechanism)
        except BaseException as exc:
            if job is not None and self.inflight.holds(job):
                raise  # queued after all (interrupted while its thread started): the job releases what it holds
            # Failed or interrupted (Ctrl-C) before the job was queued: a scan kept would be taken by the next
            # checkpoint for its own, missing what is written meanwhile; a copy-on-write snapshot kept (by the
            # traceback a notebook holds) would keep the arrays write-protected and their pages copied aside.
            if tracking is not None:
                tracking.forget_prescans()
            if snap is not None:
                snap.release()
            t = self.run.transport
            if not isinstance(exc, Exception) or t.size == 1:
                raise
            # The other ranks' jobs wait in this checkpoint's collectives: one that fails it on every rank (the
            # handle raises the same CheckpointError everywhere; the previous checkpoint stays)
            log.error("checkpoint %d: the snapshot failed on rank %d", ckpt_id, t.rank, exc_info=True)
            return self.inflight.submit(self._failing_job(ckpt_id, level, f"rank {t.rank}: the snapshot failed: "
                                                          f"{reason(exc)}", committer), ckpt_id, level.number, "copy")
        if snap.mechanism == "blocking":
            handle.settled()  # written before returning; a failure stays the handle's (and the next call's)
        return handle

    @staticmethod
    def _job(ckpt_id: int, level: Level, snap: snapshot.Snapshot, tracking: Any, state_error: str,
             committer: Committer) -> Callable[[], CheckpointInfo]:
        """The job that writes checkpoint ``ckpt_id`` from ``snap`` (released by the job, however it ends)."""

        def job() -> CheckpointInfo:
            try:
                committer.variables = snap.variables
                committer.writer.variables = snap.variables
                committer.writer.sources = snap.sources
                return committer.checkpoint(ckpt_id, level, snap.sources, state_error=state_error)
            finally:
                if tracking is not None:
                    tracking.forget_prescans()  # those not used: the checkpoint failed before hashing them
                committer.writer.sources = {}
                committer.variables = committer.writer.variables = {}
                snap.release()

        return job

    @staticmethod
    def _failing_job(ckpt_id: int, level: Level, why: str, committer: Committer) -> Callable[[], CheckpointInfo]:
        """The job of checkpoint ``ckpt_id`` whose snapshot failed on this rank: it meets the other ranks' jobs
        and fails with them (no variable written: ``why`` is the error their commit agrees on)."""

        def job() -> CheckpointInfo:
            committer.variables = committer.writer.variables = {}
            return committer.checkpoint(ckpt_id, level, None, state_error=why)

        return job

    def settle(self) -> None:
        """Wait for every checkpoint in flight; raise the first failure nobody asked for."""
        self.inflight.settle()

    def drain(self) -> None:
        """Wait for every checkpoint in flight (their failures stay for their handles)."""
        self.inflight.drain()

    def quiesce(self) -> None:
        """Wait for every checkpoint in flight, then for the head's post-processing of the last one (heads move its
        files and rewrite its record): before anything reads the run's checkpoints (a recovery's search)."""
        self.inflight.drain()
        self.run.transport.wait_post()

    def close(self) -> None:
        """Finish what is in flight, stop the thread, close the background channel and committer."""
        self.inflight.close()
        if self._committer is not None:
            self._committer.writer.close()
            self._committer.retention.close()
        if self._transport is not None and self._transport is not self.run.transport:
            self._transport.close()
        self._committer, self._transport = None, None
        self.pool.clear()
