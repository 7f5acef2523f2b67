"""The MPI backend: ranks of an mpi4py communicator, FTI's topology, L2/L3 over sub-communicators.

The user's communicator is duplicated (so that our messages never mix with the application's)
and split as FTI does: with ``head = 1`` one process per node leaves the application's
communicator (``ctx.comm``, FTI_COMM_WORLD's role) and serves post-processing requests
(:mod:`ftidask.backends.mpi.heads`). Small values travel as JSON (never pickle); file blocks as
raw bytes.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import json
import logging
import signal
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ...engine.grouplevels import GroupLevels
from ...engine.runstate import CommitRecord
from ...levels.topology import Topology, host_topology, hosts_by_node, local_topology, validate_levels
from ...model.config import JOB_WIDE_KEYS, Config
from ...model.errors import ConfigError, FTIError
from . import reorder

log = logging.getLogger("ftidask")
_TAG_REQ, _TAG_REPLY = 1, 2
_heads_ended: int | None = None  # an MPI attribute key: set on a communicator whose heads were told to end


def _ended_key() -> int:
    global _heads_ended
    if _heads_ended is None:
        _heads_ended = MPI.Comm.Create_keyval()
    return _heads_ended


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, (tuple, set)):
        return list(value)
    raise TypeError(f"cannot send {type(value).__name__} between ranks")


def encode_json(value: Any) -> np.ndarray:
    """``value`` as JSON bytes in a uint8 array, ready for a buffer send."""
    return np.frombuffer(json.dumps(value, default=_json_default).encode(), dtype=np.uint8)


def allgather_json(comm: MPI.Comm, value: Any) -> list[Any]:
    """``comm.allgather`` with JSON instead of pickle."""
    data = encode_json(value)
    counts = np.empty(comm.size, dtype=np.int64)
    comm.Allgather(np.array([data.size], dtype=np.int64), counts)
    buf = np.empty(int(counts.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    comm.Allgatherv(data, [buf, counts.tolist(), displs.tolist(), MPI.BYTE])
    return [json.loads(buf[d:d + c].tobytes()) for d, c in zip(displs.tolist(), counts.tolist(), strict=True)]


def send_json(comm: MPI.Comm, value: Any, dest: int, tag: int) -> None:
    """Send ``value`` as JSON to rank ``dest`` (a buffer send: never pickled)."""
    comm.Send([encode_json(value), MPI.BYTE], dest=dest, tag=tag)


def recv_json(comm: MPI.Comm, source: int, tag: int) -> tuple[Any, int]:
    """Receive a JSON value sent by :func:`send_json` (``source`` may be ``MPI.ANY_SOURCE``); the value and its
    sender."""
    status = MPI.Status()
    comm.Probe(source=source, tag=tag, status=status)
    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=tag)
    return json.loads(buf.tobytes()), status.Get_source()


class MpiGroup:
    """A :class:`~ftidask.levels.channel.GroupChannel` over an MPI sub-communicator (rank = index in group)."""

    def __init__(self, comm: MPI.Comm, tag: int) -> None:
        self.comm, self.tag = comm, tag
        self.index, self.size = comm.rank, comm.size

    def allgather(self, value: Any) -> list[Any]:
        """Every member's JSON-able ``value``, by index (JSON over MPI, never pickle)."""
        return allgather_json(self.comm, value)

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        """Every member's ``block`` (as uint8; the same length everywhere), by index: one ``Allgather``."""
        out = np.empty((self.size, block.size), dtype=np.uint8)
        self.comm.Allgather([np.ascontiguousarray(block, dtype=np.uint8), MPI.BYTE], [out, MPI.BYTE])
        return list(out)

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        """As :meth:`GroupChannel.exchange`: one ``Sendrecv`` (``MPI.PROC_NULL`` for a side skipped)."""
        sendbuf = send if send is not None else np.empty(0, np.uint8)
        recvbuf = np.empty(recv_nbytes if source is not None else 0, dtype=np.uint8)
        self.comm.Sendrecv([sendbuf, MPI.BYTE], MPI.PROC_NULL if dest is None else dest, self.tag,
                           [recvbuf, MPI.BYTE], MPI.PROC_NULL if source is None else source, self.tag)
        return recvbuf if source is not None else None


@dataclasses.dataclass
class _HeadRequest:
    """A rank's last post-processing request to its head: outstanding or not, and the head's reply."""

    pending: bool = False
    last_reply: Any = None
    level: int = 1  # the level the checkpoint was written at (a differential one's is 5): where a failure leaves it


class MpiTransport(GroupLevels):
    """One process of an MPI run: an application rank, or (``head = 1``) a node's head."""

    name = "mpi"

    def __init__(self, cfg: Config, comm: MPI.Comm) -> None:
        self.cfg = cfg
        self._parent = comm
        self.world = comm.Dup()
        self._comms: list[MPI.Comm] = [self.world]
        #: the host of each node id and the node of each world rank (None with local_test): commit records keep it
        #: for a restart's node order (:mod:`.reorder`)
        self.hosts: dict[str, list[Any]] | None = None
        try:
            self.topo = self._topology(cfg)
            validate_levels(self.topo, [lv for lv in (2, 3) if cfg.interval(lv) > 0])
        except ConfigError:
            self.world.Free()
            raise
        topo, w = self.topo, self.world.rank
        self.is_head = topo.is_head(w)
        self.node, self.nnodes = topo.node_of[w], topo.nnodes
        self._problem = topo.multilevel_ok()
        self.comm = self._keep(self.world.Split(1 if self.is_head else 0, w))
        self.rank, self.size = self.comm.rank, self.comm.size
        # Node communicator: the head (position 0) and its node's application ranks.
        self.node_comm = self._keep(self.world.Split(topo.node_of[w], topo.local_of[w])) if cfg.head else None
        self.group: MpiGroup | None = None
        if not self._problem:
            g = topo.group_of_node(self.node)
            color = g if self.is_head else g * topo.app_per_node + topo.position_of_app(self.rank)
            sub = self._keep(self.comm.Split(color, topo.index_in_group(self.node)))
            self.group = MpiGroup(sub, cfg.mpi_tag)
        # The head's last request: shared with the background clone (whichever sent it, either waits for it).
        self._post = _HeadRequest()
        self._closed = False
        self._foreground: MpiTransport | None = None  # set on the background clone: whose clone it is

    def _topology(self, cfg: Config) -> Topology:
        """FTI's topology of the world (the same on every rank, errors included); on hosts, the world renumbered
        first as the checkpoint to restart from was written (:mod:`.reorder`)."""
        if cfg.local_test:
            return local_topology(self.world.size, cfg.node_size, cfg.head, cfg.group_size)
        names = allgather_json(self.world, reorder.processor_name())
        world, names = reorder.reorder_world(cfg, self.world, names, lambda v: allgather_json(self.world, v)[0])
        self.world = self._comms[0] = world
        topo = host_topology(names, cfg.node_size, cfg.head, cfg.group_size)
        self.hosts = {"names": hosts_by_node(names), "world": list(topo.node_of)}
        return topo

    def _keep(self, comm: MPI.Comm) -> MPI.Comm:
        self._comms.append(comm)
        return comm

    # --- collectives over the application's ranks -------------------------------------------------

    def barrier(self) -> None:
        """A barrier over the application's ranks (heads excluded)."""
        self.comm.Barrier()

    def allgather(self, value: Any) -> list[Any]:
        """Every application rank's JSON-able ``value``, by rank (JSON over MPI, never pickle)."""
        return allgather_json(self.comm, value)

    def stage_mover(self, cfg: Config, notes: Path | None = None) -> Any:
        """Staging's mover: the node's head with ``head = 1`` (the transfers handed to it noted in ``notes``, see
        :mod:`ftidask.staging.journal`); None (a thread of the rank) otherwise."""
        if self.node_comm is None or self.is_head:
            return None
        from .stage_heads import HeadStageMover

        return HeadStageMover(self.node_comm, notes)

    # --- heads (post-processing) --------------------------------------------------------------------

    def write_level(self, level: int, differential: bool = False) -> int:
        """The level the application writes at: 1 when a head will post-process to ``level``. A Zarr level 4
        (``l4_format = zarr``, not differential) is written by the application: a head only copies FTI-FF files."""
        if self.cfg.head and level > 1 and not self.cfg_inline(level) and not (
                level == 4 and self.cfg.l4_format == "zarr" and not differential):
            return 1
        return level

    def cfg_inline(self, level: int) -> bool:
        """Whether the config has the application ranks do level ``level`` (2-4) themselves (``inline_l*``)."""
        return bool({2: self.cfg.inline_l2, 3: self.cfg.inline_l3, 4: self.cfg.inline_l4}[level])

    def post_process(self, record: CommitRecord, level: int, exec_id: str = "") -> None:
        """Ask this node's head to raise ``record`` (an L1 checkpoint) to ``level``."""
        if self.node_comm is None or level == record.level:
            self._post.last_reply = None  # nothing to post-process: no reply of an older checkpoint stands for it
            return
        request = {"op": "post", "record": record.to_json(), "level": level, "exec_id": exec_id}
        send_json(self.node_comm, request, 0, _TAG_REQ)
        self._post.pending, self._post.level = True, record.level

    def post_done(self) -> bool:
        """Whether the last post-processing request is finished (never blocks)."""
        if not self._post.pending:
            return True
        assert self.node_comm is not None
        return bool(self.node_comm.Iprobe(source=0, tag=_TAG_REPLY))

    def wait_post(self) -> Any:
        """Wait for the last post-processing request; its outcome ({'ok': bool, 'error': str}) or None."""
        post = self._post
        if post.pending:
            assert self.node_comm is not None
            post.last_reply, _src = recv_json(self.node_comm, 0, _TAG_REPLY)
            post.pending = False
            if not post.last_reply.get("ok"):
                log.warning("post-processing failed, the checkpoint stays at level %d: %s", post.level,
                            post.last_reply.get("error"))
            elif post.last_reply.get("error"):  # raised, but the heads could not retire older checkpoints
                log.warning("post-processing: %s", post.last_reply["error"])
        return post.last_reply

    def background(self) -> MpiTransport | None:
        """The same ranks over duplicates of the application ranks' and the L2/L3 group's communicators
        (collective), for the background thread of asynchronous checkpoints; the node's head channel
        is shared (the context waits for the background before it talks to the head itself).
        None when MPI was not initialized with ``MPI_THREAD_MULTIPLE``: two threads may not both
        make MPI calls then."""
        if self.is_head or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return None
        clone = copy.copy(self)
        clone._comms = []
        clone.comm = clone._keep(self.comm.Dup())
        if self.group is not None:
            clone.group = MpiGroup(clone._keep(self.group.comm.Dup()), self.cfg.mpi_tag)
        clone._closed = False
        clone._foreground = self
        return clone

    def no_background(self) -> str:
        """Why :meth:`background` gives None: the thread level MPI was initialized with, and how to ask for more."""
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        level = MPI.Query_thread()
        if self.is_head or level >= MPI.THREAD_MULTIPLE:
            return super().no_background()
        return (f"MPI was initialized with {names.get(level, level)}, and a background thread that sends while the "
                "application does needs MPI_THREAD_MULTIPLE: let mpi4py initialize MPI (it asks for MULTIPLE unless "
                "mpi4py.rc.thread_level or MPI4PY_RC_THREAD_LEVEL says otherwise), or set "
                "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI, with an MPI library that provides it")

    def close(self) -> None:
        """Free this transport's communicators (once); a rank with a head first waits for its last request and tells the
        head to end, unless it is a background clone."""
        if self._closed:
            return
        self._closed = True
        if self._foreground is not None:  # a background clone: the head channel is the foreground's
            self.wait_post()
            for comm in reversed(self._comms):
                comm.Free()
            return
        if self.node_comm is not None and not self.is_head:
            self.wait_post()
            send_json(self.node_comm, {"op": "end"}, 0, _TAG_REQ)
            try:  # the heads' processes exit now: an init on this communicator again would wait for them for ever
                self._parent.Set_attr(_ended_key(), True)
            except MPI.Exception:  # freed by the application meanwhile: no init can use it again anyway
                pass
        for comm in reversed(self._comms):
            comm.Free()


def _close_at_exit(transport: MpiTransport) -> None:
    if not MPI.Is_finalized():
        transport.close()


def make_mpi_context(cfg: Config | None, comm: Any, refused: FTIError | None = None) -> Any:
    """``ftidask.init(config, comm=...)``: a Context over MPI ranks; heads serve and never return (as in FTI).

    ``refused``: why this rank's config was refused (``cfg`` is None then): every rank raises it."""
    from ...api.context import Context

    if not isinstance(comm, MPI.Comm):
        raise FTIError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:  # every MPI call on it fails, deep inside; a finalized context's ctx.comm is one
        raise FTIError("comm is MPI.COMM_NULL (a freed communicator, such as ctx.comm after finalize()): pass "
                       "MPI.COMM_WORLD or another live intracommunicator")
    if comm.Get_attr(_ended_key()):  # a local answer: every application rank's finalize set it
        raise FTIError("the heads of this communicator ended at finalize() (head = 1: as in FTI, a head serves one "
                       "init and its process then exits), so no init on it can run again: with heads, call "
                       "ftidask.init() once per job and finalize() at its end")
    # One allgather: each rank's refusal, or the keys every rank must read alike.
    gathered = allgather_json(comm, [f"rank {comm.Get_rank()}: {refused}" if refused else "",
                                     None if cfg is None else {key: getattr(cfg, key) for key in JOB_WIDE_KEYS}])
    refusals = [r for r, _view in gathered if r]
    if refusals:
        raise ConfigError(f"init refused the config: {'; '.join(refusals)}")  # load_config's errors are ConfigErrors
    assert cfg is not None
    views = [view for _r, view in gathered]
    differ = [key for key in JOB_WIDE_KEYS if len({json.dumps(v[key]) for v in views}) > 1]
    if differ:  # before any collective step that depends on them (the heads' split, the node layout)
        said = "; ".join(f"{key}: " + ", ".join(f"rank {r} {v[key]!r}" for r, v in enumerate(views))
                         for key in differ[:3])
        raise ConfigError(f"init refused the config: the ranks read different values of keys every rank must read "
                          f"alike ({said})")
    transport = MpiTransport(cfg, comm)
    if transport.is_head:  # never a Context: the files' modes are set here (permissions = group: 0640, 0750)
        from ...storage.files import set_permissions
        from .heads import serve

        set_permissions(cfg.permissions)
        # A batch scheduler signals every process of the job when its time is up (SIGTERM, SIGUSR1): the application
        # ranks then write a last checkpoint (ResilientLoop), which their head raises; killed by the signal, the head
        # took the job down first. A head ends with its application ranks (their finalize, or their exit).
        for stop in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(stop, signal.SIG_IGN)
        serve(cfg, transport)
        raise SystemExit(0)
    if transport.node_comm is not None:
        # An application that exits without finalize (an uncaught error, in init too) still ends its head, which
        # waited for good (mpiexec with it, until the walltime). Before MPI_Finalize (mpi4py's C exit hook); once
        # closed (finalize), or MPI finalized by the application itself, nothing to do.
        atexit.register(_close_at_exit, transport)
    return Context(cfg, transport)
