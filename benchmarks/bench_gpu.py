"""A CuPy array on the GPU checkpointed and recovered, against what a program does without ftidask, one run.

    python benchmarks/bench_gpu.py [--gib 4] [--repeat 3] [--dir DIR]

Needs CuPy and a CUDA device (torch for its row, where installed). A float32 array of ``--gib`` GiB, medians of
``--repeat`` interleaved rounds, every write fsync'd, every read from a cold cache (the file evicted):

* checkpoint: ftidask's L1 checkpoint of the device array against a raw host write of the same bytes (host array
  ``tofile`` + ``fsync``; the target of issue 19: at most 1.05x) and against ``torch.save`` of the same CUDA tensor
  (shared through DLPack) + ``fsync``;
* asynchronous checkpoint: how long ``checkpoint(wait=False)`` blocks against a device-to-host copy into a pinned
  host buffer made beforehand (target: at most 1.5x);
* recovery: ftidask's verified ``recover()`` into the device array against a raw read (``np.fromfile``) and its
  upload (``cupy.asarray``);
* differential checkpoint (level 5) after 1% of the array's 16 KiB blocks changed: the bytes that crossed the bus
  (the device's block digests pick them) against the array's, and its time against a full level-5 checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from timing import evict_file, timed

import ftidask
from ftidask.engine import device, devicehash


def fsynced(path: str, write) -> None:
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    try:
        import cupy
    except ImportError:  # as bench_peers.py and bench_async.py do for a missing peer: nothing to time here
        print("skipped: CuPy is not installed (pip install 'ftidask[gpu-cuda12]' or 'ftidask[gpu-cuda13]')")
        return

    try:
        import torch
    except ImportError:
        torch = None
    base = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
    n = int(args.gib * (1 << 30)) // 4
    a = cupy.random.default_rng(0).random(n, dtype=cupy.float32)
    host = a.get()
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(a.nbytes), np.float32, n)
    props = cupy.cuda.runtime.getDeviceProperties(a.device.id)
    print(f"ftidask {ftidask.__version__}; {props['name'].decode()}; {os.cpu_count()} cores; "
          f"array {a.nbytes / 2**30:.2f} GiB float32; files under {base}")
    ctx = ftidask.init(ckpt_dir=f"{base}/L", glbl_dir=f"{base}/G", meta_dir=f"{base}/M", verbosity=3)
    ctx.protect(1, a)
    ids = iter(range(1, 10000))
    ctx.checkpoint(next(ids), 1)  # warm-up: the host copy's pages, the pinned buffers, the writer's threads
    raw_path = f"{base}/raw.bin"
    m: dict[str, list[float]] = {k: [] for k in ("raw", "ckpt", "torch", "d2h", "blocked", "total", "read_up",
                                                 "recover")}
    tensor = torch.from_dlpack(a) if torch is not None else None
    for _ in range(args.repeat):
        os.sync()
        m["raw"].append(timed(lambda: fsynced(raw_path, host.tofile)))
        os.sync()
        m["ckpt"].append(timed(lambda: ctx.checkpoint(next(ids), 1)))
        if tensor is not None:
            os.sync()
            m["torch"].append(timed(lambda: fsynced(f"{base}/t.pt", lambda fh: torch.save(tensor, fh))))
        m["d2h"].append(timed(lambda: (a.get(out=pinned), cupy.cuda.Device(a.device.id).synchronize())))
        os.sync()
        start = time.perf_counter()
        handle = ctx.checkpoint(next(ids), 1, wait=False)
        m["blocked"].append(time.perf_counter() - start)
        handle.result()
        m["total"].append(time.perf_counter() - start)
        evict_file(raw_path)
        m["read_up"].append(timed(lambda: (cupy.asarray(np.fromfile(raw_path, np.float32)),
                                           cupy.cuda.Device(a.device.id).synchronize())))
        for path in glob.glob(f"{base}/L/**/*.fti", recursive=True):
            evict_file(path)
        m["recover"].append(timed(ctx.recover))
    assert cupy.array_equal(a, cupy.asarray(host))
    ctx.finalize()
    dcp = differential(cupy, a, base, args.repeat)
    med = {k: statistics.median(v) for k, v in m.items() if v}
    gib = a.nbytes / 2**30
    print(f"operation                                  seconds   GiB/s  ratio (medians of {args.repeat})")
    print(f"raw host write (tofile + fsync)           {med['raw']:8.3f} {gib / med['raw']:7.2f}   1.00")
    print(f"ftidask L1 checkpoint of the device array {med['ckpt']:8.3f} {gib / med['ckpt']:7.2f} "
          f"{med['ckpt'] / med['raw']:6.2f}x raw write (target <= 1.05x)")
    if "torch" in med:
        print(f"torch.save of the CUDA tensor + fsync     {med['torch']:8.3f} {gib / med['torch']:7.2f} "
              f"{med['torch'] / med['raw']:6.2f}x raw write; ftidask {med['ckpt'] / med['torch']:.2f}x torch.save")
    print(f"pinned device-to-host copy                {med['d2h']:8.3f} {gib / med['d2h']:7.2f}   1.00")
    print(f"ftidask async checkpoint, blocked         {med['blocked']:8.3f} {gib / med['blocked']:7.2f} "
          f"{med['blocked'] / med['d2h']:6.2f}x the pinned copy (target <= 1.5x)")
    print(f"ftidask async checkpoint, total           {med['total']:8.3f} {gib / med['total']:7.2f} "
          f"{med['total'] / med['ckpt']:6.2f}x the sync checkpoint")
    print(f"raw read (cold) + upload                  {med['read_up']:8.3f} {gib / med['read_up']:7.2f}   1.00")
    print(f"ftidask recover (cold, verified)          {med['recover']:8.3f} {gib / med['recover']:7.2f} "
          f"{med['recover'] / med['read_up']:6.2f}x read + upload")
    print(f"level-5 checkpoint, every block new       {dcp['full']:8.3f}")
    print(f"level-5 checkpoint, 1% of blocks changed  {dcp['dcp']:8.3f}         {dcp['dcp'] / dcp['full']:6.2f}x the "
          f"full one; {dcp['bus'] / a.nbytes:.2%} of the array's bytes crossed the bus (target: about 1%)")
    shutil.rmtree(base, ignore_errors=True)


def differential(cupy, a, base: str, repeat: int) -> dict[str, float]:
    """Medians of ``repeat`` rounds: a level-5 checkpoint after every block changed, then one after 1% of the blocks
    changed (bytes over the bus: the device module's count)."""
    ctx = ftidask.init(ckpt_dir=f"{base}/DL", glbl_dir=f"{base}/DG", meta_dir=f"{base}/DM", verbosity=3,
                       enable_dcp=1)
    ctx.protect(1, a)
    ids = iter(range(1, 10000))
    ctx.checkpoint(next(ids), 5)
    blocks = a.nbytes // devicehash.BLOCK
    rng = np.random.default_rng(1)
    full, dcp, bus = [], [], []
    for _ in range(repeat):
        a += 1
        os.sync()
        full.append(timed(lambda: ctx.checkpoint(next(ids), 5)))
        picked = cupy.asarray(rng.choice(blocks, max(1, blocks // 100), replace=False) * (devicehash.BLOCK // 4))
        a[picked] += 1
        os.sync()
        before = device.stats["d2h_bytes"]
        dcp.append(timed(lambda: ctx.checkpoint(next(ids), 5)))
        bus.append(device.stats["d2h_bytes"] - before)
    ctx.finalize()
    return {"full": statistics.median(full), "dcp": statistics.median(dcp), "bus": statistics.median(bus)}


if __name__ == "__main__":
    main()
