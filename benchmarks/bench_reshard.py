"""A restart on another number of ranks against a raw read of the same bytes.

    python benchmarks/bench_reshard.py [--write-ranks 4] [--read-ranks 2] [--mib 128] [--level 1] [--repeat 3] [--zarr]

``--write-ranks`` ranks each protect MIB MiB, their block of a 1-D float64 global array (declared with
``global_shape`` and ``offset``), checkpoint it at ``--level`` and stop without finalizing, as a job that died; each
also writes the same bytes to a raw file (``tofile`` + fsync). Then ``--read-ranks`` ranks restart: each protects its
own block of the global array (another split) and recovers it, the slowest rank timed. The baseline, measured in the
same job, alternating with the recovery: each new rank reads the same byte ranges of the raw files into an array of
its own (``readinto``, no check), the least a restart on another layout must read. Warm: the files in the page cache
(best of ``--repeat``); cold: every file evicted first, as on a restarted job's new nodes (median of ``--repeat``).
"fresh": the arrays are new (``np.empty``, no page touched, as a restarted program's); "in use": already written.
``recover()`` is timed alone and with the restart's ``init`` and ``protect`` (the raw read has neither).
``--zarr`` (with ``--level 4``): the checkpoint is written as Zarr stores (``l4_format = zarr``, Zstd chunks).
Give each rank a core of its own (2 ranks on 2 cores): with more ranks than cores the hashing waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from timing import evict_tree, map_large_arrays_afresh


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Offset and length of part ``i`` of ``n`` items cut in ``parts``."""
    edges = [n * k // parts for k in range(parts + 1)]
    return edges[i], edges[i + 1] - edges[i]


def dirs(base: str, args: argparse.Namespace, size: int) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta", "local_test": 1,
            "verbosity": 3, "node_size": 1, "group_size": args.group, "enable_dcp": int(args.level >= 5),
            "l4_format": "zarr" if args.zarr else "ftiff"}


def write(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import ftidask

    comm = MPI.COMM_WORLD
    n = args.write_ranks * (args.mib << 20) // 8
    off, count = split(n, comm.size, comm.rank)
    block = np.random.default_rng(comm.rank).standard_normal(count)
    ctx = ftidask.init(comm=comm, **dirs(args.dir, args, comm.size))
    ctx.protect(1, block, global_shape=(n,), offset=(off,))
    ctx.checkpoint(1, args.level)
    with open(f"{args.dir}/raw-{comm.rank}.bin", "wb") as fh:
        block.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    ctx._close()  # as if the job died: the checkpoint stays


def raw_read(args: argparse.Namespace, off: int, out: np.ndarray) -> None:
    """Fill ``out`` (the global items from ``off``) from the old ranks' raw files: the same bytes, unchecked."""
    n = args.write_ranks * (args.mib << 20) // 8
    view = memoryview(out).cast("B")
    for old in range(args.write_ranks):
        o, c = split(n, args.write_ranks, old)
        lo, hi = max(o, off), min(o + c, off + out.size)
        if lo >= hi:
            continue
        with open(f"{args.dir}/raw-{old}.bin", "rb", buffering=0) as fh:
            fh.seek((lo - o) * 8)
            want = view[(lo - off) * 8:(hi - off) * 8]
            got = 0
            while got < len(want):
                got += fh.readinto(want[got:])


def read(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import ftidask

    comm = MPI.COMM_WORLD
    n = args.write_ranks * (args.mib << 20) // 8
    off, count = split(n, comm.size, comm.rank)
    times: dict[str, list[float]] = {}
    # "fresh" arrays must be untouched: without this, each np.empty below reuses the resident heap pages of the
    # array freed just before it (under glibc's 32 MiB mmap threshold), so ftidask saw arrays in use (verified, then
    # copied) and the memory rows subtracted pages that were never new (a negative extra)
    times["fresh mapped"] = [float(comm.allreduce(int(map_large_arrays_afresh()), op=MPI.MIN))]

    def slowest(start: float) -> float:
        return float(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))

    expect = np.empty(count)
    raw_read(args, off, expect)
    for cold in (False, True):
        for kind in ("fresh", "in use"):
            key = ("cold " if cold else "warm ") + kind
            for _ in range(args.repeat):
                for what in ("raw", "recover", "init+recover"):
                    out = np.empty(count)  # fresh: no page touched yet, as a restarted program's array
                    if kind == "in use":
                        out[...] = -1.0
                    if cold and comm.rank == 0:
                        evict_tree(args.dir)
                    comm.Barrier()
                    start = time.perf_counter()
                    if what == "raw":
                        raw_read(args, off, out)
                        times.setdefault(f"{key} raw", []).append(slowest(start))
                        continue
                    ctx = ftidask.init(comm=comm, **dirs(args.dir, args, comm.size))
                    ctx.protect(1, out, global_shape=(n,), offset=(off,))
                    comm.Barrier()
                    mid = time.perf_counter()
                    ctx.recover()
                    times.setdefault(f"{key} {what}", []).append(slowest(mid if what == "recover" else start))
                    assert out.tobytes() == expect.tobytes(), "recovered bytes differ from the raw files'"
                    ctx._close()
    for kind in ("fresh", "in use"):  # peak memory beyond the array, once each (warm): the largest of any rank
        out = np.empty(count)
        if kind == "in use":
            out[...] = -1.0
        ctx = ftidask.init(comm=comm, **dirs(args.dir, args, comm.size))
        ctx.protect(1, out, global_shape=(n,), offset=(off,))
        comm.Barrier()
        rss = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:  # VmHWM := VmRSS (Linux 4.0+): the peak of what follows
            fh.write("5")
        ctx.recover()
        extra = _status("VmHWM") - rss - (out.nbytes if kind == "fresh" else 0)  # a fresh array's pages are new
        times[f"memory {kind}"] = [float(comm.allreduce(extra, op=MPI.MAX))]  # < 0: its pages were not new after all
        ctx._close()
    if comm.rank == 0:
        print("RESULT " + json.dumps(times), flush=True)


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-ranks", type=int, default=4)
    ap.add_argument("--read-ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=128, help="MiB per writing rank")
    ap.add_argument("--level", type=int, default=1, choices=range(1, 9), help="5-8: differential (dCP) files")
    ap.add_argument("--group", type=int, default=4, help="group_size (L2/L3)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--zarr", action="store_true", help="level 4 written as Zarr (with --level 4)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--phase", choices=["write", "read"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.zarr and args.level != 4:
        ap.error("--zarr writes level 4: pass --level 4")
    if args.phase == "write":
        write(args)
        return
    if args.phase == "read":
        read(args)
        return
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ftidask-reshard-")
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    common = [__file__, "--write-ranks", str(args.write_ranks), "--mib", str(args.mib), "--level", str(args.level),
              "--group", str(args.group), "--repeat", str(args.repeat), "--dir", args.dir] + ["--zarr"] * args.zarr
    try:
        for phase, ranks in (("write", args.write_ranks), ("read", args.read_ranks)):
            # python -m mpi4py: a rank's uncaught exception aborts the job, not leaving the others in a collective
            proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", *common, "--phase",
                                   phase], capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                sys.exit(f"{phase} failed:\n{proc.stdout}\n{proc.stderr}")
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        t = json.loads(line[7:])
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    total = args.write_ranks * args.mib
    print(f"restart of L{args.level}{' (Zarr)' if args.zarr else ''}, {args.write_ranks} ranks x {args.mib} MiB ({total} MiB) recovered on "
          f"{args.read_ranks} ranks (slowest rank; warm: best of {args.repeat}, cold: median of {args.repeat}), "
          "against a raw read of the same bytes from raw files:")
    for key in ("warm fresh", "warm in use", "cold fresh", "cold in use"):
        pick = min if key.startswith("warm") else statistics.median
        raw, rec, full = pick(t[key + " raw"]), pick(t[key + " recover"]), pick(t[key + " init+recover"])
        print(f"  {key:<12} raw read {raw:6.3f} s ({total / raw:6.0f} MiB/s)   recover() {rec:6.3f} s "
              f"({rec / raw:5.2f}x raw)   init + protect + recover() {full:6.3f} s ({full / raw:5.2f}x raw)")
    block = total / args.read_ranks
    shown = []
    for kind in ("fresh", "in use"):  # a negative extra is a measure gone wrong (pages counted as new that were
        extra = t[f"memory {kind}"][0] / 2**20  # resident already), never a saving: shown as 0 and flagged
        flag = f" (measured {extra:.1f} MiB: pages taken as new were resident, void)" if extra < 0 else ""
        shown.append(f"{kind} {max(extra, 0.0):.1f} MiB ({max(extra, 0.0) / block:.2f}x){flag}")
    print(f"peak memory of recover() beyond the rank's array ({block:.0f} MiB; largest of any rank, warm): "
          + ", ".join(shown))
    if not t["fresh mapped"][0]:
        print("note: glibc's mallopt is missing here, so the \"fresh\" arrays may reuse resident heap pages")


if __name__ == "__main__":
    main()
