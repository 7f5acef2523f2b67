"""Run under mpiexec by test_fti_mpiio.py: FTI's MPI-IO level-4 file written with MPI-IO as FTI_InitMPIO and
FTI_WriteMPIOData do (src/IO/mpio.c: MPI_Allgather of every rank's checkpoint size on the communicator, the part at
the sum of the sizes of the ranks before, MPI_File_write_at of each variable in protection order), the meta files as
FTI_WriteMetadata writes them (a group of 2 per file, FTI_Checksum's MD5 of the variables); then each rank fills its
arrays with ``recover_file(path, meta=...)``, the rank being the context's own, and reads its neighbour's part with
``rank=``. Prints, on rank 0, a JSON list of each rank's result."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.ftiff.fti_mpiio import read_mpiio

EXEC = "2022-01-02_03-04-05"


def variables(rank: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return {0: np.arange(5 + 3 * rank, dtype="<i4"), 9: rng.random((rank + 1, 4)), 4: rng.bytes(11 * rank + 3)}


def as_array(value) -> np.ndarray:
    return np.frombuffer(value, "u1").copy() if isinstance(value, bytes) else value


def main(base: Path) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    data, meta = base / f"Global/{EXEC}/l4", base / f"Meta/{EXEC}/l4"
    if rank == 0:
        data.mkdir(parents=True)
        meta.mkdir(parents=True)
    comm.Barrier()
    mine = {vid: as_array(v) for vid, v in variables(rank).items()}
    ckpt_size = sum(a.nbytes for a in mine.values())
    sizes = comm.allgather(ckpt_size)
    offset = sum(sizes[:rank])  # FTI_InitMPIO: for (i = 0; i < splitRank; i++) offset += chunkSizes[i]
    fh = MPI.File.Open(comm, str(data / "Ckpt3-mpiio.fti"), MPI.MODE_WRONLY | MPI.MODE_CREATE)
    for array in mine.values():
        fh.Write_at(offset, np.ascontiguousarray(array).view("u1").reshape(-1))
        offset += array.nbytes
    fh.Close()
    md5 = hashlib.md5(b"".join(a.tobytes() for a in mine.values())).hexdigest()
    section = [("ckpt_file_name", f"Ckpt3-Rank{rank}.fti"), ("ckpt_file_size", ckpt_size),
               ("ckpt_file_maxs", ckpt_size), ("ckpt_checksum", md5)]
    for j, (vid, a) in enumerate(mine.items()):
        section += [(f"var{j}_id", vid), (f"var{j}_size", a.nbytes)]
    sections = comm.gather(section, root=0)
    if rank == 0:
        for g in range(0, size, 2):
            text = "".join(f"\n[{i}]\n" + "".join(f"{k:<30} = {v}\n" for k, v in sections[g + i])
                           for i in range(min(2, size - g)))
            (meta / f"sector0-group{g // 2}.fti").write_text(text + "\n")
    comm.Barrier()
    ctx = ftidask.init(comm=comm, ckpt_dir=f"{base}/Local", glbl_dir=f"{base}/Global", meta_dir=f"{base}/Meta",
                       local_test=1, node_size=1, group_size=2, verbosity=3)
    arrays = {vid: np.zeros_like(a) for vid, a in mine.items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    ctx.recover_file(data / "Ckpt3-mpiio.fti", meta=meta)  # this context's rank
    exact = all(arrays[vid].tobytes() == a.tobytes() for vid, a in mine.items())
    neighbour = (rank + 1) % size
    part = read_mpiio(data / "Ckpt3-mpiio.fti", meta, neighbour)
    other = {vid: bytes(b) for vid, b in part.data.items()}
    exact_neighbour = other == {vid: as_array(v).tobytes() for vid, v in variables(neighbour).items()}
    ctx.finalize()
    results = comm.gather({"rank": rank, "exact": exact, "neighbour": exact_neighbour}, root=0)
    if rank == 0:
        print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
