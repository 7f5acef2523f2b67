"""Staging (FTI_GetStageDir, FTI_SendFile, FTI_GetStageStatus): move node-local files to the global FS.

The application writes a file into its stage directory (``{ckpt_dir}/stage/{exec_id}/node{N}/rank{r}``),
calls :meth:`ftidask.Context.send_file` and keeps computing; a *mover* copies the file in the background
(:mod:`ftidask.staging.copy`: temporary name, fsync, verified by size and hash, rename, then the local
file is removed). States are FTI's: ``SI_PEND`` (queued), ``SI_ACTV`` (being copied), ``SI_SCES``,
``SI_FAIL``; a final state is returned once by ``stage_status``, after which the id is ``SI_NINI``.

Mover interface (for the MPI heads and Dask workers to plug in)::

    class Mover(Protocol):
        def start(self, table: StageTable) -> None   # once, before the first submit
        def submit(self, req: StageRequest) -> None  # must not wait for the copy
        def close(self, timeout: float) -> None      # finish or cancel; every request final on return

A mover reports through ``table.update(req.id, SI_ACTV)`` then ``table.update(req.id, SI_SCES |
SI_FAIL, reason)``; the first final state wins. A mover without a thread of its own (an MPI rank
probing for its head's answers) calls ``table.set_poller(fn)``: ``fn()`` then runs at every
``stage_status``, ``stage_info`` and wait, and reports what has arrived.

A mover in another process runs :func:`staging_copy.transfer` on ``StageRequest.from_json(msg)``
and sends back ``{"id", "state", "reason"}`` (JSON, never pickle); if it dies, the owner fails its
in-flight requests with a reason and unlinks their ``req.tmp`` files. :func:`ftidask.staging.process.serve`
is that loop with the transport left open (pipes for the ProcessMover, MPI messages for a head).

Movers: :class:`ThreadMover` (default), :class:`ftidask.staging.process.ProcessMover` (``head = 1`` in
one process, or ``stage_mover = process``), ``ftidask.backends.dask.staging.DaskMover``. A transport may offer
its own through a ``stage_mover(config, notes)`` method returning a mover or None (``notes``: where a mover that
dies with the run notes its transfers, :mod:`ftidask.staging.journal`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import os
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..model.config import Config
from ..model.constants import SI_ACTV, SI_FAIL, SI_NINI, SI_PEND, SI_SCES
from ..model.errors import StagingError
from ..model.pathnames import path_problem
from ..storage import files as storage
from ..transport.base import Transport
from . import journal
from .copy import StageRequest, temp_name
from .threadmover import ThreadMover

log = logging.getLogger("ftidask")

FINAL = (SI_SCES, SI_FAIL)
STATE_NAMES = {SI_FAIL: "SI_FAIL", SI_SCES: "SI_SCES", SI_ACTV: "SI_ACTV", SI_PEND: "SI_PEND", SI_NINI: "SI_NINI"}


@dataclasses.dataclass
class StageInfo:
    """What is known about one request: its ``request`` (``id``, ``src``, ``dst``...), ``state`` (``SI_*``,
    ``state_name``), ``reason`` (why it failed), and its ``submitted`` and ``finished`` times (``time.monotonic``)."""

    request: StageRequest
    state: int = SI_PEND
    reason: str = ""
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def state_name(self) -> str:
        """The state's FTI name (``SI_PEND``, ``SI_ACTV``, ``SI_SCES``, ``SI_FAIL``, ``SI_NINI``)."""
        return STATE_NAMES[self.state]


#: Requests whose final state :meth:`StageTable.query` returned that :meth:`StageTable.info` still knows.
HISTORY = 1024


class StageTable:
    """The states of a process's requests, shared by the caller and its mover (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._infos: dict[int, StageInfo] = {}
        # Final states already returned by query (FTI_GetStageStatus forgets them): stage_info still tells
        # why one failed, for the last HISTORY of them (a run may send millions of files).
        self._history: collections.OrderedDict[int, StageInfo] = collections.OrderedDict()
        self._targets: set[str] = set()  # destinations of open requests
        self._poller: Callable[[], None] | None = None
        self._poll_lock = threading.Lock()  # one poller at a time (a probe and its receive go together)

    def set_poller(self, poller: Callable[[], None]) -> None:
        """For movers without a thread of their own (an MPI rank probing for its head's answers):
        ``poller()`` is called by every query and wait, and should ``update`` what has arrived."""
        self._poller = poller

    def _poll(self) -> None:
        if self._poller is not None:
            with self._poll_lock:
                self._poller()

    def add(self, req: StageRequest) -> None:
        """Record a new request as ``SI_PEND`` (its destination counts as taken until it is final)."""
        with self._cond:
            self._infos[req.id] = StageInfo(req)
            self._targets.add(req.dst)

    def update(self, req_id: int, state: int, reason: str = "") -> None:
        """A mover's report. Unknown ids and reports after a final state are ignored."""
        with self._cond:
            info = self._infos.get(req_id)
            if info is None or info.state in FINAL or (state == SI_ACTV and info.state != SI_PEND):
                return
            info.state, info.reason = state, reason
            if state in FINAL:
                info.finished = time.monotonic()
                self._targets.discard(info.request.dst)
                if state == SI_FAIL:
                    log.error("staging request %d (%s -> %s) failed: %s", req_id, info.request.src,
                              info.request.dst, reason)
                self._cond.notify_all()

    def fail_open(self, ids: Iterable[int], reason: str) -> None:
        """Report ``SI_FAIL`` with ``reason`` for each of ``ids`` not yet final."""
        for req_id in ids:
            self.update(req_id, SI_FAIL, reason)

    def query(self, req_id: int) -> int:
        """FTI_GetStageStatus: the state; a final state is returned once, then the id is forgotten."""
        self._poll()
        with self._cond:
            info = self._infos.get(req_id)
            if info is None:
                return SI_NINI
            if info.state in FINAL:
                self._history[req_id] = self._infos.pop(req_id)
                if len(self._history) > HISTORY:
                    self._history.popitem(last=False)
            return info.state

    def info(self, req_id: int) -> StageInfo | None:
        """A copy of what is known about request ``req_id`` (also after its final state was read); None if unknown."""
        self._poll()
        with self._cond:
            info = self._infos.get(req_id) or self._history.get(req_id)
            return None if info is None else dataclasses.replace(info)

    def open_requests(self) -> list[StageRequest]:
        """The requests not yet final (queued or being copied)."""
        with self._cond:
            return [i.request for i in self._infos.values() if i.state not in FINAL]

    def is_target(self, dst: str) -> bool:
        """Whether an open request already sends a file to ``dst``."""
        with self._cond:
            return dst in self._targets

    def wait(self, ids: list[int] | None, timeout: float | None) -> dict[int, StageInfo]:
        """Wait until the requests ``ids`` (None: all known) are final; their infos (not consumed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._poll()
            with self._cond:
                chosen = list(self._infos) if ids is None else ids
                infos = {i: self._infos[i] for i in chosen if i in self._infos}
                if all(info.state in FINAL for info in infos.values()):
                    return {i: dataclasses.replace(info) for i, info in infos.items()}
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return {i: dataclasses.replace(info) for i, info in infos.items()}
                if self._poller is not None:  # nobody will notify: look again soon
                    left = 0.005 if left is None else min(left, 0.005)
                self._cond.wait(left)


class Mover(Protocol):
    """What carries staging requests out: a thread of this process or a process of its own (the MPI heads)."""

    def start(self, table: StageTable) -> None:
        """Start; called once, before the first submit, with the table to report to."""

    def submit(self, req: StageRequest) -> None:
        """Take request ``req`` (never waits for the copy)."""

    def close(self, timeout: float) -> None:
        """Finish or cancel within ``timeout`` seconds; every request is final on return."""


def request_id_of(value: Any) -> int:
    """``value`` as a staging request id (what send_file returned), or a :class:`StagingError` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StagingError(f"a staging request id is the int send_file returned, got {value!r}")
    return int(value)


def _path_of(value: Any, what: str) -> str:
    try:
        text = os.fsdecode(os.fspath(value))  # bytes paths too, as str (the request's paths are str)
    except TypeError:
        raise StagingError(f"send_file: {what} must be a path (str or os.PathLike), got {value!r}") from None
    problem = path_problem(text)  # a NUL, a lone surrogate, a name too long: the OS would refuse it later, in
    if problem:  # the mover thread, or raise here from deep inside
        raise StagingError(f"send_file: {what} {text[:80]!r} cannot be a path: {problem}")
    return text


def _inside(path: str, root: str) -> bool:
    """Strictly below ``root`` (both real, absolute paths)."""
    return path.startswith(root.rstrip(os.sep) + os.sep)


class Stager:
    """One process's staging: checks requests at the call, hands them to a mover, tracks states."""

    _ids = itertools.count(1)

    def __init__(self, stage_dir: Path, glbl_dir: Path, mover: Mover, *, allow_outside: bool = False,
                 hash_name: str = "xxh3_128") -> None:
        self.stage_dir = stage_dir
        self._stage_real = os.path.realpath(stage_dir)
        self._glbl_abs = os.path.abspath(glbl_dir)
        self._glbl_real = os.path.realpath(glbl_dir)
        self._real_dirs: dict[str, str] = {}
        self.glbl_dir = glbl_dir
        self.allow_outside = allow_outside
        self.hash_name = hash_name
        self.table = StageTable()
        self.mover = mover
        self._token = uuid.uuid4().hex[:12]
        mover.start(self.table)
        # Without a finalize (interpreter exit, a dropped context): stop at once. Cancelled copies remove
        # their temporary file and the local files stay, so nothing is lost or left half-written.
        self._exit_hook = weakref.finalize(self, mover.close, 0.0)

    def _real_dir(self, directory: str) -> str:
        """``realpath`` of a directory, remembered: resolving a path costs one syscall per component,
        each a chance to wait for the mover thread, and send_file must not block."""
        real = self._real_dirs.get(directory)
        if real is None:
            real = os.path.realpath(directory)
            if os.path.isdir(real):
                self._real_dirs[directory] = real
        return real

    def _check(self, local_path: Any, remote_path: Any) -> tuple[str, str, int]:
        # Plain os.path strings: pathlib costs a few hundred microseconds here, and send_file must not block.
        local = _path_of(local_path, "local_path")
        absolute = os.path.abspath(local)
        try:
            st = os.lstat(absolute)
            if stat.S_ISLNK(st.st_mode):  # follow it: where the bytes really are is what counts
                absolute = os.path.realpath(absolute)
                st = os.stat(absolute)
        except FileNotFoundError:
            raise StagingError(f"send_file: local file {local} does not exist") from None
        except OSError as exc:  # a path through a file, a symbolic link loop
            raise StagingError(f"send_file: local file {local}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):  # first: the stage directory itself is not "outside" it
            raise StagingError(f"send_file: {local} is not a regular file")
        src = os.path.join(self._real_dir(os.path.dirname(absolute)), os.path.basename(absolute))
        if not _inside(src, self._stage_real):
            raise StagingError(f"send_file: {local} is not in the stage directory {self.stage_dir} "
                               "(write it under ctx.stage_dir())")
        text = _path_of(remote_path, "remote_path")
        remote = os.path.join(self._glbl_abs, text)  # relative remote paths are taken under glbl_dir
        if text.endswith(os.sep) or os.path.isdir(remote):
            remote = os.path.join(remote, os.path.basename(src))
        remote = os.path.normpath(remote)
        dst = os.path.join(self._real_dir(os.path.dirname(remote)), os.path.basename(remote))
        if os.path.islink(dst):
            dst = os.path.realpath(dst)
        if not self.allow_outside and not _inside(dst, self._glbl_real):
            raise StagingError(f"send_file: {remote_path} is outside glbl_dir {self.glbl_dir} "
                               "(set stage_allow_outside = 1 to allow it)")
        if os.path.lexists(dst):
            raise StagingError(f"send_file: destination {dst} already exists")
        parent = os.path.dirname(dst)
        if parent not in self._real_dirs.values():
            while not os.path.exists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent):
                raise StagingError(f"send_file: cannot create {os.path.dirname(dst)}: {parent} is a file, "
                                   "not a directory")
        if self.table.is_target(dst):
            raise StagingError(f"send_file: another pending request already sends a file to {dst}")
        return src, dst, st.st_size

    def send(self, local_path: Any, remote_path: Any) -> int:
        """FTI_SendFile: check the request, queue it; the request id. Never waits for the copy."""
        src, dst, size = self._check(local_path, remote_path)
        req_id = next(self._ids)
        req = StageRequest(req_id, src, dst, temp_name(dst, f"{self._token}-{req_id}"), size, self.hash_name,
                           storage.FILE_MODE, storage.DIR_MODE)
        self.table.add(req)
        try:
            self.mover.submit(req)
        except Exception as exc:  # noqa: BLE001 - report it as FTI would: the request failed
            self.table.update(req_id, SI_FAIL, f"the mover refused the request: {exc}")
        return req_id

    def wait(self, request_id: int | None = None, timeout: float | None = None) -> int | dict[int, int]:
        """Wait at most ``timeout`` s (None: no limit) for request ``request_id`` (None: every one whose final state was
        not yet read) to be final; its state (``SI_NINI`` if unknown), or ``{id: state}``. Nothing is consumed."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number))):
            raise StagingError(f"wait_staged(timeout=...) takes seconds (a number) or None, got {timeout!r}")
        if timeout is not None and math.isnan(timeout):
            raise StagingError("wait_staged(timeout=...) takes seconds (a number) or None, got nan")
        if timeout is not None and timeout > threading.TIMEOUT_MAX / 2:  # inf, or more than a lock's wait takes: none
            timeout = None
        request_id = None if request_id is None else request_id_of(request_id)
        ids = None if request_id is None else [request_id]
        infos = self.table.wait(ids, timeout)
        if request_id is not None:
            return infos[request_id].state if request_id in infos else SI_NINI
        return {i: info.state for i, info in infos.items()}

    def close(self, timeout: float) -> list[StageInfo]:
        """Wait for every request (at most ``timeout`` s) and stop the mover; the failed ones not yet read."""
        self._exit_hook.detach()
        self.mover.close(timeout)
        infos = self.table.wait(None, 0)
        return [info for info in infos.values() if info.state == SI_FAIL]


class Staging:
    """A Context's staging: its :class:`Stager`, started on the first request, and the config's rules."""

    def __init__(self, config: Config, transport: Transport, stage_root: Path) -> None:
        self.config = config
        self.transport = transport
        self.stage_root = stage_root
        self.stager: Stager | None = None
        if config.enable_staging:  # the run starts again: what its mover thread was copying when killed goes
            within = None if config.stage_allow_outside else Path(config.glbl_dir)
            journal.sweep(journal.notes_dir(self.stage_dir()), within)
            if transport.name != "dask":  # a job's ranks (a Dask worker's number is no rank of a fixed job)
                journal.sweep_others(stage_root, transport.rank, transport.size, within)

    def get(self) -> Stager:
        """The stager (started on first use); refused when staging is disabled (the context checks it is open)."""
        cfg = self.config
        if not cfg.enable_staging:
            raise StagingError("staging is disabled: set enable_staging = 1 in the config ([basic] section) "
                           "or pass enable_staging=1 to ftidask.init()")
        if self.stager is None:
            stage_dir = storage.makedirs(self.stage_dir())
            # The mover starts here (with the stage dir), so that no send_file pays for starting it.
            self.stager = Stager(stage_dir, Path(cfg.glbl_dir), self.make_mover(),
                                 allow_outside=cfg.stage_allow_outside, hash_name=cfg.hash)
        return self.stager

    def stage_dir(self) -> Path:
        """This rank's stage directory (node-local, of this run)."""
        return self.stage_root / f"node{self.transport.node}" / f"rank{self.transport.rank}"

    def make_mover(self) -> Mover:
        """The transport's own mover if it offers one, else a child process (heads) or a thread."""
        cfg = self.config
        factory = getattr(self.transport, "stage_mover", None)
        mover: Mover | None = factory(cfg, journal.notes_dir(self.stage_dir())) if factory is not None else None
        if mover is not None:
            return mover
        if getattr(cfg, "stage_mover", "auto") == "process" or (
                getattr(cfg, "stage_mover", "auto") == "auto" and cfg.head):
            from .process import ProcessMover  # the head's role, played by a child process

            return ProcessMover()
        return ThreadMover(journal.notes_dir(self.stage_dir()))

    def finish(self) -> list[StageInfo]:
        """At finalize: wait for the requests (``stage_timeout``), stop the mover; the failures."""
        stager, self.stager = self.stager, None
        if stager is None:
            return []
        return stager.close(float(self.config.stage_timeout))

    @staticmethod
    def report(failed: list[StageInfo]) -> None:
        """Raise the failures :meth:`finish` returned, if any, as one :class:`StagingError`."""
        if failed:
            raise StagingError(f"{len(failed)} staging request(s) failed: " + "; ".join(
                f"#{i.request.id} {i.request.src} -> {i.request.dst}: {i.reason}" for i in failed))
