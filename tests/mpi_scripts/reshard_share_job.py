"""Rank script: a split that cuts old containers (2 ranks onto 3) where each container two new ranks need is hashed
by one of them only (tests/test_mpi_reshard_share.py).

usage: reshard_share_job.py write BASE           (2 ranks) an L1 checkpoint of two global arrays, then ends
       reshard_share_job.py recover BASE         (3 ranks) recovers: variable 1 into arrays in use, variable 2 into
                                                 fresh ones
       reshard_share_job.py damaged BASE         (3 ranks) as recover, after a byte of old rank 0's file that only new
                                                 rank 1 reads was flipped (then put back, and recover again)
       reshard_share_job.py othernode BASE       (3 ranks) as recover, rank 1 seeing the files on another device number
                                                 (as another node may number a shared file system): the test seam
                                                 patches the identity its process gives files
Each rank writes ``BASE/result-<rank>.json``: the bytes of container data it hashed (every way a reshard hashes them:
counted around the functions), the first recovery's outcome, whether the arrays were left untouched by a failed one,
whether the last recovery filled both exactly.
"""

import json
import sys
from pathlib import Path

import numpy as np
from reshard_load_job import block, dirs, write  # the same directories, 1-D blocks and checkpoint

import ftidask
from ftidask.ftiff import readhash, verify
from ftidask.ftiff.reader import parse_ftiff

N1, N2 = 3 << 14, 3 << 18  # float64 in all: variable 1 (in use) 384 KiB, variable 2 (fresh) 6 MiB
HASHED: list[int] = []


def glob(vid: int) -> np.ndarray:
    return np.arange(N1, dtype=np.float64) * -2 if vid == 1 else np.arange(N2, dtype=np.float64) / 3


def count_hashing() -> None:
    """Count the bytes every hashing read of container data covers (whole containers, runs hashed as read)."""
    whole, run = verify.container_problem, readhash.read_hashed

    def container_problem(fd, parsed, meta, *args, **kwargs):
        HASHED.append(meta.chunksize)
        return whole(fd, parsed, meta, *args, **kwargs)

    def read_hashed(fd, offset, view, hash_id):
        HASHED.append(len(view))
        return run(fd, offset, view, hash_id)

    verify.container_problem, readhash.read_hashed = container_problem, read_hashed


def flip_in_rank1_part(base: str) -> tuple[Path, bytes]:
    """Flip a byte of variable 2 in old rank 0's file that only new rank 1 reads (old rank 0 held [0, N2/2), new rank
    1 takes [N2/3, 2 N2/3)); the file's bytes before."""
    (path,) = Path(base, "Local").rglob("Ckpt1-Rank0.fti")
    saved = path.read_bytes()
    with open(path, "rb") as fh:
        parsed = parse_ftiff(fh, str(path))
    (meta,) = [m for _b, _c, m in parsed.containers_of((2,)) if m.id == 2]
    at = meta.fptr + (N2 * 5 // 12) * 8 - meta.dptr  # element 5 N2 / 12: inside new rank 1's block
    data = bytearray(saved)
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    return path, saved


def other_device() -> None:
    """This process sees every file on another device number (the identity its parses record and its reads check)."""
    from ftidask.ftiff import parsedfile, reader

    real = parsedfile.identity_of

    def identity_of(stat):
        dev, *rest = real(stat)
        return (dev + 1, *rest)

    parsedfile.identity_of = reader.identity_of = identity_of


def recover(base: str, damaged: bool, othernode: bool = False) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ctx = ftidask.init(comm=comm, **dirs(base))
    lo2, hi2 = block(comm.rank, comm.size, N2)
    fresh = np.empty(hi2 - lo2)
    ctx.protect(2, fresh, global_shape=(N2,), offset=(lo2,))
    lo1, hi1 = block(comm.rank, comm.size, N1)
    arr = np.full(hi1 - lo1, -1.0)  # in use
    ctx.protect(1, arr, global_shape=(N1,), offset=(lo1,))
    count_hashing()
    if othernode and comm.rank == 1:
        other_device()
    result = {}
    saved = None
    if damaged:
        comm.barrier()
        if comm.rank == 0:
            saved = flip_in_rank1_part(base)
        comm.barrier()
        try:
            ctx.recover()
            result["first"] = "recovered"
        except ftidask.FTIError as exc:
            result["first"] = f"{type(exc).__name__}: {exc}"
        result["untouched"] = bool((arr == -1.0).all())
        comm.barrier()
        if saved is not None:
            saved[0].write_bytes(saved[1])
        comm.barrier()
        HASHED.clear()
    ctx.recover()
    result["hashed"] = sum(HASHED)
    result["exact"] = (arr.tobytes() == glob(1)[lo1:hi1].tobytes() and fresh.tobytes() == glob(2)[lo2:hi2].tobytes())
    ctx._close()
    with open(f"{base}/result-{comm.rank}.json", "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    mode, base = sys.argv[1], sys.argv[2]
    write(base, {1: glob(1), 2: glob(2)}) if mode == "write" else recover(base, mode == "damaged", mode == "othernode")
