"""Rank script of tests/test_memory.py: the peak extra memory of one differential L3 checkpoint (level 7) whose every
block changed, the parity patched from the group's XOR deltas.

usage: memory_job.py DIR MIB [keep|read]
Each rank protects MIB MiB, checkpoints twice at level 7 (the second keeps a spare parity), changes every element,
then measures the third checkpoint: its VmHWM (reset with /proc/self/clear_refs before it) minus its RSS before.
Writes ``DIR/memory-<rank>.json``: {"extra": bytes, "patched": whether the parity was patched from the deltas}.
``keep``: the checkpoints stay (no finalize, as a run killed after its last checkpoint); ``read``: a restart that
recovers them into fresh arrays, writing ``DIR/read-<rank>.json``: {"exact": the third checkpoint's values}.
"""

import json
import logging
import sys

import numpy as np
from mpi4py import MPI

import ftidask


def rss(key: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


class Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    base, mib = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    world = MPI.COMM_WORLD
    ctx = ftidask.init(comm=world, local_test=1, node_size=1, group_size=world.size, enable_dcp=1, verbosity=1,
                       ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta")
    if mode == "read":
        data = np.empty(mib << 17)
        ctx.protect(1, data)
        ctx.recover()
        exact = data.tobytes() == (np.arange(mib << 17, dtype=np.float64) + world.rank + 1.0).tobytes()
        with open(f"{base}/read-{world.rank}.json", "w") as fh:
            json.dump({"exact": exact, "from": ctx.recovered_from}, fh, default=str)
        ctx._closed = True
        return
    seen = Seen()
    logging.getLogger("ftidask").addHandler(seen)
    data = np.arange(mib << 17, dtype=np.float64) + world.rank
    ctx.protect(1, data)
    ctx.checkpoint(1, 7)
    ctx.checkpoint(2, 7)
    data += 1.0  # every block changed: the XOR delta is the whole file
    seen.lines.clear()
    world.Barrier()
    before = rss()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    ctx.checkpoint(3, 7)
    extra = rss("VmHWM") - before
    patched = any("parity updated from the group's deltas" in line for line in seen.lines)
    with open(f"{base}/memory-{world.rank}.json", "w") as fh:
        json.dump({"extra": extra, "patched": patched}, fh)
    if mode == "keep":
        ctx._closed = True  # no finalize: the checkpoints stay for the restart
        return
    ctx.finalize()


if __name__ == "__main__":
    main()
