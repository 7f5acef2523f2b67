"""Rank script: write checkpoints on one number of ranks, recover them on another (issue 18).

usage: reshard_job.py write BASE          (on 4 ranks) writes BASE/l1, BASE/l4 (declared) and BASE/undeclared
       reshard_job.py recover BASE NAME.. (on M ranks) recovers each named run directory in turn
       reshard_job.py finish BASE NAME..  (on M ranks) recovers each, checkpoints at L1 and finalizes
Each rank writes ``BASE/result-<M>-<rank>.json``: per run, "ok" and a check of every block, or the error.
The reference: global arrays built from indices, so every rank knows every block's expected bytes.
"""

import json
import sys

import numpy as np

import ftidask

G1 = 103            # 1-D, float64, C
G2 = (10, 14)       # 2-D, int32, C
G3 = (9, 11)        # 2-D, float32, Fortran order
GRIDS = {2: (2, 1), 3: (1, 3), 4: (2, 2), 8: (4, 2), 16: (4, 4)}


def globals_() -> dict[int, np.ndarray]:
    return {1: np.arange(G1) * 1.5 - 7,
            2: np.arange(np.prod(G2), dtype=np.int32).reshape(G2) * 3 - 50,
            3: np.asfortranarray(np.arange(np.prod(G3), dtype=np.float32).reshape(G3) / 7),
            4: np.linspace(0, 1, 7),  # replicated
            5: np.arange(G1 * 2, dtype=np.int64) // 3}  # 1-D, compressed


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    edges = [n * k // parts for k in range(parts + 1)]
    return edges[i], edges[i + 1] - edges[i]


def blocks(rank: int, size: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """var id -> (offset, shape) of this rank's block."""
    px, py = GRIDS[size]
    i, j = divmod(rank, py)
    o1, n1 = split(G1, size, rank)
    out = {1: ((o1,), (n1,)), 5: ((2 * o1,), (2 * n1,))}
    for vid, g in ((2, G2), (3, G3)):
        a, na = split(g[0], px, i)
        b, nb = split(g[1], py, j)
        out[vid] = ((a, b), (na, nb))
    return out


def block_of(glob: np.ndarray, offset, shape) -> np.ndarray:
    part = glob[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return np.asfortranarray(part) if glob.flags.f_contiguous and glob.ndim > 1 else np.array(part)


#: Runs whose files are not plain FTI-FF: differential (L5 = dCP L1) and level 4 as Zarr.
CONFIG = {"dcp": {"enable_dcp": 1}, "l4zarr": {"l4_format": "zarr"}}


def dirs(base: str, name: str) -> dict:
    """NAME or NAME:K (K processes per simulated node: another node layout)."""
    name, _, node_size = name.partition(":")
    return {"ckpt_dir": f"{base}/{name}/Local", "glbl_dir": f"{base}/{name}/Global",
            "meta_dir": f"{base}/{name}/Meta", "local_test": 1, "verbosity": 4, "node_size": int(node_size or 1),
            **CONFIG.get(name.split("_")[0], {})}


def protect_all(ctx, comm, declared: bool, fill: bool) -> dict[int, np.ndarray]:
    glob = globals_()
    arrays = {}
    for vid, (offset, shape) in blocks(comm.rank, comm.size).items():
        arr = block_of(glob[vid], offset, shape)
        if not fill:
            arr[...] = -1
        arrays[vid] = arr
        kw = {"global_shape": glob[vid].shape, "offset": offset} if declared else {}
        if declared and vid == 2:
            kw = {"global_shape": ftidask.Block(glob[vid].shape, offset)}
        ctx.protect(vid, arr, compressor="zstd" if vid == 5 else None, **kw)
    arrays[4] = glob[4].copy() if fill else np.full(7, -1.0)
    ctx.protect(4, arrays[4], replicated=declared)
    return arrays


def write(base: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for name, level, declared in (("l1", 1, True), ("l2", 2, True), ("l3", 3, True), ("l4", 4, True),
                                  ("dcp", 5, True), ("l4zarr", 4, True), ("undeclared", 1, False)):
        ctx = ftidask.init(comm=comm, **dirs(base, name))
        arrays = protect_all(ctx, comm, declared, True)
        if level == 5:  # a first differential checkpoint, then one that writes only what changed
            keep = {vid: a.copy() for vid, a in arrays.items()}
            for a in arrays.values():
                a[...] = 0
            ctx.checkpoint(1, level)
            for vid, a in arrays.items():
                a[...] = keep[vid]
            ctx.checkpoint(2, level)
        else:
            ctx.checkpoint(1, level)
        ctx._close()  # as if the job died: the checkpoint stays


def recover(base: str, names: list[str]) -> None:
    from mpi4py import (
        MPI,  # here, so that the tests can import the reference arrays without MPI
    )

    comm = MPI.COMM_WORLD
    glob = globals_()
    result = {}
    for name in names:
        ctx = ftidask.init(comm=comm, **dirs(base, name))
        arrays = protect_all(ctx, comm, not name.startswith("undeclared"), False)
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            untouched = all(bool(np.all(a == -1)) for a in arrays.values())
            result[name] = {"error": type(exc).__name__, "message": str(exc), "untouched": untouched}
            try:  # sizes stored on another layout are not this rank's: refused too, saying why
                ctx.stored_size(1)
            except ftidask.FTIError as exc2:
                result[name]["stored_size"] = str(exc2)
        else:
            expect = {vid: block_of(glob[vid], *ob) for vid, ob in blocks(comm.rank, comm.size).items()}
            expect[4] = glob[4]
            result[name] = {"ok": True, "equal": {str(v): bool(a.tobytes() == expect[v].tobytes()
                                                              and a.shape == expect[v].shape)
                                                  for v, a in arrays.items()},
                            "from": list(ctx.recovered_from)}
        ctx._close()
    with open(f"{base}/result-{comm.size}-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


def finish(base: str, names: list[str]) -> None:
    """Go on after the restart: a new L1 checkpoint (retiring the old L1 one), then finalize (removing the rest)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for name in names:
        ctx = ftidask.init(comm=comm, **dirs(base, name))
        protect_all(ctx, comm, True, False)
        ctx.recover()
        ctx.checkpoint(2, 1)
        ctx.finalize()


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "finish":
        finish(sys.argv[2], sys.argv[3:])
    else:
        recover(sys.argv[2], sys.argv[3:])
