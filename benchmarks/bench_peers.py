"""One process: a checkpoint and a cold restart of the same arrays by ftidask and by its peers, one run.

    python benchmarks/bench_peers.py [--size-mib 1024] [--arrays 4] [--repeat 3] [--dir DIR]

Each writer saves every array and makes it durable (fsync of each file it wrote, as ftidask's
checkpoint does; torch.distributed.checkpoint fsyncs by itself); each reader loads them back from a
cold cache (every file evicted with ``posix_fadvise(DONTNEED)`` first) into new arrays, as a
restarting program does. Peers run where installed (``pip install -e '.[bench]'``):

* ``raw``: ``ndarray.tofile`` + fsync, one file per array / ``np.fromfile`` (the baseline, 1.00);
* ``np.save``: one ``.npy`` per array / ``np.load``;
* ``h5py``: one HDF5 file, a dataset per array / ``dataset[...]``;
* ``zarr``: a group, an uncompressed array per array, one chunk each / ``array[...]``;
* ``torch.save``: a dict of tensors sharing the arrays' memory / ``torch.load(weights_only=True)``;
* ``torch dcp``: ``torch.distributed.checkpoint.save`` / ``load`` into preallocated tensors;
* ``ftidask L1``: ``checkpoint(id, 1)`` (every container hashed) / ``recover()`` in a new context
  (every byte verified before the arrays hold it).

Before each load, twice the state's size of memory is touched and freed, so that every tool finds
resident free pages alike (a virtual machine that hands freed memory back to its host otherwise charges
the first-touch of the arrays to whichever tool follows a large free). Rounds interleave the tools (so that a noisy moment of the disk weighs on all alike); each figure
is the median of ``--repeat`` rounds, and ``x raw`` is that tool's time over the raw one.
Only ftidask verifies what it reads; np.save, h5py, zarr and torch read back whatever the file holds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from timing import evict_file

import ftidask

Arrays = list[np.ndarray]


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``."""
    for path in [root, *root.rglob("*")]:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(root: Path) -> None:
    """Every file under ``root`` out of the page cache (written back first)."""
    for path in root.rglob("*"):
        if path.is_file():
            evict_file(path)


def touch_and_free(nbytes: int) -> None:
    """Fault in ``nbytes`` of memory and free it: a virtual machine that gives freed memory back to its host
    pays again to touch it (up to 2 s per GiB on the development machine), so each load starts with the
    same amount of resident free memory, whichever tool ran before it."""
    np.ones(nbytes, np.uint8)


def raw_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    def save(arrays: Arrays, d: Path) -> None:
        for i, a in enumerate(arrays):
            with open(d / f"a{i}.bin", "wb") as fh:
                a.tofile(fh)
                fh.flush()
                os.fsync(fh.fileno())

    def load(like: Arrays, d: Path) -> Arrays:
        return [np.fromfile(d / f"a{i}.bin", a.dtype) for i, a in enumerate(like)]

    return save, load


def npy_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    def save(arrays: Arrays, d: Path) -> None:
        for i, a in enumerate(arrays):
            np.save(d / f"a{i}.npy", a)
        fsync_tree(d)

    def load(like: Arrays, d: Path) -> Arrays:
        return [np.load(d / f"a{i}.npy") for i in range(len(like))]

    return save, load


def h5py_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    import h5py

    def save(arrays: Arrays, d: Path) -> None:
        with h5py.File(d / "state.h5", "w") as f:
            for i, a in enumerate(arrays):
                f.create_dataset(f"a{i}", data=a)
        fsync_tree(d)

    def load(like: Arrays, d: Path) -> Arrays:
        with h5py.File(d / "state.h5", "r") as f:
            return [f[f"a{i}"][...] for i in range(len(like))]

    return save, load


def zarr_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    import zarr

    def save(arrays: Arrays, d: Path) -> None:
        group = zarr.open_group(d / "state.zarr", mode="w")
        for i, a in enumerate(arrays):
            group.create_array(f"a{i}", data=a, chunks=a.shape, compressors=None)
        fsync_tree(d)

    def load(like: Arrays, d: Path) -> Arrays:
        group = zarr.open_group(d / "state.zarr", mode="r")
        return [group[f"a{i}"][...] for i in range(len(like))]

    return save, load


def torch_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    import torch

    def save(arrays: Arrays, d: Path) -> None:
        torch.save({f"a{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}, d / "state.pt")
        fsync_tree(d)

    def load(like: Arrays, d: Path) -> Arrays:
        state = torch.load(d / "state.pt", weights_only=True)
        return [state[f"a{i}"].numpy() for i in range(len(like))]

    return save, load


def dcp_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def save(arrays: Arrays, d: Path) -> None:
        dcp.save({f"a{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}, checkpoint_id=str(d / "dcp"))

    def load(like: Arrays, d: Path) -> Arrays:
        state = {f"a{i}": torch.empty(a.shape, dtype=torch.float64) for i, a in enumerate(like)}
        dcp.load(state, checkpoint_id=str(d / "dcp"))
        return [state[f"a{i}"].numpy() for i in range(len(like))]

    return save, load


def ftidask_tool() -> tuple[Callable[[Arrays, Path], None], Callable[[Arrays, Path], Arrays]]:
    ids = iter(range(1, 1 << 30))

    def dirs(d: Path) -> dict:
        return dict(ckpt_dir=str(d / "L"), glbl_dir=str(d / "G"), meta_dir=str(d / "M"), verbosity=3)

    def save(arrays: Arrays, d: Path) -> None:
        ctx = ftidask.init(**dirs(d))  # a run of its own, left unfinalized: the restart below recovers it
        for i, a in enumerate(arrays):
            ctx.protect(i + 1, a)
        ctx.checkpoint(next(ids), 1)

    def load(like: Arrays, d: Path) -> Arrays:
        ctx = ftidask.init(**dirs(d))
        out = [np.empty_like(a) for a in like]
        for i, a in enumerate(out):
            ctx.protect(i + 1, a)
        ctx.recover()
        _to_finalize.append(ctx)  # after the timing: finalize also removes the checkpoint's files
        return out

    return save, load


_to_finalize: list = []

TOOLS = {"raw": raw_tool, "np.save": npy_tool, "h5py": h5py_tool, "zarr": zarr_tool,
         "torch.save": torch_tool, "torch dcp": dcp_tool, "ftidask L1": ftidask_tool}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--arrays", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    tools = {}
    for name, make in TOOLS.items():
        try:
            tools[name] = make()
        except ImportError as exc:
            print(f"{name}: not installed ({exc.name}), skipped")
    per = args.size_mib * 2**20 // args.arrays // 8
    rng = np.random.default_rng(0)
    arrays = [rng.random(per) for _ in range(args.arrays)]
    nbytes = sum(a.nbytes for a in arrays)
    gib = nbytes / 2**30
    root = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=args.dir))
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in tools}
    try:
        for _ in range(args.repeat):
            for name, (save, load) in tools.items():
                d = root / name.replace(" ", "_")
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
                os.sync()  # no dirty pages of the tool before on this one's time
                start = time.perf_counter()
                save(arrays, d)
                times[name]["save"].append(time.perf_counter() - start)
                evict(d)
                touch_and_free(2 * nbytes)
                start = time.perf_counter()
                back = load(arrays, d)
                times[name]["load"].append(time.perf_counter() - start)
                while _to_finalize:
                    _to_finalize.pop().finalize()
                assert all(np.array_equal(a, b) for a, b in zip(arrays, back, strict=True)), f"{name} read back wrong"
                del back
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: {op: statistics.median(t) for op, t in ops.items()} for name, ops in times.items()}
    print(f"{args.arrays} float64 arrays, {gib * 1024:.0f} MiB; {os.cpu_count()} cores; medians of {args.repeat} "
          "interleaved rounds; cold cache for every load")
    print(f"{'tool':12} {'save s':>8} {'GiB/s':>6} {'x raw':>6}   {'load s':>8} {'GiB/s':>6} {'x raw':>6}")
    for name, m in med.items():
        s, lo = m["save"], m["load"]
        print(f"{name:12} {s:8.3f} {gib / s:6.2f} {s / med['raw']['save']:6.2f}   "
              f"{lo:8.3f} {gib / lo:6.2f} {lo / med['raw']['load']:6.2f}")


if __name__ == "__main__":
    main()
