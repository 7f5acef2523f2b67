"""Rank script: real disk faults on one node, at the write and the read sites of the levels.

usage: disk_fault_job.py DIR SCENARIO [SCENARIO ...]

Each scenario runs in ``DIR/<scenario>``, whose ``Local/node1`` (rank 1's node: ``local_test``,
``node_size`` 1) the test has mounted as a small tmpfs. A scenario is ``l<level>-<fault>``:

* ``full``: rank 1's node is full (its own file cannot be written); ``room1``: it has room for its own
  file only (the partner copy or parity it keeps cannot be written); ``async``: ``full``, with
  ``wait=False``. Checkpoint 1 is written, the fault planted, checkpoint 2 fails, the fault is removed,
  checkpoint 3 is written in the same context, and a restart recovers it.
* ``dir``: rank 1's file of checkpoint 2 is replaced by a directory; ``eio``: reading that file fails with
  EIO (a seam: the file's inode, so a file rebuilt at its name reads); ``rebuildfull``: the file is lost
  and the node full, so that the level cannot write it back. A restart recovers (or refuses) checkpoint 2.

Each rank writes ``DIR/<scenario>-<rank>.json``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.storage import files as storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the seam
from diskfull import fill  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.rank
N = 20000


def data(step: int) -> np.ndarray:
    return np.arange(N, dtype=np.float64) * (RANK + 1) + step


def digests(root: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob(pattern)) if p.is_file()}


def config(base: Path, level: int) -> dict[str, Any]:
    return {"ckpt_dir": str(base / "Local"), "glbl_dir": str(base / "Global"), "meta_dir": str(base / "Meta"),
            "local_test": 1, "node_size": 1, "group_size": COMM.size, "verbosity": 4, "enable_dcp": int(level > 4)}


def outcome(call: Any) -> dict[str, Any]:
    try:
        call()
    except ftidask.FTIError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - what the test must not see
        return {"error": f"raw {type(exc).__name__}", "message": str(exc)}
    return {"error": None}


def restart(base: Path, level: int, step: int) -> dict[str, Any]:
    ctx = ftidask.init(comm=COMM, **config(base, level))
    out = np.full(N, -7.0)
    ctx.protect(1, out)
    result = outcome(ctx.recover)
    result.update(recovered=list(ctx.recovered_from or ()), same=bool((out == data(step)).all()),
                  untouched=bool((out == -7.0).all()))
    ctx._close()
    return result


def write_fault(base: Path, level: int, how: str) -> dict[str, Any]:
    node1 = base / "Local" / "node1"
    ctx = ftidask.init(comm=COMM, **config(base, level))
    array = data(1)
    ctx.protect(1, array)
    ctx.checkpoint(1, level)
    COMM.Barrier()
    before = digests(base, "ckpt1*/*")
    filler = fill(node1, 200_000 if how == "room1" else 0) if RANK == 1 else None
    COMM.Barrier()
    array[:] = data(2)
    def second() -> None:
        if how == "async":
            ctx.checkpoint(2, level, wait=False).result()  # the background writer's error, through its handle
        else:
            ctx.checkpoint(2, level)

    result = outcome(second)
    COMM.Barrier()
    result.update(previous_intact=digests(base, "ckpt1*/*") == before,
                  temps=[str(p) for p in base.rglob("*") if ".tmp-" in p.name])
    if filler is not None:
        filler.unlink()
    COMM.Barrier()
    array[:] = data(3)
    result["after"] = outcome(lambda: ctx.checkpoint(3, level))
    ctx._close()
    result["restart"] = restart(base, level, 3)
    return result


def read_fault(base: Path, level: int, how: str) -> dict[str, Any]:
    node1 = base / "Local" / "node1"
    ctx = ftidask.init(comm=COMM, **config(base, level))
    array = data(1)
    ctx.protect(1, array)
    ctx.checkpoint(1, level)
    array[:] = data(2)
    ctx.checkpoint(2, level)
    ctx._close()
    COMM.Barrier()
    real = storage.open_regular
    if RANK == 1:
        own = list(node1.rglob("Ckpt2-Rank1.fti"))
        if how == "eio":
            bad = {p.stat().st_ino for p in own}

            def broken(path: Any, *args: Any, **kwargs: Any) -> int:
                fd = real(path, *args, **kwargs)
                if os.fstat(fd).st_ino in bad:
                    os.close(fd)
                    raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
                return fd

            storage.open_regular = broken
        for path in own if how in ("dir", "rebuildfull") else ():
            path.unlink()
            if how == "dir":
                path.mkdir()
                (path / "inside").write_bytes(b"x")
        if how == "rebuildfull":
            fill(node1)
    COMM.Barrier()
    try:
        return restart(base, level, 2)
    finally:
        storage.open_regular = real


def main() -> None:
    root = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        level, how = scenario.split("-", 1)
        run = write_fault if how in ("full", "room1", "async") else read_fault
        result = run(root / scenario, int(level[1:]), how)
        (root / f"{scenario}-{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
