"""Per-level checkpoint time over MPI ranks, and the erasure codec's throughput against a memory copy.

    python benchmarks/bench_levels_mpi.py [--ranks 4] [--group 4] [--mib 256] [--dir /tmp/bench] [--dcp]
                                          [--async] [--levels 1 2 3 4]

The driver launches ``mpiexec -n RANKS`` workers (GROUP simulated nodes, L2/L3 groups of GROUP
nodes; RANKS a multiple of GROUP), each protecting MIB MiB; every level is written --repeat times and
timed (slowest rank, best of them), L1 being the baseline. Give each rank a core of its own (``--ranks 2 --group 2``
on 2 cores): with more ranks than cores the level's exchange and hashing wait for a core, which
a cluster's rank does not. Then, in
this process, the Reed-Solomon codec (k = m = 4) encodes and decodes blocks (``bench_erasure.py``); its GB/s per core is
printed next to a plain ``numpy.copyto`` of the same bytes. With ``--dcp``, differential L2 and
L3 checkpoints (1% of the blocks changed) are timed against a full checkpoint at the same level.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    from timing import map_large_arrays_afresh

    import ftidask
    from ftidask.storage.files import find_paths

    world = MPI.COMM_WORLD
    map_large_arrays_afresh()  # each np.empty_like a new mapping, as a restarted program's first arrays
    if args.writeback == "off":  # a variant to measure: every byte left to the final fsync, as the raw write does
        from ftidask.ftiff import writer
        from ftidask.levels import blockio

        writer._WRITEBACK_MIN = blockio.WRITEBACK_MIN = 1 << 62
    out = {}
    for level in args.levels:
        base = Path(args.dir) / f"l{level}"
        dirs = dict(comm=world, local_test=1, node_size=max(1, world.size // args.group), group_size=args.group,
                    ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta", verbosity=3,
                    direct_io=args.direct_io == "on")
        with ftidask.init(**dirs) as ctx:
            data = np.random.default_rng(ctx.comm.rank).integers(0, 255, args.mib << 20, dtype=np.uint8)
            ctx.protect(1, data)
            elapsed = float("inf")
            last = max(3, args.repeat)
            for ckpt_id in range(1, last + 1):  # best of N, as the raw write's baseline (the disk is shared)
                ctx.comm.Barrier()
                start = time.perf_counter()
                ctx.checkpoint(ckpt_id, level)  # each one retires the one before: one checkpoint on disk
                elapsed = min(elapsed, ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            write = raw_write(world, base, level, last, Path(args.dir), args.group)
            # Restart with nothing lost against a raw read of this rank's file (same page cache state: warm, then cold).
            own = find_paths(base, f"Ckpt{last}-Rank{world.rank}.fti")  # (rglob raised on trash deleted meanwhile)
            # A restarted process recovers into fresh arrays, as np.fromfile reads into a fresh one; a recovery into
            # arrays in use (a notebook's, a solver's rollback) is timed too: their old values stay until every rank
            # has verified, so the file is hashed, then copied.
            ctx2 = ftidask.init(**dirs)
            in_use = np.zeros_like(data)

            def slowest(run) -> float:  # the slowest rank's seconds
                world.Barrier()
                start = time.perf_counter()
                run()
                return world.allreduce(time.perf_counter() - start, op=MPI.MAX)

            def recovered(target: np.ndarray) -> float:
                ctx2.protect(1, target)
                seconds = slowest(ctx2.recover)
                assert np.array_equal(target, data)
                return seconds

            raw = restart = rollback = float("inf")
            for _ in range(3):  # best of 3, alternating
                raw = min(raw, slowest(lambda: [np.fromfile(path, dtype=np.uint8) for path in own]))
                restart = min(restart, recovered(np.empty_like(data)))
                in_use[...] = 1
                rollback = min(rollback, recovered(in_use))
            # Cold cache, as a restarted job: the rank's file evicted, a fresh array (medians of 3, alternating).
            cold_raw, cold_restart = [], []
            for _ in range(3):
                evict(own)
                world.Barrier()
                start = time.perf_counter()
                for path in own:
                    np.fromfile(path, dtype=np.uint8)
                cold_raw.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
                fresh = np.empty_like(data)
                ctx2.protect(1, fresh)
                evict(own)
                world.Barrier()
                start = time.perf_counter()
                ctx2.recover()
                cold_restart.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
                assert np.array_equal(fresh, data)
            out[level] = [elapsed, restart, raw, write, float(np.median(cold_restart)), float(np.median(cold_raw)),
                          rollback]
        shutil.rmtree(base, ignore_errors=True)
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def evict(paths: list[Path]) -> None:
    """Take ``paths`` out of the page cache (those files only: other programs keep theirs)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(world, base: Path, level: int, ckpt_id: int, scratch: Path, group: int) -> float:
    """The slowest rank's time to write, with ``tofile`` then ``fsync``, exactly the bytes ``level`` wrote for it.

    L1: its file; L2: its file and its left partner's copy; L3: its file and a parity file of the group's
    largest file; L4: the global copy. Sizes are taken from the files checkpoint ``ckpt_id`` wrote.
    """
    from mpi4py import MPI

    from ftidask.storage.files import find_paths

    where = "Global" if level == 4 else "Local"
    own = sum(p.stat().st_size for p in find_paths(base / where, f"Ckpt{ckpt_id}-Rank{world.rank}.fti"))
    sizes = world.allgather(own)
    extra = 0
    if level in (2, 3):  # only these write for others (main() checked that the ranks fill whole groups)
        # ranks are placed node by node, one per node per group of ``group`` nodes
        node_size = max(1, world.size // group)
        node, pos = world.rank // node_size, world.rank % node_size
        members = [(node // group * group + j) * node_size + pos for j in range(group)]
        if level == 2:
            extra = sizes[members[(node % group - 1) % group]]  # the left partner's copy
        else:
            extra = max(sizes[m] for m in members)  # a parity file of the group's largest file
    payload = np.random.default_rng(world.rank).integers(0, 255, max(own, extra), dtype=np.uint8)
    scratch.mkdir(parents=True, exist_ok=True)
    paths = [scratch / f"raw-{level}-{world.rank}-{j}.bin" for j in range(2)]
    best = float("inf")
    for _ in range(max(3, ckpt_id)):  # best of as many as the checkpoints (the disk is shared)
        world.Barrier()
        start = time.perf_counter()
        for path, n in zip(paths, (own, extra), strict=True):
            if n:
                with open(path, "wb") as fh:
                    payload[:n].tofile(fh)
                    fh.flush()
                    os.fsync(fh.fileno())
        best = min(best, world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        for path in paths:
            path.unlink(missing_ok=True)
    return best


def worker_dcp(args: argparse.Namespace) -> None:
    """Differential L2 and L3 (levels 6, 7) after ``--changed``% of each rank's 16 KiB blocks changed, each timed
    right after a full checkpoint of the same state at the same level."""
    from mpi4py import MPI

    import ftidask

    world = MPI.COMM_WORLD
    out = {}
    for level in (2, 3):
        base = Path(args.dir) / f"dcp{level}"
        with ftidask.init(comm=world, local_test=1, node_size=max(1, world.size // args.group),
                          group_size=args.group,
                          ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                          verbosity=3, enable_dcp=1, dcp_block_size=16384) as ctx:
            rng = np.random.default_rng(ctx.comm.rank)
            data = rng.integers(0, 255, args.mib << 20, dtype=np.uint8)
            ctx.protect(1, data)
            ctx.checkpoint(1, level + 4)
            ctx.checkpoint(2, level + 4)  # both alternating files (and spare copies / parities) filled
            ctx.comm.Barrier()
            start = time.perf_counter()
            ctx.checkpoint(3, level)
            full = ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            blocks = data.size // 16384  # the spares now hold checkpoint 2: the same state until here
            data[rng.choice(blocks, int(blocks * args.changed / 100), replace=False) * 16384] += 1
            ctx.comm.Barrier()
            start = time.perf_counter()
            info = ctx.checkpoint(4, level + 4)
            dcp = ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            out[level] = [full, dcp, ctx.comm.allreduce(info.blocks_changed), ctx.comm.allreduce(info.blocks_total)]
        shutil.rmtree(base, ignore_errors=True)
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def worker_async(args: argparse.Namespace) -> None:
    """Per level: the synchronous checkpoint, then the time an asynchronous one blocks the ranks (and its
    total, until committed), slowest rank, medians of ``--repeat`` (after one asynchronous warm-up)."""
    import statistics

    from mpi4py import MPI

    import ftidask

    world = MPI.COMM_WORLD
    out = {}
    for level in args.levels:
        base = Path(args.dir) / f"async{level}"
        with ftidask.init(comm=world, local_test=1, node_size=max(1, world.size // args.group),
                          group_size=args.group,
                          ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                          verbosity=3) as ctx:
            data = np.random.default_rng(ctx.comm.rank).random((args.mib << 20) // 8)
            ctx.protect(1, data)
            ids = iter(range(1, 100))
            sync, blocked, total = [], [], []
            ctx.checkpoint(next(ids), level, wait=False).result()  # warm-up: the background's communicators
            for _ in range(args.repeat):
                ctx.comm.Barrier()
                start = time.perf_counter()
                ctx.checkpoint(next(ids), level)
                sync.append(ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            for _ in range(args.repeat):
                ctx.comm.Barrier()
                start = time.perf_counter()
                handle = ctx.checkpoint(next(ids), level, wait=False)
                blocked.append(ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
                np.add(data, 1, out=data)  # the application goes on writing its state
                handle.result()
                total.append(ctx.comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
                time.sleep(args.pause)  # --pause: let what the commit left in the background (deletions) finish
            out[level] = [statistics.median(sync), statistics.median(blocked), statistics.median(total),
                          handle.mechanism]
        shutil.rmtree(base, ignore_errors=True)
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def codec(mib: int) -> None:
    """The codec's rows of ``bench_erasure.py`` (k = m = 4, outputs allocated once as ``encode_files``
    does, against a one-thread copy of the same bytes into buffers of the same size)."""
    import bench_erasure

    rows: list = []
    size = max(1, mib // 4) << 20
    opts = argparse.Namespace(repeat=3, numpy_mib=1, files=False, compare=False)
    bench_erasure.bench(4, 4, size, opts, rows)
    print(f"codec k=m=4, blocks of {size >> 20} MiB (GB/s of data, best of 3; vs copy: over a one-thread "
          "np.copyto of the same bytes):")
    for name, threads, best, _median, ratio in rows:
        print(f"  {name[len('k=4 m=4 '):]:<34} threads {threads:>3}  {best:7.2f} GB/s  {ratio:6.3f}x copy")


def launch(mpiexec: str, ranks: int) -> list[str]:
    """The command line that starts ``ranks`` ranks of this script. Through ``python -m mpi4py``: a rank's uncaught
    exception aborts the whole job (MPI_Abort) instead of leaving the other ranks waiting in a collective, and the
    driver waiting for them."""
    return [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", __file__]


def run_workers(mpiexec: str, args: argparse.Namespace, tmp: str, flag: str) -> dict[int, list]:
    """Launch the ranks with ``flag`` (--worker, --worker-async); rank 0's RESULT row per level."""
    proc = subprocess.run([*launch(mpiexec, args.ranks), flag, "--mib",
                           str(args.mib), "--dir", tmp, "--repeat", str(args.repeat), "--group", str(args.group),
                           "--pause", str(args.pause), "--writeback", args.writeback, "--direct-io", args.direct_io,
                           "--levels", *map(str, args.levels)],
                          capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"benchmark failed:\n{proc.stdout}\n{proc.stderr}")
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def report_async(mpiexec: str, args: argparse.Namespace, tmp: str) -> None:
    rows = run_workers(mpiexec, args, tmp, "--worker-async")
    pause = f"; {args.pause} s of pause after each commit" if args.pause else ""
    print(f"asynchronous checkpoints of {args.ranks} ranks x {args.mib} MiB (slowest rank, medians of "
          f"{args.repeat}); the ranks write their whole state right after each call{pause}")
    print(f"level   sync (s)   blocked (s)  blocked/L{min(rows)}'s  blocked/sync   total (s)  total/sync  snapshot")
    first = rows[min(rows)][1]  # L1's unless --levels leaves it out
    for level, (sync, blocked, total, mechanism) in sorted(rows.items()):
        print(f"  L{level}  {sync:9.3f}  {blocked:12.4f}  {blocked / first:12.2f}  {blocked / sync:12.3f}  "
              f"{total:10.3f}  {total / sync:10.2f}  {mechanism}")


def report(mpiexec: str, args: argparse.Namespace, tmp: str) -> None:
    rows = run_workers(mpiexec, args, tmp, "--worker")
    times = {level: row[0] for level, row in rows.items()}
    first = 1 if 1 in times else min(times)  # the ratio column's reference: L1, else the first level run
    total = args.ranks * args.mib
    print(f"checkpoint of {args.ranks} ranks x {args.mib} MiB = {total} MiB (early write-back {args.writeback}, "
          f"direct_io {args.direct_io}; "
          f"slowest rank, best of "
          f"{max(3, args.repeat)}), against a raw tofile+fsync (best of as many) by every rank of the bytes that "
          "level writes; restart with nothing lost into a fresh array against np.fromfile of the rank's file (warm "
          "cache, best of 3; cold: the file evicted, median of 3); in use: a recovery into the array in use, warm:")
    from timing import fresh_rows_note

    if note := fresh_rows_note(args.mib << 20):
        print(note)
    for level, (t, restart, raw, write, cold, cold_raw, rollback) in sorted(rows.items()):
        print(f"  L{level}: {t:7.2f} s  {total / t:8.0f} MiB/s  ({t / times[first]:5.2f} x L{first})  raw write {write:6.2f} s "
              f"({t / write:5.2f} x raw)   restart {restart:6.3f} s, raw read {raw:6.3f} s ({restart / raw:5.2f} x raw)"
              f"   cold restart {cold:6.3f} s, raw read {cold_raw:6.3f} s ({cold / cold_raw:5.2f} x raw)"
              f"   in use {rollback:6.3f} s ({rollback / raw:5.2f} x raw)")
    if args.dcp:
        proc = subprocess.run([*launch(mpiexec, args.ranks), "--worker-dcp", "--mib",
                               str(args.mib), "--dir", tmp, "--changed", str(args.changed),
                               "--group", str(args.group)], capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"benchmark failed:\n{proc.stdout}\n{proc.stderr}")
        print(f"differential checkpoints, {args.changed:g}% of the 16 KiB blocks changed, vs a full checkpoint at the "
              "same level:")
        for level, (full, dcp, changed, total) in sorted(json.loads(line[7:]).items()):
            print(f"  L{level}: full {full:6.2f} s, differential {dcp:6.2f} s ({dcp / full:5.3f}x), "
                  f"{changed}/{total} blocks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="L2/L3 group size, and the number of simulated nodes")
    ap.add_argument("--mib", type=int, default=256, help="MiB protected per rank")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=5, help="rounds per level with --async (medians)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4],
                    help="the levels to time (default all; the x-L1 columns are over the first one given)")
    ap.add_argument("--dcp", action="store_true", help="also time differential L2 and L3 (1%% of blocks changed)")
    ap.add_argument("--changed", type=float, default=1.0, help="with --dcp: %% of the blocks changed (100: all)")
    ap.add_argument("--async", dest="asynchronous", action="store_true",
                    help="time how long asynchronous checkpoints block the ranks, per level, instead")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="with --async: seconds to sleep after each commit, so that the previous checkpoint's "
                         "deletion (a background thread) is over when the next call starts")
    ap.add_argument("--writeback", choices=["on", "off"], default="on",
                    help="off: no early write-back of the rank files (sync_file_range as they are written), every "
                         "byte left to the final fsync as in the raw write: whether early write-back helps or hurts "
                         "when many ranks share a disk")
    ap.add_argument("--direct-io", choices=["on", "off"], default="off",
                    help="the direct_io setting: L1 and L4 rank files written around the page cache (O_DIRECT) or not")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-async", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-dcp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.worker_dcp:
        worker_dcp(args)
        return
    if args.worker_async:
        worker_async(args)
        return
    if args.group < 1 or args.ranks < args.group or args.ranks % args.group:
        # the ranks fill GROUP simulated nodes of RANKS / GROUP ranks each: a remainder would put ranks on a node
        # past the last group, whose L2/L3 partners do not exist (a rank failed, the others waited for it)
        ap.error(f"--ranks ({args.ranks}) must be a multiple of --group ({args.group}): the ranks are placed on "
                 "GROUP simulated nodes of RANKS / GROUP ranks each, one L2/L3 group")
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    tmp = args.dir or tempfile.mkdtemp(prefix="ftidask-bench-")
    try:  # the temporary directory goes on every path: --async's return, a failed run's sys.exit, an interrupt
        if args.asynchronous:
            report_async(mpiexec, args, tmp)
            return
        report(mpiexec, args, tmp)
    finally:
        if args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if 3 in args.levels:  # the codec's rows beside the level that uses it
        codec(min(args.mib, 256))


if __name__ == "__main__":
    main()
