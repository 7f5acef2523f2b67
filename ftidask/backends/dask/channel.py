"""A :class:`~ftidask.levels.channel.GroupChannel` between Dask workers: blocks go worker to worker.

The members of one L2/L3 group each run one task pinned to their own worker, all at once (see
:mod:`ftidask.backends.dask.group_tasks`); their channels exchange the level code's blocks directly over
the workers' comms, as distributed's P2P shuffle does, never through the client, the scheduler or
task results:

* :class:`ChannelPlugin`, registered once per client, adds the comm handler ``ftidask_channel_put``
  (and ``ftidask_channel_abort``) to every worker, on its event loop;
* a sender, in the task's thread, schedules ``worker.rpc(peer).ftidask_channel_put(...)`` on the
  worker's event loop; the receiver's handler stores the block in the session's inbox of the
  destination member and answers only when it is accepted. Messages keep MPI's order: per
  (source, destination) pair, in sequence;
* back-pressure: an inbox accepts from each source the next message it will consume and the one
  after (``AHEAD``), no further; a sender lets its sends of at most ``WINDOW`` operations wait to be
  taken (overlapping the round trips), then waits. So a member holds a few blocks per peer: the
  stripes (``block_size``, ``transfer_size``), never a whole file.

No wait is unbounded: every wait wakes up every ``POLL`` seconds to see whether the session was
aborted (by a failing member, which tells its peers, or by the client, which aborts on every
worker when a task of the step fails or its worker is lost: :func:`abort_sessions`), and every
``LIVENESS_EVERY`` seconds asks the scheduler whether the peers' workers are still there. Then
:class:`ChannelAborted` is raised in the member's thread: the level code stops at once and the
task fails (its outputs are temporary files, removed with the failed checkpoint's directories).

Sessions are keyed by a tag unique to the checkpoint (or recovery) and group.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from distributed import Client, get_worker
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from ...model.errors import FTIError

log = logging.getLogger("ftidask")
NAME = "ftidask-channel"
POLL = 0.25  # seconds between checks of an abort while waiting
LIVENESS_EVERY = 2.0  # seconds between asking the scheduler whether the peers live
IDLE_TIMEOUT = 600.0  # seconds without a message from a live peer before giving up
AHEAD = 1  # messages per source an inbox takes beyond the one it consumes next (the stripes' pipeline)
WINDOW = 2  # operations a member's sends may be ahead of their receivers (overlaps the round trips)


class ChannelAborted(FTIError):
    """The group's session was aborted (a member failed, a peer's worker left, or the client gave up)."""

    echo = True  # the consequence of another failure: the client reports that one first


class Inbox:
    """The messages to one member of one session; the event loop puts, the member's thread takes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.cond = threading.Condition()
        self.items: dict[tuple[int, int], np.ndarray] = {}
        self.expected: collections.Counter[int] = collections.Counter()  # source -> next sequence number
        self.aborted = ""
        self.waiters: list[asyncio.Future[None]] = []  # handlers waiting for room (loop side)

    def _room(self, src: int, seq: int) -> bool:
        # Always the next message to consume from ``src`` (no deadlock), one more for the pipeline.
        return seq <= self.expected[src] + AHEAD

    async def put(self, src: int, seq: int, data: np.ndarray) -> str:
        """Store a message once there is room (back-pressure on the sender); 'OK' or why not."""
        while True:
            with self.cond:
                if self.aborted:
                    return f"aborted: {self.aborted}"
                if self._room(src, seq):
                    self.items[src, seq] = data
                    self.cond.notify_all()
                    return "OK"
                waiter = self.loop.create_future()
                self.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, POLL)
            except asyncio.TimeoutError:
                pass

    def _wake(self) -> None:
        with self.cond:
            waiters, self.waiters = self.waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def take(self, src: int, check: Any) -> np.ndarray:
        """The next message from ``src``; ``check()`` runs every ``POLL`` seconds of waiting (it raises to stop)."""
        with self.cond:
            key = (src, self.expected[src])
            while key not in self.items:
                if self.aborted:
                    raise ChannelAborted(self.aborted)
                self.cond.wait(POLL)
                if key not in self.items and not self.aborted:
                    self.cond.release()  # the check may ask the scheduler: never with the lock held
                    try:
                        check()
                    finally:
                        self.cond.acquire()
            data = self.items.pop(key)
            self.expected[src] += 1
        self.loop.call_soon_threadsafe(self._wake)  # a sender may wait for room
        return data

    def abort(self, why: str) -> None:
        """Abort the inbox with ``why`` (the first reason stays): waiting takers raise, waiting senders are refused."""
        with self.cond:
            self.aborted = self.aborted or why
            self.cond.notify_all()
        self.loop.call_soon_threadsafe(self._wake)


class ChannelExtension:
    """A worker's sessions: inboxes by (tag, member index), and the tags that ended or were aborted."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        self.boxes: dict[tuple[str, int], Inbox] = {}
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # tag -> why (bounded)

    def inbox(self, tag: str, index: int) -> Inbox | None:
        """The inbox of member ``index`` of session ``tag`` (made on the first message); None once it ended."""
        with self.lock:
            if tag in self.ended:
                return None
            box = self.boxes.get((tag, index))
            if box is None:
                box = self.boxes[tag, index] = Inbox(self.worker.loop.asyncio_loop)
            return box

    def why_ended(self, tag: str) -> str:
        """Why session ``tag`` ended on this worker; '' when it has not (or is no longer remembered)."""
        with self.lock:
            return self.ended.get(tag, "")

    def end(self, tag: str, why: str = "the session ended") -> None:
        """Forget session ``tag`` here (its late messages are refused); waiting members raise ``why``."""
        with self.lock:
            self.ended[tag] = why
            while len(self.ended) > 4096:
                self.ended.popitem(last=False)
            boxes = [b for (t, _i), b in self.boxes.items() if t == tag]
            for key in [k for k in self.boxes if k[0] == tag]:
                del self.boxes[key]
        for box in boxes:
            box.abort(why)

    def close_member(self, tag: str, index: int) -> None:
        """Drop member ``index``'s inbox of session ``tag`` (its part is done; the session is not ended)."""
        with self.lock:
            self.boxes.pop((tag, index), None)

    # --- comm handlers (on the worker's event loop) ----------------------------------------------

    async def put(self, tag: str, dst: int, src: int, seq: int, data: Any) -> str:
        """Comm handler ``ftidask_channel_put``: store ``data`` from member ``src`` in member ``dst``'s inbox; 'OK' once
        accepted, else why not."""
        box = self.inbox(tag, dst)
        if box is None:
            return f"aborted: {self.why_ended(tag)}"
        return await box.put(src, seq, np.asarray(data, dtype=np.uint8))

    async def abort(self, tag: str, why: str) -> str:
        """Comm handler ``ftidask_channel_abort``: end session ``tag`` here with ``why``; 'OK'."""
        self.end(tag, why)
        return "OK"


class ChannelPlugin(WorkerPlugin):
    """Installs the channel's comm handlers on every worker (present and future) of a cluster."""

    name = NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        """Install the channel's extension and comm handlers on ``worker`` (:func:`install`)."""
        install(worker)


def install(worker: Any) -> ChannelExtension:
    """The worker's :class:`ChannelExtension`, installed with its handlers if not yet."""
    ext = worker.extensions.get(NAME)
    if ext is None:
        ext = worker.extensions[NAME] = ChannelExtension(worker)
        worker.handlers["ftidask_channel_put"] = ext.put
        worker.handlers["ftidask_channel_abort"] = ext.abort
    return ext


def register(client: Client) -> None:
    """Make every worker of ``client``'s cluster (and every worker that joins later) able to take part."""
    client.register_plugin(ChannelPlugin(), name=NAME)


def abort_sessions(tags: Iterable[str], why: str = "the client aborted the step", dask_worker: Any = None) -> int:
    """``Client.run`` target: abort sessions ``tags`` on this worker (blocked members raise); how many were open."""
    ext = install(dask_worker if dask_worker is not None else get_worker())
    with ext.lock:
        count = len({t for t, _i in ext.boxes if t in set(tags)})
    for tag in tags:
        ext.end(tag, why)
    return count


def busy_members(dask_worker: Any = None) -> int:
    """``Client.run`` target: how many inboxes this worker still holds (0 once every session ended)."""
    ext = install(dask_worker if dask_worker is not None else get_worker())
    with ext.lock:
        return len(ext.boxes)


class WorkerChannel:
    """Member ``index`` of session ``tag``, whose members' workers are ``peers`` (by index)."""

    def __init__(self, tag: str, index: int, peers: Sequence[str], worker: Any = None,
                 idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.tag, self.index, self.peers = tag, index, list(peers)
        self.size = len(self.peers)
        self.worker = worker if worker is not None else get_worker()
        self.ext = install(self.worker)
        box = self.ext.inbox(tag, index)
        if box is None:
            raise ChannelAborted(self.ext.why_ended(tag) or f"session {tag} already ended")
        self.box = box
        self.idle_timeout = idle_timeout
        self.sent_seq: collections.Counter[int] = collections.Counter()
        self._inflight: list[concurrent.futures.Future[Any]] = []  # sends not yet taken by their receivers
        self._window = WINDOW * max(1, self.size - 1)
        self.bytes_sent = 0  # block bytes of exchange() (what crossed to the peers, for reports)
        self._last_progress = time.monotonic()
        self._last_liveness = time.monotonic()

    # --- GroupChannel ------------------------------------------------------------------------------

    def allgather(self, value: Any) -> list[Any]:
        """Every member's JSON-able ``value``, by index (sent to the peers as JSON bytes)."""
        raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
        return [json.loads(b.tobytes()) for b in self._all(raw)]

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        """Every member's ``block`` (as uint8), by index."""
        return self._all(np.ascontiguousarray(block, dtype=np.uint8))

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        """As :meth:`GroupChannel.exchange`; a block of another size than ``recv_nbytes`` raises
        :class:`ChannelAborted`."""
        if send is not None and dest is not None:
            block = np.ascontiguousarray(send, dtype=np.uint8)
            self._send(dest, block)
            self.bytes_sent += block.nbytes
        got = None
        if source is not None:
            got = self._recv(source)
            if got.nbytes != recv_nbytes:
                raise ChannelAborted(f"member {source} sent {got.nbytes} bytes, {recv_nbytes} expected")
        self._drain(self._window)
        return got

    # --- the exchanges -----------------------------------------------------------------------------

    def _all(self, mine: np.ndarray) -> list[np.ndarray]:
        for j in range(self.size):
            if j != self.index:
                self._send(j, mine)
        out = [mine if j == self.index else self._recv(j) for j in range(self.size)]
        self._drain(self._window)
        return out

    def _send(self, dest: int, data: np.ndarray) -> None:
        seq = self.sent_seq[dest]
        self.sent_seq[dest] += 1
        addr = self.peers[dest]
        if addr == self.worker.address:  # a member of the same session on this worker (a recovery's stand-in)
            coro = self.ext.put(self.tag, dest, self.index, seq, data)
        else:
            coro = self.worker.rpc(addr).ftidask_channel_put(tag=self.tag, dst=dest, src=self.index, seq=seq,
                                                             data=to_serialize(data))
        self._inflight.append(asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop))

    def _recv(self, source: int) -> np.ndarray:
        data = self.box.take(source, lambda: self._check(source))
        self._last_progress = time.monotonic()
        return data

    def _drain(self, limit: int) -> None:
        """Wait until at most ``limit`` sends are not yet taken by their receivers (raise if one failed)."""
        while True:
            pending = []
            for fut in self._inflight:
                if not fut.done():
                    pending.append(fut)
                    continue
                try:
                    reply = fut.result()
                except Exception as exc:  # noqa: BLE001 - a peer gone, or its handler failed
                    raise ChannelAborted(f"cannot send to a member of the group: {type(exc).__name__}: {exc}") from exc
                if reply != "OK":
                    raise ChannelAborted(str(reply))
                self._last_progress = time.monotonic()
            self._inflight = pending
            if len(pending) <= limit:
                return
            concurrent.futures.wait(pending, timeout=POLL, return_when=concurrent.futures.FIRST_COMPLETED)
            if all(not f.done() for f in pending):
                self._check(None)

    def _check(self, waiting_for: int | None) -> None:
        """Raise :class:`ChannelAborted` when the session was aborted, a peer's worker left, or nothing
        came for ``IDLE_TIMEOUT`` seconds."""
        if self.box.aborted:
            raise ChannelAborted(self.box.aborted)
        now = time.monotonic()
        if now - self._last_liveness >= LIVENESS_EVERY:
            self._last_liveness = now
            gone = self._gone()
            if gone:
                raise ChannelAborted(f"worker {gone[0]} of the group left the cluster")
        if now - self._last_progress > self.idle_timeout:
            who = f"member {waiting_for}" if waiting_for is not None else "the group"
            raise ChannelAborted(f"nothing from {who} for {self.idle_timeout:.0f} s")

    def _gone(self) -> list[str]:
        """The peers' workers that the scheduler no longer lists as running ([] if it cannot be asked)."""
        async def ask() -> Any:  # all workers (the default; distributed 2025.3 and older take no n_workers)
            return await self.worker.scheduler.identity()

        try:
            info = asyncio.run_coroutine_threadsafe(ask(), self.worker.loop.asyncio_loop).result(30)
            workers = info["workers"]
        except Exception as exc:  # noqa: BLE001 - no answer now: the client's abort or a later check decides
            log.debug("cannot ask the scheduler for the workers: %s", exc)
            return []
        return [p for p in self.peers
                if p not in workers or workers[p].get("status", "running") not in ("running", "paused")]

    # --- session end --------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """End this member's part; after a failure, tell the peers so that none waits for it."""
        self.ext.close_member(self.tag, self.index)
        if error is None:
            return
        why = (str(error) if isinstance(error, ChannelAborted)
               else f"member {self.index} ({self.worker.address}) failed: {type(error).__name__}: {error}")
        self.ext.end(self.tag, why)
        for addr in sorted(set(self.peers) - {self.worker.address}):
            # Fire and forget: a dead peer must not hold up this member's end.
            asyncio.run_coroutine_threadsafe(_tell_abort(self.worker, addr, self.tag, why),
                                             self.worker.loop.asyncio_loop)

    def __enter__(self) -> WorkerChannel:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            try:
                self._drain(0)  # every block taken: the step is complete for this member
            except ChannelAborted as error:
                self.close(error)
                raise
        self.close(exc)


async def _tell_abort(worker: Any, addr: str, tag: str, why: str) -> None:
    try:
        await asyncio.wait_for(worker.rpc(addr).ftidask_channel_abort(tag=tag, why=why), 30)
    except Exception as exc:  # noqa: BLE001 - the peer is gone or busy: the client aborts it too
        log.debug("cannot tell %s that session %s failed: %s", addr, tag, exc)
