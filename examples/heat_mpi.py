"""Heat diffusion on a 2-D grid with MPI halo exchange, made resilient by ftidask.

Each rank owns a band of rows plus one halo row above and below; every iteration exchanges
halos with its neighbours (on ``ctx.comm``, FTI_COMM_WORLD's role) and does a Jacobi step.
``@ftidask.resilient`` checkpoints the band every ``--every`` iterations at ``--level``,
resumes after a crash, and checkpoints and exits cleanly on SIGTERM/SIGUSR1.

    mpiexec -n 4 python examples/heat_mpi.py --dir /tmp/heat --iters 500 --every 50 --level 3

Run it again after a crash (or a kill) with the same arguments: it continues where the last
checkpoint was taken, and ends with the same checksum as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
from mpi4py import MPI

import ftidask


def halo_exchange(comm: MPI.Comm, u: np.ndarray) -> None:
    """Send my first/last interior rows to my neighbours, receive their rows into my halos."""
    up = comm.rank - 1 if comm.rank > 0 else MPI.PROC_NULL
    down = comm.rank + 1 if comm.rank < comm.size - 1 else MPI.PROC_NULL
    comm.Sendrecv(u[1], dest=up, sendtag=1, recvbuf=u[-1], source=down, recvtag=1)
    comm.Sendrecv(u[-2], dest=down, sendtag=2, recvbuf=u[0], source=up, recvtag=2)


def jacobi(u: np.ndarray, top: bool, bottom: bool) -> None:
    """One Jacobi step on the interior, in place (global edges are fixed)."""
    new = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
    lo = 1 if top else 0  # the global first row stays at its boundary value
    hi = new.shape[0] - (1 if bottom else 0)
    u[1 + lo:1 + hi, 1:-1] = new[lo:hi]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where checkpoints go (Local/, Global/, Meta/ inside)")
    ap.add_argument("--config", default=None, help="an FTI-style config file (the --dir paths win)")
    ap.add_argument("--rows", type=int, default=64, help="rows per rank")
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--node-size", type=int, default=1, help="simulated node size (local_test)")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="random heat added per iteration (a numpy Generator, checkpointed by the loop)")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per iteration (to watch signals work)")
    args = ap.parse_args()

    overrides = {"ckpt_dir": f"{args.dir}/Local", "glbl_dir": f"{args.dir}/Global", "meta_dir": f"{args.dir}/Meta",
                 "local_test": 1, "node_size": args.node_size, "verbosity": 3}
    if args.config is None:  # the largest FTI group (up to 4 nodes) that divides the nodes
        nnodes = max(1, MPI.COMM_WORLD.size // args.node_size)
        overrides["group_size"] = next(g for g in (4, 3, 2, 1) if nnodes % g == 0)
    with ftidask.init(args.config, comm=MPI.COMM_WORLD, **overrides) as ctx:
        comm = ctx.comm
        u = np.zeros((args.rows + 2, args.cols))
        if comm.rank == 0:
            u[1, :] = 100.0  # the hot edge
        top, bottom = comm.rank == 0, comm.rank == comm.size - 1
        first = [True]  # print the first iteration run (shows where a restart resumed)
        rng = np.random.default_rng(1000 + comm.rank)  # its state comes back on a restart (rng= below)

        @ftidask.resilient(ctx, arrays={1: u}, every=args.every, level=args.level, iterations=args.iters,
                           rng=rng)
        def step(i: int) -> None:
            if comm.rank == 0 and (i == 0 or i % 10 == 0 or first[0]):
                restart = ""
                if first[0] and ctx.recovered_from is not None:  # say where a restart resumed
                    restart = f" (restart: recovered checkpoint {ctx.recovered_from[0]} at level {ctx.recovered_from[1]})"
                first[0] = False
                print(f"iteration {i}{restart}", flush=True)
            halo_exchange(comm, u)
            jacobi(u, top, bottom)
            if args.noise:
                u[1:-1] += args.noise * rng.random(u[1:-1].shape)
            if args.sleep:
                time.sleep(args.sleep)

        step()
        interior = np.ascontiguousarray(u[1:-1])
        full = np.empty((comm.size, *interior.shape)) if comm.rank == 0 else None
        comm.Gather(interior, full, root=0)
        if comm.rank == 0:
            assert full is not None
            print(f"done iterations={args.iters} checksum={hashlib.sha256(full.tobytes()).hexdigest()} "
                  f"mean={full.mean():.6f}", flush=True)


if __name__ == "__main__":
    main()
