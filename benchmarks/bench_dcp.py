"""Differential checkpointing benchmark: block-hash candidates, then full vs differential checkpoints.

    PYTHONPATH=. python benchmarks/bench_dcp.py [--size-mib 1024] [--block-size 16384] [--dir /tmp/x]

Part 1 times each candidate block hash over 16 KiB blocks (one thread, then the thread pool).
Part 2 writes a full level-1 checkpoint of a ``--size-mib`` state (the baseline), then
differential checkpoints (level 5) after changing 0%, 1%, 10% and 100% of the blocks, scattered
(one element in each chosen block) or contiguous (one region); once with the changed blocks found
by the kernel's write tracking (the default), once by hashing every block (``--tracking``). Before each measured checkpoint
both alternating files are brought up to date (two unmeasured checkpoints), so that the figure
is for exactly the changed fraction, and a full level-1 checkpoint of the same state is timed
right before it: on a shared machine, the ratio of adjacent runs is the stable figure (median of
``--repeat`` pairs; the times shown are the fastest).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

import ftidask
from ftidask.ftiff import blockhash


def _candidates() -> dict[str, Callable[[memoryview], object]]:
    out: dict[str, Callable[[memoryview], object]] = {
        "md5": lambda b: hashlib.md5(b).digest(),
        "crc32 (zlib)": zlib.crc32,
        "xxh3_64": xxhash.xxh3_64_digest,
        "xxh3_128": xxhash.xxh3_128_digest,
        "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
    }
    try:
        import google_crc32c

        out["crc32c (google-crc32c)"] = lambda b: google_crc32c.value(np.frombuffer(b, np.uint8))
    except ImportError:
        pass
    try:
        import crc32c as _crc32c  # what numcodecs' CRC32C codec uses

        out["crc32c (crc32c)"] = _crc32c.crc32c
    except ImportError:
        pass
    try:
        import blake3

        out["blake3"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    return out


def bench_hashes(mib: int, block: int, threads: int) -> None:
    # Read-only bytes: some bindings (google-crc32c) accept nothing else.
    data = memoryview(np.random.default_rng(1).integers(0, 255, size=mib << 20, dtype=np.uint8).tobytes())
    print(f"\n## Block hashes: {mib} MiB in {block}-byte blocks (GiB/s)\n")
    print(f"| hash | 1 thread | {threads} threads |")
    print("|---|---|---|")
    pool = ThreadPoolExecutor(threads)
    step = max(block, (len(data) // (threads * 8)) // block * block)

    def run(fn: Callable[[memoryview], object], lo: int, hi: int) -> None:
        for o in range(lo, hi, block):
            fn(data[o:min(o + block, hi)])

    for name, fn in _candidates().items():
        t = time.perf_counter()
        run(fn, 0, len(data))
        one = len(data) / (time.perf_counter() - t) / 2**30
        t = time.perf_counter()
        list(pool.map(lambda lo, fn=fn: run(fn, lo, min(lo + step, len(data))), range(0, len(data), step)))
        many = len(data) / (time.perf_counter() - t) / 2**30
        print(f"| {name} | {one:.2f} | {many:.2f} |")
    if blockhash.native_kernel():  # what dCP uses: one call per segment, GIL released
        seg = 8 << 20

        def batched(lo: int, hi: int) -> None:
            for o in range(lo, hi, seg):
                blockhash.block_digests(data[o:min(o + seg, hi)], block, xxhash.xxh3_128_digest, 16)

        t = time.perf_counter()
        batched(0, len(data))
        one = len(data) / (time.perf_counter() - t) / 2**30
        t = time.perf_counter()
        list(pool.map(lambda lo: batched(lo, min(lo + step, len(data))), range(0, len(data), step)))
        many = len(data) / (time.perf_counter() - t) / 2**30
        print(f"| xxh3_128, ftidask native kernel (batched) | {one:.2f} | {many:.2f} |")
    pool.shutdown()


def _change(arrays: list[np.ndarray], fraction: float, how: str, block: int, rng: np.random.Generator) -> None:
    for arr in arrays:
        raw = arr.view(np.uint8)
        nblocks = -(-raw.size // block)
        count = round(nblocks * fraction)
        if count == 0:
            continue
        if how == "scattered":
            chosen = rng.choice(nblocks, size=count, replace=False)
            raw[chosen * block] += 1
        else:
            start = int(rng.integers(0, nblocks - count + 1)) * block
            raw[start:start + count * block] += 1


def bench_checkpoints(size_mib: int, block: int, root: Path, repeat: int, tracking: bool) -> None:
    nvars = 4
    per = (size_mib << 20) // nvars // 8
    rng = np.random.default_rng(2)
    arrays = [rng.random(per) for _ in range(nvars)]
    total = sum(a.nbytes for a in arrays)
    ctx = ftidask.init(ckpt_dir=str(root / "l"), glbl_dir=str(root / "g"), meta_dir=str(root / "m"),
                       enable_dcp=1, dcp_block_size=block, verbosity=4, dcp_page_tracking=int(tracking))
    for i, arr in enumerate(arrays):
        ctx.protect(i + 1, arr)
    ckpt = iter(range(1, 10_000))
    how_found = "write tracking (dcp_page_tracking = 1)" if tracking else "hashing everything (dcp_page_tracking = 0)"
    print(f"\n## Checkpoints of a {total / 2**20:.0f} MiB state, {block}-byte blocks, changes found by {how_found}\n")
    print("Each differential checkpoint is timed right after a full level-1 checkpoint of the same state")
    print(f"(the baseline); fastest of {repeat} runs, and the median of the per-run ratios. 'update' is the")
    print("program's own time to make the change (with tracking, it includes the first-write faults).\n")
    print("| changed | pattern | blocks changed | blocks hashed | data written | of full bytes | update (s) | "
          "full (s) | dCP (s) | dCP / full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    spread: list[str] = []
    for fraction in (0.0, 0.01, 0.10, 1.0):
        for how in (("scattered", "contiguous") if 0 < fraction < 1 else ("all",)):
            pairs = []
            updates = []
            for _ in range(repeat):
                ctx.checkpoint(next(ckpt), 5)
                ctx.checkpoint(next(ckpt), 5)
                full = ctx.checkpoint(next(ckpt), 1)  # the spare now holds the current state
                start = time.perf_counter()
                _change(arrays, fraction, "scattered" if how == "all" else how, block, rng)
                updates.append(time.perf_counter() - start)
                pairs.append((full, ctx.checkpoint(next(ckpt), 5)))
            full = min((f for f, _d in pairs), key=lambda i: i.seconds)
            info = min((d for _f, d in pairs), key=lambda i: i.seconds)
            ratio = statistics.median(d.seconds / f.seconds for f, d in pairs)
            print(f"| {fraction:.0%} | {how} | {info.blocks_changed}/{info.blocks_total} | {info.blocks_hashed} | "
                  f"{info.bytes_written / 2**20:.1f} MiB | {info.bytes_written / full.bytes_written:.2%} | "
                  f"{min(updates):.3f} | {full.seconds:.3f} | {info.seconds:.3f} | {ratio:.3f}x |")
            spread.append(f"{fraction:.0%} {how}: " + " ".join(f"{d.seconds / f.seconds:.3f}" for f, d in pairs))
    print("\nEvery run's ratio (the disk is shared: single runs vary):\n")
    for line in spread:
        print(f"    {line}")
    ctx.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="state size (default 1 GiB)")
    parser.add_argument("--block-size", type=int, default=16384, help="dcp_block_size, 512..65535 (default 16384)")
    parser.add_argument("--hash-mib", type=int, default=256, help="bytes hashed per candidate (MiB)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure; the fastest is shown")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--skip-hashes", action="store_true")
    parser.add_argument("--tracking", choices=("both", "on", "off"), default="both",
                        help="find changes with write tracking, by hashing everything, or both tables")
    args = parser.parse_args()
    if not 512 <= args.block_size <= 65535:  # the config's bounds: said here, not as a traceback from init
        parser.error(f"--block-size {args.block_size}: dcp_block_size is 512..65535")
    if not args.skip_hashes:
        bench_hashes(args.hash_mib, 16384, args.threads)
    root = Path(tempfile.mkdtemp(prefix="ftidask-bench-dcp-", dir=args.dir))
    try:
        for tracking in {"both": (True, False), "on": (True,), "off": (False,)}[args.tracking]:
            bench_checkpoints(args.size_mib, args.block_size, root, args.repeat, tracking)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
