"""Reading a recovered chunk wherever Dask runs the read: the task behind each chunk of the arrays
that :func:`ftidask.backends.dask.restore.recover` returns.

A read runs on the worker that serves its file (chosen by recovery) while that worker lives. If
it dies, Dask computes the lost chunks again on other workers (the tasks' placement is loose),
where the task finds the file as that worker sees it: the rank's file itself (L4's global directory,
or a node directory it sees), else, where the level keeps redundancy, the partner copy (L2: also where the
rank's file is damaged) or a file rebuilt from the group's data and parity files (L3), written where recovery
rebuilds files.

At L3 a rank's file that is there but damaged (a chunk's hash fails) is rebuilt as one that is missing, and
replaces it as recovery's rebuild does (:func:`ftidask.levels.rs.rebuild`): decoded into a temporary file
beside it, fsynced, verified against the commit record, then renamed over it. The decode inputs follow the
level's rule (:func:`ftidask.levels.rs.decode_inputs`): ``k`` of the group's other files, a parity only if it
matches its ``.hash`` record, a data file only if it matches the whole-file hash those records keep; the
damaged file never. One read at a time rebuilds a file in a worker process; the reads of its other chunks
waiting meanwhile read the rebuilt file. An input lost while it is read (a second node lost during the rebuild) is
left out and the inputs chosen again, while the group keeps ``k`` of them; the own file lost between the look that
found it and its read is rebuilt as a missing one.
Failing that, a :class:`RecoveryError` says so (never unverified bytes); never a wait for the dead worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...engine.device import device_chunk
from ...ftiff.reader import identity_of
from ...levels import rs
from ...levels.blockio import clear_directory, linked_dir
from ...levels.erasure import decode_files
from ...model.errors import FormatError, RecoveryError
from ...storage import files as storage
from . import tasks

log = logging.getLogger("ftidask")
TOPIC = "ftidask-lineage"  # distributed's event topic of the lineage reads (Client.get_events)

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(path: str) -> threading.Lock:
    # One rebuild of a file per worker process at a time (several of its chunks may be read at once).
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        return identity_of(os.stat(path))
    except OSError:
        return None


def _rebuild_from_parity(src: dict[str, Any], damaged: tuple[int, ...] | None = None) -> bool:
    """Rebuild ``src["path"]`` from ``k`` of its group's other files that this worker sees and that verify (a
    parity against its record, a data file against the whole-file hash the records keep: never one that differs,
    :func:`ftidask.levels.rs.decode_inputs`), streamed into a temporary file that replaces the path, as recovery's
    rebuild does, once it verifies against the commit record. ``damaged``: the identity of the own file whose read
    failed (rebuilt only while it is still that file: a read of another chunk may have rebuilt it); None: the file
    is missing. False when fewer than ``k`` of those files are visible (nothing tried); a rebuild that fails raises
    :class:`RecoveryError`, leaving the path as it was."""
    group = src["group"]
    k, pos = len(group["data"]), group["position"]
    others = [p for i, p in enumerate(group["data"]) if i != pos] + list(group["parity"])
    if sum(os.path.exists(p) for p in others) < k:
        return False
    what = f"checkpoint {src['ckpt_id']} (level {src['level']}): the file of rank {src['rank']}"
    with _lock(src["path"]):
        if _identity(src["path"]) != damaged:  # rebuilt meanwhile by another read of this process
            return True
        # An input lost while it is read (another node lost during the rebuild) is left out of a next choice, as
        # long as the group keeps k: each try either succeeds or loses an input for good, so 2k - 1 tries suffice.
        for _ in range(2 * k - 1):
            data, parity, why = rs.decode_inputs(group["data"], group["parity"], pos, group["sizes"])
            have = sum(p is not None for p in data + parity)
            if have < k:
                raise RecoveryError(f"{what} cannot be rebuilt from its group's parity: {have} of the {2 * k - 1} "
                                    f"other files verify, {k} are needed ({'; '.join(why[:4])})")
            try:
                _decode_over(src, data, parity, pos, what)
                break
            except _InputLost:
                continue
        else:
            raise RecoveryError(f"{what} cannot be rebuilt from its group's parity: its inputs kept vanishing while "
                                "they were read")
        log.info("checkpoint %s: the %s file of rank %s rebuilt from its group's parity", src["ckpt_id"],
                 "missing" if damaged is None else "damaged", src["rank"])
    return True


class _InputLost(Exception):
    """An input of a rebuild vanished while it was read, or the directory written to."""


def _decode_over(src: dict[str, Any], data: list[str | None], parity: list[str | None], pos: int, what: str) -> None:
    """Decode rank ``pos``'s file from the chosen inputs into a temporary file, verify it and rename it over
    ``src["path"]`` (the path as it was on any failure). :class:`_InputLost` when an input is gone meanwhile."""
    group, target = src["group"], Path(src["path"])
    if (made := linked_dir(target)) is not None:
        raise RecoveryError(f"{what} is not rebuilt: {made} is a symbolic link (outside the run's directories)")
    tmp: Path | None = None
    try:
        storage.makedirs(target.parent)  # a lost node's directory comes back
        fd, tmp = storage.create_temp(target, os.O_WRONLY)
        os.close(fd)
        decode_files(data, parity, group["sizes"], {pos: str(tmp)})  # written whole and fsynced
        # Its hashes: the read that follows decodes the chunk it needs (a compressed container decoded once).
        verdict = tasks.check_file(str(tmp), src["fb_hash"], decode=False)
        if not verdict["ok"]:
            if not tmp.exists():  # collected as a leftover by a checkpoint committing meanwhile: done again
                raise _InputLost()
            raise RecoveryError(f"{what} rebuilt from its group's parity does not verify: {verdict['message']}")
        clear_directory(target)  # a rank file replaced by a directory is lost: the rebuilt one takes its place
        storage.rename_into(tmp, target)  # the damaged file replaced at once, never a partial one
        tmp = None
    except (ValueError, OSError) as exc:  # a read or write error, a file changed since it was checked
        if not target.parent.exists() or any(p is not None and not os.path.exists(p) for p in data + parity) or (
                tmp is not None and not tmp.exists()):  # (or the temporary collected by a checkpoint's start)
            raise _InputLost() from None  # (or the target's directory erased: its node lost as it came back)
        raise RecoveryError(f"{what} cannot be rebuilt from its group's parity: {exc}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def locate(src: dict[str, Any]) -> str | None:
    """A path on this worker holding the file described by ``src`` (rebuilt here if need be), or None."""
    if os.path.exists(src["path"]):
        return str(src["path"])
    for copy in src.get("copies", ()):  # an L2 partner copy: the same bytes (its FB hash is checked on read)
        if os.path.exists(copy):
            return str(copy)
    if src.get("group") and _rebuild_from_parity(src):
        return str(src["path"])
    return None


def read_or_copy(src: dict[str, Any], path: str, var_id: int, dptr: int, dtype_json: Any,
                 shape: list[int]) -> tuple[np.ndarray, str, bool]:
    """The chunk read (hash-checked) from ``path``; should that file be damaged, from an L2 partner copy that
    verifies (the same bytes under the same FB hash), or (L3) from the file rebuilt from the group's parity in its
    place, as recovery does. The chunk, the path it came from, and whether a damaged file was rebuilt for it."""
    seen = _identity(path)
    try:
        return tasks.read_chunk(path, var_id, dptr, dtype_json, shape, src["fb_hash"]), path, False
    except (OSError, FormatError) as exc:
        first = exc
    for copy in src.get("copies", ()):
        if copy != path and os.path.exists(copy):
            try:
                return tasks.read_chunk(copy, var_id, dptr, dtype_json, shape, src["fb_hash"]), str(copy), False
            except (OSError, FormatError):
                continue
    if not (src.get("group") and path == str(src["path"])):
        raise first
    now = _identity(path)
    # Damaged (unchanged since the read), or vanished since it was found (its node lost meanwhile): rebuilt as a
    # damaged or a missing file. Otherwise replaced meanwhile (rebuilt by another read): that file is read.
    if (now is None or now == seen) and not _rebuild_from_parity(src, now):
        raise RecoveryError(f"checkpoint {src['ckpt_id']} (level {src['level']}): the file of rank {src['rank']} is "
                            f"{'lost' if now is None else 'damaged'} ({first}), and {_NO_COPY[3]} to rebuild it")
    return tasks.read_chunk(path, var_id, dptr, dtype_json, shape, src["fb_hash"]), path, True


def _here() -> str | None:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except ValueError:  # not in a worker (a synchronous compute)
        return None


def _alive(address: str) -> bool:
    """Whether ``address`` is a running worker of the cluster (False when that cannot be asked)."""
    try:
        from distributed import get_client

        client = get_client()
        workers = client.sync(client.scheduler.identity)["workers"]
    except Exception:  # noqa: BLE001 - no answer: better a clear error than a task sent back forever
        return False
    return address in workers and workers[address].get("status", "running") == "running"


_NO_COPY = {1: "level 1 keeps no copy", 2: "its partner copy is not visible there either",
            3: "fewer than half of its group's data and parity files are visible there",
            4: "the global directory does not hold it (any more)"}


def read_recovered_chunk(src: dict[str, Any], var_id: int, dptr: int, dtype_json: Any,
                         shape: list[int]) -> np.ndarray:
    """One chunk of a recovered array, read (and hash-checked) from its rank's file as this worker sees it.

    ``src``: the file (``path``, ``fb_hash``), the worker that served it at recovery (``worker``),
    and what can replace it: ``copies`` (L2 partner copies) or ``group`` (L3: the group's data and
    parity paths, this rank's position, its size and the group's padded length).
    """
    here = _here()
    if here is not None and here != src["worker"] and _alive(src["worker"]):
        # Moved here by Dask's work stealing while the worker that serves the file lives (it may be
        # the only one that sees it): back there. Only a dead server's reads run elsewhere.
        from distributed import Reschedule

        raise Reschedule()
    path = locate(src)
    if path is None:
        gone = "" if here == src["worker"] else ", which left the cluster"
        raise RecoveryError(
            f"checkpoint {src['ckpt_id']} (level {src['level']}): a chunk of variable {var_id} cannot be read "
            f"again: the file of rank {src['rank']} ({src['path']}), served by worker {src['worker']}{gone}, is "
            f"not visible on worker {here or 'this process'}, and {_NO_COPY.get(src['level'], 'no copy is')}; "
            "call ctx.recover() again (it rebuilds what the level allows, or falls back to an older checkpoint)")
    return read_or_copy(src, path, var_id, dptr, dtype_json, shape)[0]


def _how(src: dict[str, Any], path: str, existed: bool) -> str:
    if path in src.get("copies", ()):
        return "partner copy"
    if not existed and src.get("group"):
        return "rebuilt from the group's parity"
    return "global file" if src["level"] == 4 else "its file"


def read_lineage_chunk(src: dict[str, Any], var_id: int, name: str, index: list[int], dptr: int, dtype_json: Any,
                       shape: list[int], device: bool = False) -> Any:
    """The task behind each chunk of an array whose lineage a checkpoint cut (:mod:`.lineage`).

    It runs only when Dask recomputes a lost chunk (its worker died): the chunk is read from the
    checkpoint's file as this worker sees it, or (that file lost or damaged) its L2 partner copy, or (lost or
    damaged) the file rebuilt from L3 parity, hash-checked. Reported as a ``ftidask-lineage`` event (logged by
    the client) and in this worker's log; where the level cannot bring the chunk back, a :class:`RecoveryError` names
    the chunk and the checkpoint (never wrong data). ``device``: the chunk is put on the worker's device (its
    array's chunks are CuPy arrays).
    """
    start = time.perf_counter()
    here = _here()
    existed = os.path.exists(src["path"])
    try:
        path = locate(src)
        if path is None:
            raise RecoveryError(f"the file of rank {src['rank']} ({src['path']}) is not visible on worker "
                                f"{here or 'this process'}, and {_NO_COPY.get(src['level'], 'no copy is')}")
        out, path, rebuilt = read_or_copy(src, path, var_id, dptr, dtype_json, shape)
    except (OSError, FormatError, RecoveryError) as exc:  # a lost, damaged or foreign file: said, never wrong data
        raise RecoveryError(f"chunk {tuple(index)} of variable {var_id} ({name}) was lost with its worker and cannot "
                            f"be restored from checkpoint {src['ckpt_id']} (level {src['level']}): {exc}") from None
    event = {"exec_id": src.get("exec_id", ""), "var": var_id, "name": name, "index": list(index),
             "ckpt_id": src["ckpt_id"], "level": src["level"], "how": _how(src, path, existed and not rebuilt),
             "path": path, "worker": here or "", "nbytes": int(out.nbytes), "seconds": time.perf_counter() - start}
    log.info("lineage: chunk %s of variable %d restored from checkpoint %d (level %d, %s)", tuple(index), var_id,
             src["ckpt_id"], src["level"], event["how"])
    if here is not None:
        from distributed import get_worker

        get_worker().log_event(TOPIC, event)
    return device_chunk(out) if device else out
