"""Rank script of tests/test_itf_matrix.py: the applications of FTI's ITF suites, on ftidask.

usage: itf_job.py seq CONFIG_JSON DIR END LEVEL [LEVEL ...]    checkpoints 1, 2, ... at these levels, then END
       itf_job.py recover CONFIG_JSON DIR END                   recover (report), then END
       itf_job.py keepl4 CONFIG_JSON DIR                        FTI's keepL4Ckpt application (both runs)
       itf_job.py diffsizes CONFIG_JSON DIR FAIL LEVEL STYLE    FTI's ckptDiffSizes application (STYLE: how
                                                                it recovers: recover, recover_var, or mixed)
       itf_job.py recovervar CONFIG_JSON DIR LEVEL [DIR ...]    checkpoint, or recover one variable at a time
       itf_job.py dcp CONFIG_JSON DIR LEVEL CRASH                FTI's checkDCPPosix application (dCP suite):
                                                                LEVEL 5-8, dies after checkpoint CRASH
       itf_job.py syncintv CONFIG_JSON DIR CALLS                snapshot() CALLS times, rank r's calls taking
                                                                r + 1 s of a clock the job drives

END is ``die`` (every rank leaves with os._exit, no finalize: the crash of FTI's applications) or
``finalize``. Each application rank writes ``<DIR>/result-<rank>.json``: {"status": ok|fail|wrong, ...}, its
rank in ``ctx.comm`` (with ``head = 1`` the heads serve inside ``init`` and write nothing).
Checkpoint ``c`` of rank ``r`` holds 4 int32 arrays (the 4 datasets of FTI's ckptHierarchy), of
``1024 * (r % 7 + 1)`` elements each (FTI's different sizes per rank), valued ``i + r + 1000 * c``.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask.engine.schedule import SnapshotSchedule


def data(rank: int, ckpt_id: int) -> list[np.ndarray]:
    n = 1024 * (rank % 7 + 1)
    return [np.arange(n, dtype=np.int32) + rank + 1000 * ckpt_id + 100_000 * k for k in range(4)]


def dirs(base: str) -> dict:
    return {"ckpt_dir": f"{base}/Local", "glbl_dir": f"{base}/Global", "meta_dir": f"{base}/Meta"}


def app_rank(overrides: dict) -> int | None:
    """This process's rank among the application's, None for a head (``local_test``: a node is ``node_size``
    consecutive ranks, its first one the head with ``head = 1``), for a report made before ``init`` returned."""
    world, size = MPI.COMM_WORLD.rank, int(overrides.get("node_size", 1))
    if not overrides.get("head"):
        return world
    return None if world % size == 0 else world // size * (size - 1) + world % size - 1


def report(base: str, rank: int, **fields: object) -> None:
    with open(f"{base}/result-{rank}.json", "w") as fh:
        json.dump(fields, fh)


def end(ctx: ftidask.Context, how: str) -> None:
    if how == "finalize":
        ctx.finalize()
        return
    ctx.wait_post_processing()  # FTI's applications wait for their heads' post-processing before the crash
    ctx.comm.Barrier()
    if ctx.config.head:  # as FTI's applications: FTI_ENDW to the head (else it waits for the job's end), then die
        ctx.transport.close()
    sys.stdout.flush()
    os._exit(0)  # no finalize, no MPI_Finalize: the checkpoints stay as a crash leaves them


def seq(overrides: dict, base: str, how: str, levels: list[int]) -> None:
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    arrays = data(ctx.comm.rank, 0)
    for k, a in enumerate(arrays):
        ctx.protect(k + 1, a)
    for ckpt_id, level in enumerate(levels, start=1):
        for a, want in zip(arrays, data(ctx.comm.rank, ckpt_id)):
            a[:] = want
        ctx.checkpoint(ckpt_id, level)
        ctx.wait_post_processing()
    end(ctx, how)


def recover(overrides: dict, base: str, how: str) -> None:
    try:
        ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    except ftidask.FTIError as exc:
        rank = app_rank(overrides)
        if rank is not None:
            report(base, rank, status="fail", error=type(exc).__name__, message=str(exc))
        return
    rank = ctx.comm.rank
    arrays = [np.zeros_like(a) for a in data(rank, 0)]
    for k, a in enumerate(arrays):
        ctx.protect(k + 1, a)
    status = ctx.status()
    try:
        ctx.recover()
    except ftidask.FTIError as exc:
        report(base, rank, status="fail", error=type(exc).__name__, message=str(exc), fti_status=status,
               untouched=not any(a.any() for a in arrays))
        ctx.transport.close()  # leave as FTI's application does when FTI_Init says FTI_NREC: no finalize
        return
    ckpt_id, level = ctx.recovered_from
    same = all(a.tobytes() == w.tobytes() for a, w in zip(arrays, data(rank, ckpt_id)))
    report(base, rank, status="ok" if same else "wrong", source=[ckpt_id, level], fti_status=status)
    end(ctx, how)


def keepl4(overrides: dict, base: str) -> None:
    """FTI's keepL4Ckpt test application: its first run dies, its second recovers and finalizes."""
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    rank = ctx.comm.rank
    buffer = np.random.default_rng(42).integers(0, 2**32, 1024, dtype=np.uint32)
    counter = ftidask.Value(1)
    ctx.protect(0, buffer)
    ctx.protect(1, counter)
    if ctx.status() == 0:
        for level in (1, 1, 4, 2, 2, 4, 3, 3):
            counter.value += 1  # FTI_Checkpoint(id_cnt++, level): the checkpoint holds the next id
            ctx.checkpoint(counter.value - 1, level)
            ctx.wait_post_processing()
        end(ctx, "die")
    buffer[:] = 0
    ctx.recover()
    same = buffer.tobytes() == np.random.default_rng(42).integers(0, 2**32, 1024, dtype=np.uint32).tobytes()
    report(base, rank, status="ok" if same else "wrong", source=list(ctx.recovered_from), counter=counter.value)
    for level in (4, 1, 4):
        counter.value += 1
        ctx.checkpoint(counter.value - 1, level)
        ctx.wait_post_processing()
    ctx.finalize()


# FTI's ckptDiffSizes application, scaled down: the arrays grow every iteration, by a size of the rank's.
ITERATIONS, ITER_CHECK, ITER_STOP, INIT_SIZE, GROWTH = 111, 10, 63, 1024, 64


def diffsizes(overrides: dict, base: str, fail: bool, level: int, style: str) -> None:
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    rank = ctx.comm.rank
    its = np.array([0, (rank + 1) * INIT_SIZE], dtype=np.int32)  # FTI's struct {i, size}
    origin, grow = int(its[1]), rank * GROWTH
    buf = np.zeros(int(its[1]), dtype=np.int32)
    ctx.protect(1, its)
    ctx.protect(2, buf)
    if ctx.status() != 0 and not fail:
        try:
            _recover_diffsizes(ctx, rank, style)
        except ftidask.FTIError as exc:
            report(base, rank, status="fail", error=type(exc).__name__, message=str(exc))
            ctx.transport.close()
            return
        buf = ctx.protected[2]
        i = ITER_STOP - ITER_STOP % ITER_CHECK
        good = (int(its[0]) == i and int(its[1]) == origin + i * grow and buf.size == its[1]
                and bool((buf == i * rank).all()) and ctx.stored_size(2) == buf.nbytes)
        if not good:
            report(base, rank, status="wrong", its=its.tolist(), size=int(buf.size), first=int(buf[0]))
            ctx.finalize()
            return
        report(base, rank, status="ok", source=list(ctx.recovered_from))
    while its[0] < ITERATIONS:
        if its[0] % ITER_CHECK == 0:
            ctx.protect(2, buf)  # FTI_Protect again with the new size
            ctx.checkpoint(int(its[0]) // ITER_CHECK + 1, level)
        its[1] += grow
        value = buf[0] + rank
        buf = np.full(int(its[1]), value, dtype=np.int32)  # realloc, then every element set
        if fail and its[0] >= ITER_STOP:
            end(ctx, "die")
        its[0] += 1
    end(ctx, "finalize")


def _recover_diffsizes(ctx: ftidask.Context, rank: int, style: str) -> None:
    """FTI_Recover, or FTI_RecoverVar of each variable (``mixed``: FTI's application, even ranks the one, odd
    ranks the other); the first attempt fails on the size of variable 2 (the restarted run protected its
    initial size): FTI_Realloc, then the same again."""
    def attempt() -> None:
        if style == "recover" or (style == "mixed" and rank % 2 == 0):
            ctx.recover()
        else:
            ctx.recover_var(1)
            ctx.recover_var(2)

    try:
        attempt()
    except ftidask.RecoveryError as exc:
        if "realloc" not in str(exc):  # the size mismatch says what to do; anything else is a real failure
            raise
        ctx.realloc(2)
        attempt()
    else:
        raise AssertionError("recovering into the initial size of variable 2 should have been refused")


SIZES = [42, 85, 8, 19, 95, 26, 66, 33, 65, 83]  # FTI's recoverVar application


def recovervar(overrides: dict, base: str, level: int) -> None:
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    rank = ctx.comm.rank
    if ctx.status() == 0:
        for i, n in enumerate(SIZES):
            ctx.protect(i, np.full(n, i, dtype=np.int32), name=f"var{i}")
        ctx.checkpoint(1, level)
        end(ctx, "die")
    arrays: dict[int, np.ndarray] = {}
    # A shuffled order (FTI's application seeds rand() with the time: the same order on every rank, as
    # ftidask's collective recover_var needs).
    for i in np.random.default_rng(int(os.environ.get("ITF_SEED", "7"))).permutation(len(SIZES)):
        i = int(i)
        arrays[i] = np.zeros(SIZES[i], dtype=np.int32)
        ctx.protect(i, arrays[i], name=f"var{i}")
        ctx.recover_var(i)  # the variables not protected yet are not needed
    same = all((a == i).all() for i, a in arrays.items())
    report(base, rank, status="ok" if same else "wrong", source=list(ctx.recovered_from))
    ctx.finalize()


DCP_N = 100_000  # FTI's checkDCPPosix: A (ones) and B (random), N doubles each; five chunks of A multiplied by B


def dcp(overrides: dict, base: str, level: int, crash: int) -> None:
    """FTI's checkDCPPosix: each iteration multiplies one fifth of A by B and checkpoints (differentially, the
    fifth and the counter change); it dies after checkpoint ``crash``; a restart recovers and goes on; the run
    that reaches the end checks A == B everywhere and finalizes."""
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    rank = ctx.comm.rank
    b_want = np.random.default_rng(rank).random(DCP_N) * 5.0
    a, b, it = np.ones(DCP_N), b_want.copy(), np.zeros(1, dtype=np.int64)
    for k, array in enumerate((a, b, it)):
        ctx.protect(k, array)
    recovered = None
    if ctx.status() == 0:
        ctx.checkpoint(1, level)
    else:
        a[:], b[:] = 0, 0
        try:
            ctx.recover()
        except ftidask.FTIError as exc:
            report(base, rank, status="fail", error=type(exc).__name__, message=str(exc),
                   untouched=not (a.any() or b.any()))
            ctx.transport.close()
            return
        done = int(it[0]) * (DCP_N // 5)
        good = bool((b == b_want).all() and (a[:done] == b_want[:done]).all() and (a[done:] == 1).all())
        recovered = [int(it[0]), bool(good)]
    step = DCP_N // 5
    while it[0] < 5:
        i = int(it[0])
        a[i * step:(i + 1) * step] *= b[i * step:(i + 1) * step]
        it[0] += 1
        ctx.checkpoint(int(it[0]) + 1, level)
        if it[0] == crash:
            report(base, rank, status="died", recovered=recovered)
            end(ctx, "die")
    report(base, rank, status="ok" if (a == b_want).all() else "wrong", recovered=recovered)
    ctx.finalize()


class _Counting:
    """The transport, counting the allgathers asked of it."""

    def __init__(self, inner: object) -> None:
        self.inner, self.gathers = inner, 0

    def allgather(self, value: object) -> list:
        self.gathers += 1
        return self.inner.allgather(value)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def syncintv(overrides: dict, base: str, calls: int) -> None:
    """FTI's syncIntv application, the durations of its calls told by a clock of the job's, not measured."""
    ctx = ftidask.init(comm=MPI.COMM_WORLD, **overrides, **dirs(base))
    rank, now = ctx.comm.rank, [0.0]
    counting = _Counting(ctx.transport)
    ctx._schedule = SnapshotSchedule(ctx.config, counting, clock=lambda: now[0])
    ctx.protect(1, np.full(1000, rank, dtype=np.int32))
    made = []
    for call in range(1, calls + 1):
        now[0] += rank + 1
        if ctx.snapshot() == ftidask.FTI_DONE:
            made.append(call)
    report(base, rank, made=made, gathers=counting.gathers)
    ctx.finalize()


def main() -> None:
    mode, overrides, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if mode == "seq":
        seq(overrides, base, sys.argv[4], [int(x) for x in sys.argv[5:]])
    elif mode == "recover":
        recover(overrides, base, sys.argv[4])
    elif mode == "keepl4":
        keepl4(overrides, base)
    elif mode == "diffsizes":
        diffsizes(overrides, base, sys.argv[4] == "1", int(sys.argv[5]), sys.argv[6])
    elif mode == "recovervar":
        recovervar(overrides, base, int(sys.argv[4]))
    elif mode == "dcp":
        dcp(overrides, base, int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "syncintv":
        syncintv(overrides, base, int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
