"""A staging mover in a separate process: FTI's head process, for one process or as a model for MPI heads.

Protocol (JSON lines, never pickle): the owner writes one :meth:`StageRequest.to_json` object per
line to the mover's stdin; the mover answers on stdout with ``{"id": n, "state": SI_ACTV}`` when it
starts a request and ``{"id": n, "state": SI_SCES | SI_FAIL, "reason": "..."}`` when it ends. Closing
stdin asks the mover to finish its queue and exit; an owner that dies (its reply pipe broken) stops the mover
after the transfer under way. If the mover dies (killed, out of memory), the
owner settles every request it had not finished (:mod:`ftidask.staging.settle`): one published before the death is
``SI_SCES``, the others fail with reason "mover died (...)" once their temporary files (``req.tmp``) are removed
(nothing half-written stays at the destination); the next request starts a new mover.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..model.constants import FTI_SI_ACTV, FTI_SI_FAIL, FTI_SI_SCES
from .copy import CANCELLED, StageRequest, TransferFailed, transfer
from .settle import settle


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Child:
    """One mover process and the requests it holds."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.inflight: dict[int, StageRequest] = {}
        self.dead = False
        self.death_reason = ""
        self.reader: threading.Thread | None = None


class ProcessMover:
    """Runs transfers in a child process; restarts it after a death."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._table: Any = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        """The running mover's process id (for tests and monitoring)."""
        child = self._child
        return None if child is None or child.dead else child.proc.pid

    def start(self, table: Any) -> None:
        """Spawn the mover process, which reports to ``table``."""
        self._table = table
        with self._lock:
            self._child = self._spawn()

    def _spawn(self) -> _Child:
        args = [sys.executable, "-c", "from ftidask.staging.process import child_main; child_main()"]
        env = dict(os.environ)
        # The mover imports the same ftidask as its owner, wherever that one comes from.
        root = os.fspath(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        child = _Child(proc)
        child.reader = threading.Thread(target=self._read, args=(child,), name="ftidask-stage-mover-reader",
                                        daemon=True)
        child.reader.start()
        return child

    def submit(self, req: StageRequest) -> None:
        """Send ``req`` to the mover process as a JSON line (a dead mover is restarted first)."""
        line = (json.dumps(req.to_json()) + "\n").encode()
        with self._lock:
            child = self._child
            if child is None or child.dead or child.proc.poll() is not None:
                child = self._child = self._spawn()
                self.restarts += 1
            child.inflight[req.id] = req
            assert child.proc.stdin is not None
            try:
                child.proc.stdin.write(line)
                child.proc.stdin.flush()
            except OSError:
                pass  # the mover is gone: its reader fails this request with the others

    def _read(self, child: _Child) -> None:
        out: IO[bytes] | None = child.proc.stdout
        assert out is not None
        for raw in out:
            try:
                msg = json.loads(raw)
                req_id, state = int(msg["id"]), int(msg["state"])
            except (ValueError, KeyError, TypeError):
                continue
            if state in (FTI_SI_SCES, FTI_SI_FAIL):
                with self._lock:
                    child.inflight.pop(req_id, None)
            self._table.update(req_id, state, str(msg.get("reason", "")))
        code = child.proc.wait()
        with self._lock:
            child.dead = True
            lost = list(child.inflight.values())
            child.inflight.clear()
        reason = child.death_reason or f"mover died ({_describe_exit(code)})"
        for req in lost:  # killed after publishing, before its answer: SI_SCES; else its temporary file goes first
            state = settle(req)
            self._table.update(req.id, state, reason if state == FTI_SI_FAIL else "")

    def close(self, timeout: float) -> None:
        """Close the mover's input and wait at most ``timeout`` s; kill it if requests are left, reported failed."""
        with self._lock:
            child = self._child
        if child is None:
            return
        with contextlib.suppress(OSError):
            assert child.proc.stdin is not None
            child.proc.stdin.close()
        self._table.wait(None, timeout)
        if child.proc.poll() is None and child.inflight:
            child.death_reason = CANCELLED
            child.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(10)
        if child.reader is not None:
            child.reader.join(10)
        self._table.fail_open([r.id for r in self._table.open_requests()], CANCELLED)


# --- the mover process -------------------------------------------------------------------------


def _stdin_reader(requests: queue.SimpleQueue[dict[str, Any] | None]) -> None:
    for raw in sys.stdin.buffer:
        with contextlib.suppress(ValueError):
            requests.put(json.loads(raw))
    requests.put(None)


def serve(next_request: Callable[[], dict[str, Any] | None], reply: Callable[[dict[str, Any]], None]) -> None:
    """A mover's loop, whatever carries the messages (pipes here, MPI messages on a head).

    ``next_request()`` returns a :meth:`StageRequest.to_json` dict, or None to stop; ``reply(msg)``
    sends ``{"id", "state", "reason"}`` back to the request's owner. One transfer at a time.
    """
    while (raw := next_request()) is not None:
        try:
            req = StageRequest.from_json(raw)
        except (KeyError, TypeError, ValueError):
            continue
        reply({"id": req.id, "state": FTI_SI_ACTV, "reason": ""})
        try:
            transfer(req)
        except TransferFailed as exc:
            reply({"id": req.id, "state": FTI_SI_FAIL, "reason": str(exc)})
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            reply({"id": req.id, "state": FTI_SI_FAIL, "reason": f"internal error: {exc!r}"})
        else:
            reply({"id": req.id, "state": FTI_SI_SCES, "reason": ""})


def child_main() -> None:
    """The mover process: requests on stdin, states on stdout (JSON lines)."""
    # A write past RLIMIT_FSIZE (a limit inherited from a batch system) must fail with EFBIG, not
    # kill the mover with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    out = sys.stdout.buffer

    def reply(msg: dict[str, Any]) -> None:
        try:
            out.write((json.dumps(msg) + "\n").encode())
            out.flush()
        except BrokenPipeError:  # the owner died (killed): nobody is left to learn the states, or to wait
            os._exit(0)  # for the queue. Stop quietly, after the transfer under way (whole), before any other.

    # A reader thread drains stdin, so the owner's writes never block on a full pipe during a long copy.
    requests: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    threading.Thread(target=_stdin_reader, args=(requests,), daemon=True).start()
    serve(requests.get, reply)
