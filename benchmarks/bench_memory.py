"""Peak extra memory of each checkpoint and recovery path, as a user protecting most of a node's memory sees it.

    python benchmarks/bench_memory.py [--mib 256] [--dir DIR] [--only SUBSTRING ...] [--no-mpi] [--no-dask]

Each path runs in a fresh process (an MPI rank, a Dask worker): its peak resident memory (VmHWM, reset with
``/proc/self/clear_refs`` just before the call measured) minus its resident memory before the protected arrays
existed, minus the protected arrays' bytes. So a path that needs nothing beyond the arrays reports about 0 (the
interpreter's own small allocations aside), and one that holds a copy of the largest array reports its size.
The ratio is that extra over the largest protected array (of the rank or worker: MPI and Dask report the
largest extra of any rank or worker). One process protects two arrays of MIB MiB (one of MIB/2 for Dask
chunks); an MPI rank protects one array of MIB MiB.

Paths: one process, levels 1 and 4 (FTI-FF and Zarr), compressed (zstd), differential (level 5, the third
checkpoint, one block in 25 changed), incremental (iCP), asynchronous (the application idle while it is written); the
recovery of each in a restarted process into arrays in use (touched) and into fresh arrays (``np.empty``), and
``recover_var`` of one array. MPI (4 ranks, 4 simulated nodes, one group): L2 and L3 checkpoints, their
differential levels 6 and 7 (the third checkpoint, every block changed: L7 patches the parity from the deltas), and
a restart that rebuilds rank 1's lost file from its partner copy (L2) or the group's parity (L3). MPI with heads
(``head = 1``, ``inline_l3 = 0``; 2 nodes of a head and an application rank of MIB MiB, one group): level 7's third
checkpoint, every block changed (more than half of a file: the heads encode the parity in full) or 2/5 of the blocks
(the heads patch the parity from the files' differences); the extra is the head's (its peak during the raise over its
resident memory before ``init``: it holds no arrays), the largest of the two. Dask (2 workers):
L1, L3 (a group of 2) and L7 (the third checkpoint, every block changed) checkpoints and their recovery.
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

MIB = 1 << 20
HERE = Path(__file__).resolve()


def status(key: str, pid: str = "self") -> int:
    """A field of /proc/PID/status in bytes (VmHWM, VmRSS)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_hwm(pid: str = "self") -> None:
    """Set VmHWM to the current VmRSS (Linux 4.0+), so the next reading is the peak of what follows."""
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")


# --- one process ---------------------------------------------------------------------------------------

SINGLE = {  # case: (overrides, level, how the checkpoint is made)
    "L1": ({}, 1, "plain"),
    "L4": ({}, 4, "plain"),
    "L4-zarr": ({"l4_format": "zarr"}, 4, "plain"),
    "L1-zstd": ({"compressor": "zstd"}, 1, "plain"),
    "L1-zstd-noise": ({"compressor": "zstd"}, 1, "plain"),  # noise at 2 decimals: zstd stores about a quarter
    "L5-dcp": ({"enable_dcp": 1}, 5, "dcp"),
    "L1-icp": ({}, 1, "icp"),
    "L1-async": ({"async_ckpt": 1}, 1, "async"),
    "L1-kept": ({"keep_last_ckpt": 1}, 1, "finalize"),  # finalize() flushes the L1 checkpoint to level 4
}


def single_arrays(mib: int, fresh: bool = False, changed: bool = False, noise: bool = False):
    """Two arrays of ``mib`` MiB: a ramp (zstd stores about an eighth of it), or ``noise`` at 2 decimals (a quarter);
    ``fresh``: untouched; ``changed``: as the differential case leaves them."""
    import numpy as np

    n = mib * MIB // 8
    if fresh:
        return [np.empty(n), np.empty(n)]
    if noise:
        return [np.round(np.random.default_rng(i).standard_normal(n), 2) for i in range(2)]
    arrays = [np.arange(n, dtype=np.float64) * (i + 1) for i in range(2)]
    if changed:
        change(arrays)
    return arrays


def change(arrays) -> None:
    for a in arrays:
        a[:: 100 * 512] += 1.0  # one double every 400 KiB: one 16 KiB block in 25


def single_child(case: str, phase: str, base: str, mib: int) -> dict:
    import numpy as np

    import ftidask

    overrides, level, how = SINGLE[case]
    dirs = dict(ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", verbosity=4, **overrides)
    rss0 = status("VmRSS")
    ctx = ftidask.init(**dirs)
    if phase == "ckpt":
        arrays = single_arrays(mib, noise="noise" in case)
        for i, a in enumerate(arrays):
            ctx.protect(i + 1, a)
        last = 2
        if how == "finalize":  # measured: the flush of the last checkpoint at finalize()
            ctx.checkpoint(1, level)
        if how == "dcp":  # the measured one is the third, the first with a spare to patch
            ctx.checkpoint(1, level)
            ctx.checkpoint(2, level)
            change(arrays)
            last = 3
        reset_hwm()
        if how == "icp":
            ctx.init_icp(last, level)
            for i in range(len(arrays)):
                ctx.add_var_icp(i + 1)
            ctx.finalize_icp()
        elif how == "finalize":
            ctx.finalize()
        elif how == "async":
            handle = ctx.checkpoint(last, level, wait=False)
            handle.result()
        else:
            ctx.checkpoint(last, level)
        peak = status("VmHWM")  # no finalize(): the checkpoint stays for the recovery cases
        protected = sum(a.nbytes for a in arrays)
        largest = max(a.nbytes for a in arrays)
    else:
        fresh = phase == "rec-fresh"
        arrays = single_arrays(mib, fresh=fresh)
        if not fresh:
            for a in arrays:
                a[:] = -1.0
        for i, a in enumerate(arrays):
            ctx.protect(i + 1, a)
        reset_hwm()
        if phase == "rec-var":
            ctx.recover_var(1)
        else:
            ctx.recover()
        peak = status("VmHWM")
        want = single_arrays(mib, changed=how == "dcp", noise="noise" in case)
        check = arrays[:1] if phase == "rec-var" else arrays
        assert all(np.array_equal(a, w) for a, w in zip(check, want)), "recovered values differ"
        del want
        protected = sum(a.nbytes for a in arrays)
        largest = max(a.nbytes for a in arrays)
    return {"protected": protected, "largest": largest, "extra": peak - rss0 - protected}


# --- MPI -----------------------------------------------------------------------------------------------

def mpi_child(case: str, base: str, mib: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import ftidask

    world = MPI.COMM_WORLD
    heads = case.startswith("L7H")  # L7 raised by the heads: 2 nodes of a head and an application rank
    level = 7 if heads else {"L2": 2, "L3": 3, "L6": 6, "L7": 7}[case.split("-")[0]]
    dirs = dict(comm=world, local_test=1, node_size=1, group_size=4, ckpt_dir=f"{base}/Local",
                glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta", verbosity=int(os.environ.get("BENCH_VERBOSITY", 4)),
                enable_dcp=int(level > 4))
    if heads:
        dirs.update(node_size=2, head=1, inline_l3=0, group_size=world.size // 2)
    rss0 = status("VmRSS")
    before_init = world.allgather((os.getpid(), rss0))  # the heads' too: their baseline
    ctx = ftidask.init(**dirs)
    if heads and ctx.comm is None:  # a head: it served the application ranks until they finalized
        return
    comm = ctx.comm if heads else world
    n = mib * MIB // 8
    want = np.arange(n, dtype=np.float64) + comm.rank
    if heads:  # the measured process is this rank's head, which raises the checkpoint to L3
        topo = ctx.transport.topo
        me = world.rank
        pid, head_rss0 = before_init[next(w for w in range(world.size)
                                          if topo.is_head(w) and topo.node_of[w] == topo.node_of[me])]
        head = str(pid)
        data = want
        ctx.protect(1, data)
        ctx.checkpoint(1, level)
        ctx.checkpoint(2, level)
        ctx.wait_post_processing()
        if case.startswith("L7H40"):  # 2/5 of the blocks: the heads patch the parity from the files' differences
            data[: n * 2 // 5] += 1.0
        else:  # every block: more than half of each file changed, the heads encode the parity in full
            data += 1.0
        comm.Barrier()
        reset_hwm(head)
        ctx.checkpoint(3, level)
        reply = ctx.wait_post_processing()
        assert reply is not None and reply["ok"], reply
        rows = comm.gather({"protected": data.nbytes, "largest": data.nbytes,
                            "extra": status("VmHWM", head) - head_rss0})
        if comm.rank == 0:
            print("RESULT " + json.dumps(max(rows, key=lambda r: r["extra"])), flush=True)
        ctx.finalize()  # the heads end (no restart row: the checkpoints go)
        return
    if case.endswith("ckpt"):
        data = want
        ctx.protect(1, data)
        if level > 4:  # differential: the measured checkpoint is the third (the first with a spare, whose
            ctx.checkpoint(1, level)  # parity L3 patches from the deltas), every block of it changed
            ctx.checkpoint(2, level)
            data += 1.0
        world.Barrier()
        reset_hwm()
        ctx.checkpoint(3, level)
        peak = status("VmHWM")
    else:  # restart: rank 1's own file is gone (the test harness removed it), into fresh arrays
        del want
        data = np.empty(n)
        ctx.protect(1, data)
        world.Barrier()
        reset_hwm()
        ctx.recover()
        peak = status("VmHWM")
        assert np.array_equal(data, np.arange(n, dtype=np.float64) + world.rank + (level > 4))
    extra = peak - rss0 - data.nbytes
    rows = world.gather({"protected": data.nbytes, "largest": data.nbytes, "extra": extra})
    if world.rank == 0:
        print("RESULT " + json.dumps(max(rows, key=lambda r: r["extra"])), flush=True)


def run_mpi(case: str, base: str, mib: int, ranks: int = 4) -> dict:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    # python -m mpi4py: a rank's uncaught exception aborts the job, not leaving the others in a collective
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(HERE), "--mpi-child", case, "--dir", base,
           "--mib", str(mib)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))


def drop_rank_file(base: str, rank: int) -> None:
    """Remove rank ``rank``'s own checkpoint file(s): the restart rebuilds it from the level's redundancy."""
    for path in Path(base, "Local").rglob(f"Ckpt*-Rank{rank}.fti"):
        path.unlink()


# --- Dask ----------------------------------------------------------------------------------------------

def dask_child(case: str, base: str, mib: int) -> dict:
    import dask.array as da
    import numpy as np
    from distributed import Client, LocalCluster, wait

    import ftidask

    level = int(case[1])
    dcp = level > 4  # the third checkpoint, every block changed: L7 patches the parity from the deltas
    dirs = dict(ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta", group_size=2,
                verbosity=4, **({"compressor": "zstd"} if "zstd" in case else {}),
                **({"enable_dcp": 1} if dcp else {}))
    chunk = mib * MIB // 2 // 8  # chunks of MIB/2 MiB, MIB MiB per worker
    with LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=0, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        def rss(dask_worker=None) -> list[int]:
            held = sum(getattr(v, "nbytes", 0) for v in dask_worker.data.values()) if dask_worker else 0
            return [status("VmRSS"), held]

        def hwm() -> int:
            return status("VmHWM")

        ctx = ftidask.init(client=client, **dirs)
        if case.endswith("ckpt"):
            x = da.arange(4 * chunk, chunks=chunk, dtype=np.float64).persist()
            wait(x)  # the chunks in the workers' memory before the measure
            ctx.protect(1, x)
            if dcp:
                ctx.checkpoint(1, level)
                ctx.checkpoint(2, level)
                x = (x + 1).persist()
                wait(x)
                ctx.protect(1, x)
                for _ in range(50):  # the first chunks released: a worker holds its two new ones only
                    if all(held <= 2 * chunk * 8 for _rss, held in client.run(rss).values()):
                        break
                    time.sleep(0.1)
            before = client.run(rss)
            client.run(reset_hwm)
            ctx.checkpoint(3 if dcp else 1, level)
        else:
            before = client.run(rss)
            client.run(reset_hwm)
            out = ctx.recover()
            x = out[1]
        peaks = client.run(hwm)
        after = client.run(rss)
        if not case.endswith("ckpt"):
            assert float(x[-1].compute()) == 4 * chunk - 1 + dcp
        rows = []
        for addr, (rss_before, held_before) in before.items():
            if case.endswith("ckpt"):  # the chunks are in the worker's RSS already (after it, aliased: counted twice)
                held, extra = held_before, peaks[addr] - rss_before
            else:  # a recovery adds them
                held = after[addr][1]
                extra = peaks[addr] - rss_before - held
            rows.append({"protected": held, "largest": chunk * 8, "extra": extra})
        return max(rows, key=lambda r: r["extra"])


# --- driver --------------------------------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    kind, case, phase = args.child
    out = single_child(case, phase, args.dir, args.mib) if kind == "single" else dask_child(case, args.dir, args.mib)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(kind: str, case: str, phase: str, base: str, mib: int) -> dict:
    cmd = [sys.executable, str(HERE), "--child", kind, case, phase, "--dir", base, "--mib", str(mib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{kind} {case} {phase} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))


def groups(args: argparse.Namespace):
    """(directory, [(row name, thunk)]) of every path: a checkpoint, then the recoveries that read it."""
    root = Path(args.dir)
    for case in SINGLE:
        base = str(root / f"single-{case}")
        what = "finalize" if SINGLE[case][2] == "finalize" else "checkpoint"
        rows = [(f"{case} {what}", lambda c=case, b=base: run_child("single", c, "ckpt", b, args.mib))]
        for phase, label in (("rec-inuse", "recover, arrays in use"), ("rec-fresh", "recover, fresh arrays"),
                             ("rec-var", "recover_var(1), in use")):
            rows.append((f"{case} {label}", lambda c=case, p=phase, b=base: run_child("single", c, p, b, args.mib)))
        yield base, rows
    if not args.no_mpi:
        for level in ("L2", "L3", "L6", "L7"):
            base = str(root / f"mpi-{level}")
            what = " (dCP, all changed)" if level in ("L6", "L7") else ""
            yield base, [(f"MPI {level} checkpoint{what} (4 ranks)", lambda lv=level, b=base: run_mpi(f"{lv}-ckpt", b, args.mib)),
                         (f"MPI {level} restart, rank 1's file rebuilt",
                          lambda lv=level, b=base: (drop_rank_file(b, 1), run_mpi(f"{lv}-rec", b, args.mib))[1])]
        for case, what in (("L7H", "all changed: encoded in full"), ("L7H40", "2/5 changed: patched")):
            base = str(root / f"mpi-{case}")
            yield base, [(f"MPI L7 heads checkpoint ({what}; a head)",
                          lambda c=case, b=base: run_mpi(f"{c}-ckpt", b, args.mib, ranks=4))]
    if not args.no_dask:
        for level in ("L1", "L3", "L1-zstd", "L7"):
            base = str(root / f"dask-{level}")
            what = " (dCP, all changed)" if level == "L7" else ""
            yield base, [(f"Dask {level} checkpoint{what} (2 workers)",
                          lambda lv=level, b=base: run_child("dask", f"{lv}-ckpt", "", b, args.mib)),
                         (f"Dask {level} recover (2 workers)",
                          lambda lv=level, b=base: run_child("dask", f"{lv}-rec", "", b, args.mib))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB per protected array")
    parser.add_argument("--dir", default=None, help="where the paths write (default: a temporary directory, removed)")
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these")
    parser.add_argument("--no-mpi", action="store_true")
    parser.add_argument("--no-dask", action="store_true")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--mpi-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.mpi_child:
        return mpi_child(args.mpi_child, args.dir, args.mib)
    own_dir = args.dir is None  # a fixed default (/tmp/benchmem) was shared by every user and run, and kept
    args.dir = args.dir or tempfile.mkdtemp(prefix="ftidask-benchmem-")
    print(f"{'path':<44} {'protected MiB':>13} {'largest MiB':>11} {'peak extra MiB':>14} {'ratio':>6}")
    wanted = (lambda name: not args.only or any(s in name for s in args.only))
    try:
        for base, rows in groups(args):
            if not any(wanted(name) for name, _ in rows):
                continue
            shutil.rmtree(base, ignore_errors=True)  # each checkpoint starts from an empty directory
            try:
                last = max(i for i, (name, _) in enumerate(rows) if wanted(name))
                for name, thunk in rows[: last + 1]:  # the checkpoint runs whenever a recovery of it is wanted
                    row = thunk()
                    if wanted(name):
                        print(f"{name:<44} {row['protected'] / MIB:>13.0f} {row['largest'] / MIB:>11.0f} "
                              f"{row['extra'] / MIB:>14.1f} {row['extra'] / row['largest']:>6.2f}", flush=True)
            finally:  # a failed path's checkpoint goes too
                shutil.rmtree(base, ignore_errors=True)
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
