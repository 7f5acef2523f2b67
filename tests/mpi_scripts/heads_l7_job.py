"""mpiexec -n 4 python heads_l7_job.py BASE write|read [KIND@N]: 2 nodes of one head and one application rank, one
group of 2, level 7 (L3_DCP) raised by the heads (inline_l3 = 0), dcp_block_size 12 KiB (a stripe of the exchange
cuts blocks). Each rank protects 16 MiB; checkpoints 1-3 change 2/5 of it (a delta of about 6.4 MiB a file, two
stripes): checkpoint 1's parity is encoded in full, 2's and 3's patched from the files' differences.

``write``: checkpoints 1-3, each waited for; ``result-{rank}.json``: the heads' reply to each. ``read``: a restart
that recovers; ``result-{rank}.json``: ``recovered``: [checkpoint, level, exact]. Each head writes
``heads-fds-{world rank}.json``: its descriptors still open on files under BASE once it has served the job.
``KIND@N``: the head of node 0 (world rank 0) damages rank 0's base file (KIND ``truncate``: cut to half its size;
``flip``: a byte of a changed block flipped) or the new file (``flip-new``) between its N-th comparison and the
exchange (the test seam ``head_parity.BEFORE_EXCHANGE``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.backends.mpi import head_parity

N = 2 << 20  # float64: 16 MiB a rank


def data(rank: int, c: int) -> np.ndarray:
    out = np.arange(N, dtype=np.float64) + rank
    out[: N * 2 // 5] += c
    return out


def damage(kind: str, nth: int):
    calls = {"n": 0}

    def hook(base: Path, new: Path) -> None:
        calls["n"] += 1
        if calls["n"] != nth:
            return
        victim = new if kind == "flip-new" else base
        size = victim.stat().st_size
        if kind == "truncate":
            os.truncate(victim, size // 2)
            return
        with open(victim, "r+b") as fh:  # 1/5 of the file: in the data that changed
            fh.seek(size // 5)
            byte = fh.read(1)
            fh.seek(size // 5)
            fh.write(bytes([byte[0] ^ 0xFF]))

    return hook


def open_descriptors(base: str) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(Path(base).resolve())) or target.startswith(base):
            out.append(target)
    return out


def main() -> None:
    base, mode = sys.argv[1], sys.argv[2]
    world = MPI.COMM_WORLD
    if len(sys.argv) > 3 and world.rank == 0:
        kind, _, nth = sys.argv[3].partition("@")
        head_parity.BEFORE_EXCHANGE = damage(kind, int(nth))
    try:
        ctx = ftidask.init(comm=world, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                           local_test=1, node_size=2, head=1, group_size=2, inline_l3=0, enable_dcp=1,
                           dcp_block_size=12288, verbosity=2)
    except SystemExit:  # a head: it served the ranks until they closed, then ends
        fds = open_descriptors(base)
        with open(f"{base}/heads-fds-{world.rank}.json.tmp", "w") as fh:
            json.dump(fds, fh)
        os.replace(f"{base}/heads-fds-{world.rank}.json.tmp", f"{base}/heads-fds-{world.rank}.json")
        raise
    rank = ctx.comm.rank
    a = np.zeros(N)
    ctx.protect(1, a)
    out: dict = {}
    if mode == "read":
        ctx.recover()
        c = ctx.recovered_from[0]
        out["recovered"] = [*ctx.recovered_from, a.tobytes() == data(rank, c).tobytes()]
    else:
        out["replies"] = []
        for c in (1, 2, 3):
            a[:] = data(rank, c)
            ctx.checkpoint(c, 7)
            reply = ctx.wait_post_processing()
            out["replies"].append([reply["ok"], reply["level"] if reply["ok"] else reply["error"]])
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(out, fh)
    ctx.comm.Barrier()
    ctx.transport.close()  # FTI_ENDW to the heads; no finalize: the next job restarts the run
    # The heads write their descriptor lists as they end: an application rank leaving without MPI_Finalize may have
    # mpiexec kill the job's other processes, so it waits for those lists first (seen on a loaded machine).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(Path(f"{base}/heads-fds-{w}.json").exists() for w in (0, 2)):
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
