"""Random sequences of API calls and real failures on 4 ranks, checked against a model (test_mpi_random_sequences.py).

usage: mpiexec -n 4 python random_sequence_job.py CONFIG BASE STEPS SEED [SEED ...]
       (configs ``h-*``, with heads: -n 6 for ``n3`` (2 nodes of 1 head + 2 ranks), -n 8 for ``n2`` (4 of 1 + 1))

With heads, the application ranks run the sequence on their communicator; the heads loop in :func:`serve_heads`
(each init's keywords broadcast to them first). The model then knows that with heads every differential checkpoint a
head raises is written at L1, on the rank's L1 spare (a flipped byte there or in an L1 checkpoint's file spoils the
next ones at any level), and that the heads update an L3 parity from the previous L3 file; every check first waits for
the post-processing and asks that it succeeded. ``op_finalize`` (keep_last_ckpt) finalizes and starts the run again.

Every rank draws the SAME sequence of operations from the seed (one NumPy Generator seeded alike everywhere); the
values are each rank's own. Operations: arrays changed in place or replaced by ones of another size, checkpoints at
levels 1-4 (5-8 with dCP) waited for or not, incremental checkpoints (the arrays changed between the variables'
writes), recover / recover_var / recover(ckpt_id, level), a restart (the context closed without finalize, a new init,
stored_size, new arrays realloc'd), a node's files lost at a restart, one file of a checkpoint erased or a byte of it
flipped, a dCP spare erased or flipped.

The model (alike on every rank) keeps every committed checkpoint (each rank's values at the call, its level, the
state of each of its files: sound, erased, or unknown: a byte flipped) and FTI's retention. Each recovery walks the
checkpoints newest first as the product does: one the model knows recoverable (the damage within its level's
tolerance) must come back exactly, on every rank; before it, those whose fate is unknown may come back instead
(whole: every variable, every rank the same); with none known recoverable, NoCheckpointError on every rank with the
arrays untouched is allowed too. Every check is agreed over the ranks, so that all ranks fail together.
Writes BASE/result-{seed}.json from rank 0: {"ok": bool, "error": str, "log": [ops]}.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ftidask
from ftidask import NoCheckpointError, RecoveryError

IDS = (1, 2, 3)
DTYPES = {1: np.float64, 2: np.int32, 3: np.uint8}
SOUND, ERASED, UNKNOWN = "sound", "erased", "unknown"
CONFIGS = {
    "n1g4": dict(node_size=1, group_size=4),
    "n1g2": dict(node_size=1, group_size=2),
    "n2g2": dict(node_size=2, group_size=2),
    "dcp-n1g4": dict(node_size=1, group_size=4, enable_dcp=1, dcp_block_size=512),
    "dcp-n2g2": dict(node_size=2, group_size=2, enable_dcp=1, dcp_block_size=512, max_inflight=2),
}
# With FTI's heads (head = 1: the first process of each simulated node; node_size counts it): the application ranks
# write L1 and the heads raise it (inline_lN = 0), or the ranks write a level themselves (inline_lN = 1).
HEADS = dict(head=1, inline_l2=0, inline_l3=0, inline_l4=0, enable_staging=1)
CONFIGS.update({
    "h-n3g2": dict(node_size=3, group_size=2, **HEADS),  # 6 processes: 2 nodes of 1 head + 2 ranks
    "h-n2g2-keep": dict(node_size=2, group_size=2, keep_last_ckpt=1, **HEADS),  # 4 nodes of 1 head + 1 rank
    "h-n3g2-l2inline": dict(node_size=3, group_size=2, **{**HEADS, "inline_l2": 1}),
    "h-dcp-n3g2": dict(node_size=3, group_size=2, enable_dcp=1, dcp_block_size=512, **HEADS),
    "h-dcp-n2g2-keep": dict(node_size=2, group_size=2, enable_dcp=1, dcp_block_size=512, keep_last_ckpt=1,
                            max_inflight=2, **HEADS),
})
WORLD = MPI.COMM_WORLD
COMM = WORLD  # the application's ranks: WORLD, or WORLD without the heads (split in main)


def found_files(base: Path, pattern: str) -> list[Path]:
    """The files named like ``pattern`` under ``base``, trash left out, sorted. A walk that passes over directories
    gone meanwhile: ``Path.rglob`` raised FileNotFoundError when the run's background remover deleted a trash
    directory under it (rank 0 alone, the others then waiting in a collective for ever)."""
    out = []
    for root, dirs, files in os.walk(base):  # os.walk ignores a directory it can no longer list
        dirs[:] = [d for d in dirs if ".trash" not in d]
        out += [Path(root, f) for f in fnmatch.filter(files, pattern) if ".trash" not in f]
    return sorted(out)


def damage(path: Path, erase: bool, where: float) -> None:
    """``path`` erased, or its byte at fraction ``where`` of its length flipped."""
    if erase:
        path.unlink()
        return
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * where)] ^= 0xFF
    path.write_bytes(bytes(raw))


def on_rank0(work, empty, what: str):
    """``work()`` on rank 0, its result on every rank (``empty`` elsewhere); an OSError there raised on every rank
    (a rank that raised alone left the others waiting in the broadcast for ever)."""
    result, error = empty, ""
    if COMM.rank == 0:
        try:
            result = work()
        except OSError as exc:
            error = repr(exc)
    result, error = COMM.bcast((result, error))
    COMM.barrier()
    if error:
        raise RuntimeError(f"rank 0 could not {what}: {error}")
    return result


class Failed(AssertionError):
    pass


def agree_ok(ok: bool, what: str) -> None:
    """Every rank's verdict; every rank raises if one failed."""
    verdicts = COMM.allgather((ok, what))
    bad = [(r, w) for r, (o, w) in enumerate(verdicts) if not o]
    if bad:
        raise Failed(f"check failed on ranks {bad}")


class Run:
    def __init__(self, cfg: dict, base: Path, seed: int) -> None:
        self.cfg, self.base, self.rank, self.size = cfg, base, COMM.rank, COMM.size
        self.rng = np.random.default_rng(seed)  # the same draws on every rank
        self.heads = bool(cfg.get("head"))
        self.node_size, self.group_size = cfg["node_size"] - self.heads, cfg["group_size"]  # application ranks
        self.nnodes = self.size // self.node_size
        self.dcp = bool(cfg.get("enable_dcp"))
        self.dirs = dict(ckpt_dir=str(base / "L"), glbl_dir=str(base / "G"), meta_dir=str(base / "M"), local_test=1,
                         verbosity=3, block_size=256, transfer_size=1, **cfg)
        self.ckpts: list[dict] = []  # committed, oldest first
        self.next_id, self.log, self.handles = 1, [], []
        self.staged: list[tuple[int, Path, bytes]] = []  # (request, destination, bytes) not checked yet
        self.taint: set[tuple[int, str, int]] = set()  # (level, kind, rank) whose spare lineage holds a flipped byte
        self.stats = dict.fromkeys(["exact", "either", "first", "fallback", "none", "damage", "exact_rebuilt",
                                    "restart", "lost_node"], 0)
        self.ctx = self.init()
        self.n = {vid: int(self.rng.integers(1, 3000)) for vid in IDS}
        self.arrays = {vid: self._new(vid) for vid in IDS}
        for vid, a in self.arrays.items():
            self.ctx.protect(vid, a)

    # --- topology (FTI's: consecutive nodes per group, same position on each node) ------------------------
    def node(self, r: int) -> int:
        return r // self.node_size

    def group(self, r: int) -> list[int]:
        g0 = self.node(r) // self.group_size * self.group_size
        pos = r % self.node_size
        return [n * self.node_size + pos for n in range(g0, min(g0 + self.group_size, self.nnodes))]

    def right(self, r: int) -> int:
        g = self.group(r)
        return g[(g.index(r) + 1) % len(g)]

    # --- values ------------------------------------------------------------------------------------------
    def _new(self, vid: int, n: int | None = None) -> np.ndarray:
        n = self.n[vid] if n is None else n
        local = np.random.default_rng([int(self.rng.integers(1 << 30)), self.rank])
        return (local.random(n + 13 * self.rank) * 250).astype(DTYPES[vid])

    def snap(self) -> dict[int, bytes]:
        return {vid: a.tobytes() for vid, a in self.arrays.items()}

    def mutate(self, vid: int, frac: float) -> None:
        a = self.arrays[vid]
        local = np.random.default_rng([int(self.rng.integers(1 << 30)), self.rank])
        idx = local.random(a.size) < frac
        a[idx] = (a[idx] + 7).astype(a.dtype)

    # --- the model ---------------------------------------------------------------------------------------
    def commit(self, level: int, values: dict[int, bytes]) -> None:
        base = level - 4 if level > 4 else level
        for c in self.ckpts:
            if not c["retired"] and c["level"] <= base:
                c["retired"] = True
        kinds = {1: ["rank"], 2: ["rank", "pcof"], 3: ["rank", "rsed"], 4: ["rank"]}[base]
        files = {(k, r): SOUND for k in kinds for r in range(self.size)}
        if level > 4:  # differential: patched on the spare, whose damaged blocks not changed since stay (docs/dcp.md)
            for lv, kind, r in self.taint:
                if self.heads and self.raised(base) and lv == 3 and kind == "rank" and base == 3:
                    # the heads update the parity from the previous L3 file's differences: a byte flipped where
                    # no hash looks goes into the new parity
                    files.update({("rsed", m): UNKNOWN for m in self.group(r)})
                if lv == (1 if self.heads and self.raised(base) else base) and (kind, r) in files:
                    files[(kind, r)] = UNKNOWN
                    if kind == "rank" and base == 3:  # the parity updated from deltas read on that spare
                        files.update({("rsed", m): UNKNOWN for m in self.group(r)})
                    if kind == "rank" and base == 2:  # the partner copy patched with the same ranges
                        files[("pcof", self.right(r))] = UNKNOWN
        self.ckpts.append({"id": self.next_id, "level": base, "asked": level, "values": values, "n": dict(self.n),
                           "retired": False, "dead": False, "files": files})
        self.next_id += 1

    def raised(self, base: int) -> bool:
        """Whether a head raises a checkpoint of level ``base`` (the rank writes it at L1, differential ones on its
        L1 spare, which the head makes of the L1 file it copied to the level)."""
        return base > 1 and not self.cfg.get(f"inline_l{base}", 1)

    def recoverable(self, c: dict, pessimistic: bool) -> bool:
        def lost(key: tuple[str, int]) -> bool:
            state = c["files"][key]
            return state != SOUND if pessimistic else state == ERASED
        own = [r for r in range(self.size) if lost(("rank", r))]
        if c["level"] in (1, 4):
            return not own
        if c["level"] == 2:
            return not any(lost(("pcof", self.right(r))) for r in own)
        groups = {tuple(self.group(r)) for r in range(self.size)}
        for g in groups:
            n_lost = sum(lost(("rank", r)) + lost(("rsed", r)) for r in g)
            # A byte flipped in a container's slack is not detected by the file's hashes (not hashed): that file, taken
            # as sound, spoils the Reed-Solomon decoding of another lost file of the group if it is one of its inputs.
            # A full encoding's parity records keep the group's whole-file hashes: such a file then counts as lost (and
            # is rebuilt). A parity patched by a rank's differential writer keeps none: the decoding takes the parity
            # files first (checked whole), a data file only where a parity file is lost too, and may take that one.
            poisoned = self.dcp and pessimistic and any(c["files"][("rank", r)] == UNKNOWN for r in g) and n_lost >= 2 and any(
                c["files"][("rsed", r)] != SOUND for r in g)
            if n_lost > len(g) or poisoned:
                return False
        return True

    def candidates(self) -> tuple[list[dict], bool]:
        """The checkpoints a recovery may give, newest first, and whether NoCheckpointError is allowed."""
        out = []
        for c in reversed(self.ckpts):
            if c["dead"]:
                continue
            if c["retired"]:
                if self.dcp:
                    out.append(c)  # a retired checkpoint's files become the spares recovery may fall back to
                continue
            if not self.recoverable(c, pessimistic=False):
                continue
            out.append(c)
            if self.recoverable(c, pessimistic=True):
                return out, False
        return out, True

    def count(self, cands: list[dict], none_ok: bool) -> None:
        exact = len(cands) == 1 and not none_ok
        self.stats["exact" if exact else "either"] += 1
        if exact and any(state != SOUND for state in cands[0]["files"].values()):
            self.stats["exact_rebuilt"] += 1  # damaged within the level's tolerance: rebuilt, exactly

    def recovered(self, got: dict | None, tried: list[dict]) -> None:
        """What a recovery tells: the candidates before ``got`` cannot be recovered; ``got``'s files are rebuilt."""
        self.stats["none" if got is None else "fallback" if got is not tried[0] else "first"] += 1
        for c in tried:
            if c is got:
                break
            c["dead"] = True
        if got is None or got["level"] not in (2, 3):
            return
        files = got["files"]
        for g in {tuple(self.group(r)) for r in range(self.size)}:
            lost_own = any(files[("rank", r)] != SOUND for r in g)
            for r in g:
                if files[("rank", r)] == ERASED:
                    files[("rank", r)] = SOUND  # rebuilt; a flipped byte is rebuilt too, or was never read (slack)
                for key in [k for k in files if k[1] == r and k[0] != "rank"]:
                    if lost_own and files[key] != SOUND:
                        files[key] = UNKNOWN  # rebuilt with the lost files, or left as it was
                    elif files[key] == ERASED:
                        files[key] = SOUND  # found missing by a stat: rebuilt

    # --- operations --------------------------------------------------------------------------------------
    def op_checkpoint(self) -> None:
        level = int(self.rng.integers(1, 9 if self.dcp else 5))
        wait = bool(self.rng.random() < 0.6)
        self.log.append(f"checkpoint {self.next_id} L{level} wait={wait}")
        values = self.snap()
        out = self.ctx.checkpoint(self.next_id, level, wait=wait)
        if not wait:
            self.mutate(int(self.rng.choice(IDS)), 0.3)  # the checkpoint holds the values at the call
            if self.rng.random() < 0.5:
                out.result()
            else:
                self.handles.append(out)
        self.commit(level, values)

    def op_incremental(self) -> None:
        level = int(self.rng.integers(1, 9 if self.dcp else 5))
        order = [int(v) for v in self.rng.permutation(IDS)]
        self.log.append(f"incremental {self.next_id} L{level} order={order}")
        values = {}
        self.ctx.init_icp(self.next_id, level)
        for vid in order:
            values[vid] = self.arrays[vid].tobytes()
            self.ctx.add_var_icp(vid)
            self.mutate(vid, 0.2)  # written at add_var_icp: the change after it is not in the checkpoint
        self.ctx.finalize_icp()
        self.commit(level, values)

    def op_mutate(self) -> None:
        vid, frac = int(self.rng.choice(IDS)), float(self.rng.random())
        self.log.append(f"mutate {vid} {frac:.2f}")
        self.mutate(vid, frac)

    def op_resize(self) -> None:
        vid = int(self.rng.choice(IDS))
        self.n[vid] = int(self.rng.integers(1, 3000))
        self.log.append(f"resize {vid} {self.n[vid]}")
        self.arrays[vid] = self._new(vid)
        self.ctx.protect(vid, self.arrays[vid])

    def _files_of(self, c: dict, kind: str, r: int) -> list[Path]:
        name = {"rank": f"Ckpt{c['id']}-Rank{r}.fti", "pcof": f"Ckpt{c['id']}-Pcof{r}.fti",
                "rsed": f"Ckpt{c['id']}-RSed{r}.fti"}[kind]
        return found_files(self.base, name)

    def op_damage(self) -> None:
        """One file of a retained checkpoint erased or a byte of it flipped (rank 0 does it, the model alike)."""
        alive = [c for c in self.ckpts if not c["retired"] and not c["dead"]]
        if not alive:
            return
        c = alive[-1] if self.rng.random() < 0.6 else alive[int(self.rng.integers(len(alive)))]
        key = sorted(c["files"])[int(self.rng.integers(len(c["files"])))]
        erase, where = bool(self.rng.random() < 0.5), float(self.rng.uniform(0.02, 0.98))
        self.settle()

        def work() -> bool:
            found = self._files_of(c, *key)
            if len(found) == 1:
                damage(found[0], erase, where)
            return len(found) == 1

        done = on_rank0(work, False, "damage the file")
        self.log.append(f"damage ckpt {c['id']} {key} {'erase' if erase else f'corrupt@{where:.2f}'} done={done}")
        self.stats["damage"] += done
        if done:
            # A flipped byte may lie in a container's slack (FTI-FF keeps a container's size when its variable
            # shrinks): never read, never hashed, so never detected; recovering that file is then right too.
            c["files"][key] = ERASED if erase else UNKNOWN
            if not erase and self.dcp and key[0] != "rsed":  # once a spare, patched by later differential ones
                self.taint.add((c["level"], *key))

    def op_damage_spare(self) -> None:
        """dCP: a spare (a retired checkpoint's file, which the next differential checkpoint patches) erased or a
        byte of it flipped. A retired checkpoint is never promised; the next differential
        checkpoint may carry its damaged blocks not changed since (docs/dcp.md): never promised for that rank again."""
        if not self.dcp:
            return
        u, erase, where = float(self.rng.random()), bool(self.rng.random() < 0.3), float(self.rng.uniform(0.02, 0.98))
        self.settle()

        def work() -> str:
            spares = found_files(self.base, "Spare*-Rank*.fti")
            if not spares:
                return ""
            path = spares[int(u * len(spares))]
            damage(path, erase, where)
            return str(path.relative_to(self.base))

        done = on_rank0(work, "", "damage a spare")
        self.log.append(f"damage spare {done} {'erase' if erase else f'corrupt@{where:.2f}'}")
        if done and not erase:  # {level dir}/dcp/Spare{kind}-Rank{r}.fti (a damaged parity spare is re-encoded)
            parts = Path(done).parts
            level = 4 if parts[0] == "G" else int(parts[-3][1:])
            kind = {"Spare": "rank", "SparePcof": "pcof"}.get(parts[-1].split("-")[0])
            if self.heads and level > 1 and self.raised(level):
                kind = None  # a fallback only: the ranks patch their L1 spares, the heads copy to the level
            if kind is not None:
                self.taint.add((level, kind, int(parts[-1].split("Rank")[1].split(".")[0])))

    def init(self):
        """``ftidask.init`` on every process: the heads are told the keywords first (see :func:`serve_heads`)."""
        if self.heads:
            WORLD.bcast(self.dirs, root=app_root(self.cfg))
        # A new communicator for each init with heads: the heads' finalize marks the one they served as ended (a
        # head's process exits there, but these heads catch SystemExit and serve again).
        return ftidask.init(comm=WORLD.Dup() if self.heads else COMM, **self.dirs)

    def op_stage(self) -> None:
        """FTI_SendFile (heads: the node's head moves the file between its post-processing): a file of this rank's
        random bytes staged to the global directory; checked at the next settle."""
        k, size = self.next_stage, int(self.rng.integers(0, 200_000))
        self.next_stage += 1
        data = np.random.default_rng([int(self.rng.integers(1 << 30)), self.rank]).bytes(size + self.rank)
        local = self.ctx.stage_dir() / f"f{k}.bin"
        local.write_bytes(data)
        self.log.append(f"stage {k} ({size} bytes)")
        self.staged.append((self.ctx.send_file(local, f"out/r{self.rank}-{k}.bin"), self.base / "G" / "out" /
                            f"r{self.rank}-{k}.bin", data))

    next_stage = 0

    def settle(self) -> None:
        self.ctx.wait()
        for h in self.handles:
            h.result()
        self.handles = []
        if self.staged:  # every file at its destination, bit for bit
            states = self.ctx.wait_staged(timeout=120)
            bad = [(req, states.get(req), dest.name) for req, dest, data in self.staged
                   if states.get(req) != ftidask.SI_SCES or not dest.is_file() or dest.read_bytes() != data]
            agree_ok(not bad, f"staged files: {bad}")
            self.staged = []
        if self.heads:  # the heads' post-processing of the last checkpoint done, and done well (or none asked)
            reply = self.ctx.wait_post_processing()
            agree_ok(reply is None or bool(reply.get("ok")) and not reply.get("error"), f"post-processing: {reply}")

    def op_restart(self) -> None:
        lose = int(self.rng.integers(-2, self.nnodes))  # < 0: no node lost
        self.log.append(f"restart lose_node={lose}")
        self.settle()
        self.ctx._close()  # the job ends without finalize: its checkpoints stay
        COMM.barrier()
        self.stats["restart"] += 1
        if lose >= 0:
            self.stats["lost_node"] += 1
            if self.rank == 0:
                shutil.rmtree(self.base / "L" / f"node{lose}", ignore_errors=True)
            for c in self.ckpts:
                if c["level"] != 4:
                    for key in c["files"]:
                        if self.node(key[1]) == lose:
                            c["files"][key] = ERASED
        COMM.barrier()
        self.ctx = self.init()
        agree_ok(self.ctx.status() == (1 if self.ckpts else 0), f"status {self.ctx.status()}")
        self._restarted()

    def _restarted(self) -> None:
        cands, none_ok = self.candidates()
        if len(cands) == 1 and not none_ok:  # FTI's order on a restart: stored_size before realloc and recover
            sizes = [self.ctx.stored_size(vid) for vid in IDS]
            agree_ok(sizes == [len(cands[0]["values"][vid]) for vid in IDS], f"stored_size {sizes}")
        self.n = {vid: 5 for vid in IDS}  # a new process's arrays (realloc'd by the recovery)
        self.arrays = {vid: self._new(vid) for vid in IDS}
        for vid, a in self.arrays.items():
            self.ctx.protect(vid, a)
        self.op_recover()

    def kept_at_finalize(self) -> tuple[bool, dict | None]:
        """keep_last_ckpt: (whether the model knows it, the checkpoint finalize keeps). The newest one whose every
        rank file verifies is flushed to L4 (a committed L4 one verified where it is); the newest, committed at L4 with
        no fallback to go back to, is kept as it is, unread (retention.end_run); none: finalize fails, the run keeps
        its checkpoints."""
        newest = True
        for c in reversed(self.ckpts):
            if c["retired"] and not self.dcp:
                continue  # removed
            states = {c["files"][("rank", r)] for r in range(self.size)}
            first, newest = newest, False
            if first and c["level"] == 4 and not c["retired"]:
                fallback = any(o["retired"] and o["asked"] > 4 for o in self.ckpts)  # maybe a fallback record
                return (True, c) if states == {SOUND} or not fallback else (False, None)
            if c["retired"] or states - {SOUND, ERASED}:
                return False, None
            if states == {SOUND}:
                return True, c
        return True, None

    def op_finalize(self) -> None:
        """keep_last_ckpt: finalize (see :meth:`kept_at_finalize`), then a new run restarts from what it kept (status
        2), or, where none could be kept, from the run's checkpoints (status 1). Only where the model knows which."""
        if not self.cfg.get("keep_last_ckpt"):
            return
        known, kept = self.kept_at_finalize()
        if not known:
            self.log.append("finalize skipped: which checkpoint is kept is not known")
            return
        committed = any(not c["retired"] for c in self.ckpts)
        self.log.append(f"finalize keeping {kept and kept['id']}")
        self.settle()
        try:
            self.ctx.finalize()
            failed = ""
        except ftidask.FTIError as exc:  # none can be flushed: the run keeps its checkpoints (docs/guide.md)
            failed = f"{type(exc).__name__}: {exc}"
        agree_ok(bool(failed) == (kept is None and committed), f"finalize: {failed or 'returned'}")
        agree_ok(len(set(COMM.allgather(failed))) == 1, "finalize failed on some ranks only, or differently")
        COMM.barrier()
        self.stats["restart"] += 1
        if failed:
            self.log.append("  -> finalize failed: the run restarts")
            self.ctx = self.init()
            agree_ok(self.ctx.status() == 1, f"status {self.ctx.status()} after a failed finalize")
            self._restarted()
            return
        self.taint = set()  # the spares are cleared
        if kept is not None and kept["level"] != 4:  # flushed: a sound copy
            kept = dict(kept, level=4, asked=4, retired=False, files={("rank", r): SOUND for r in range(self.size)})
        self.ckpts = [] if kept is None else [dict(kept, dead=False)]
        self.ctx = self.init()
        agree_ok(self.ctx.status() == (2 if kept else 0), f"status {self.ctx.status()} after finalize")
        if kept is None:
            for vid, a in self.arrays.items():
                self.ctx.protect(vid, a)
            return
        self._restarted()

    def op_recover(self) -> None:
        cands, none_ok = self.candidates()
        self.count(cands, none_ok)
        self.log.append(f"recover expecting {[c['id'] for c in cands]} none_ok={none_ok}")
        if cands:
            for vid in IDS:  # arrays of the stored size where they differ (the same decision on every rank)
                if cands[0]["n"][vid] != self.n[vid]:
                    try:
                        self.arrays[vid] = self.ctx.realloc(vid)
                        self.n[vid] = cands[0]["n"][vid]
                    except NoCheckpointError:
                        agree_ok(none_ok, "realloc found nothing to recover")
        before = self.snap()
        try:
            try:
                self.ctx.recover()
            except RecoveryError as exc:
                if isinstance(exc, NoCheckpointError):
                    raise
                # a fallback of other sizes, or the sizes realloc() gave of the checkpoint recovered before (after a
                # recover(ckpt_id=...)): then realloc() gives those of the checkpoint refused
                agree_ok("realloc" in str(exc), f"recover refused: {exc}")
                agree_ok(self.snap() == before, "a refused recovery touched the arrays")
                self.arrays = {vid: self.ctx.realloc(vid) for vid in IDS}
                before = self.snap()
                self.ctx.recover()
        except NoCheckpointError as exc:
            agree_ok(none_ok, f"a recoverable checkpoint was not recovered: {exc}")
            agree_ok(self.snap() == before, "a refused recovery touched the arrays")
            self.recovered(None, cands)
            self.log.append("  -> NoCheckpointError")
            return
        self.n = {vid: (a.size - 13 * self.rank) for vid, a in self.arrays.items()}
        got = self.check_whole(cands, self.snap())
        self.recovered(got, cands)
        self.log.append(f"  -> {got['id']}")

    def check_whole(self, cands: list[dict], got: dict[int, bytes], vids=IDS) -> dict:
        """The checkpoint the arrays now hold: the one recovered_from names, one of ``cands``, the same on every rank,
        every variable bit for bit."""
        rf = self.ctx.recovered_from
        which = [c for c in cands if rf is not None and c["id"] == rf[0]]
        exact = bool(which) and all(which[0]["values"][v] == got[v] for v in vids)
        agree_ok(len(set(COMM.allgather(rf))) == 1, f"ranks recovered from different checkpoints: {rf}")
        agree_ok(exact, f"recovered_from {rf}, candidates {[c['id'] for c in cands]}: "
                        f"{'not those values' if which else 'not a candidate'}"
                        f" (values of {[c['id'] for c in self.ckpts if all(c['values'][v] == got[v] for v in vids)]})")
        return which[0]

    def op_recover_var(self) -> None:
        vid = int(self.rng.choice(IDS))
        cands, none_ok = self.candidates()
        self.count(cands, none_ok)
        self.log.append(f"recover_var {vid} expecting {[c['id'] for c in cands]} none_ok={none_ok}")
        if cands and cands[0]["n"][vid] != self.n[vid]:
            try:
                self.arrays[vid] = self.ctx.realloc(vid)
                self.n[vid] = cands[0]["n"][vid]
            except NoCheckpointError:
                agree_ok(none_ok, "realloc found nothing to recover")
        others = {v: a.tobytes() for v, a in self.arrays.items() if v != vid}
        before = self.arrays[vid].tobytes()
        try:
            try:
                self.ctx.recover_var(vid)
            except RecoveryError as exc:  # sizes of the checkpoint recovered before: realloc() now gives the right ones
                if isinstance(exc, NoCheckpointError) or "realloc" not in str(exc):
                    raise
                agree_ok(self.arrays[vid].tobytes() == before, "a refused recovery touched the array")
                self.arrays[vid] = self.ctx.realloc(vid)
                before = self.arrays[vid].tobytes()
                self.ctx.recover_var(vid)
        except RecoveryError as exc:  # NoCheckpointError, or a fallback of another size
            agree_ok(none_ok or (len(cands) > 1 and not isinstance(exc, NoCheckpointError)), f"refused: {exc}")
            agree_ok(self.arrays[vid].tobytes() == before, "a refused recovery touched the array")
            self.log.append(f"  -> {type(exc).__name__}")
            if isinstance(exc, NoCheckpointError):
                self.recovered(None, cands)
            return
        finally:
            self.n[vid] = self.arrays[vid].size - 13 * self.rank  # the same on every rank
            agree_ok({v: a.tobytes() for v, a in self.arrays.items() if v != vid} == others, "another variable changed")
        got = self.check_whole(cands, {vid: self.arrays[vid].tobytes()}, vids=(vid,))
        self.recovered(got, cands)
        self.log.append(f"  -> {got['id']}")

    def op_recover_id(self) -> None:
        """recover(ckpt_id=...) of a retained checkpoint, into arrays of its sizes (realloc() gives the newest's)."""
        kept = [c for c in self.ckpts if not c["retired"]]
        if not kept:
            return
        c = kept[int(self.rng.integers(len(kept)))]
        by_level = bool(self.rng.random() < 0.5)
        sure = not c["dead"] and self.recoverable(c, pessimistic=True)
        never = c["dead"] or not self.recoverable(c, pessimistic=False)
        self.stats["exact" if sure else "either"] += 1
        self.log.append(f"recover ckpt_id={c['id']} level={c['asked'] if by_level else None} sure={sure} never={never}")
        for vid in IDS:
            if c["n"][vid] != self.n[vid]:
                self.n[vid] = c["n"][vid]
                self.arrays[vid] = np.zeros(self.n[vid] + 13 * self.rank, DTYPES[vid])
                self.ctx.protect(vid, self.arrays[vid])
        before = self.snap()
        try:
            self.ctx.recover(c["id"], c["level"] if by_level else None)
        except NoCheckpointError as exc:
            agree_ok(not sure, f"checkpoint {c['id']} is recoverable, but: {exc}")
            agree_ok(self.snap() == before, "a refused recovery touched the arrays")
            c["dead"] = True
            self.log.append("  -> NoCheckpointError")
            return
        agree_ok(not never, f"checkpoint {c['id']} cannot be recovered, yet recover() returned")
        self.check_whole([c], self.snap())
        self.recovered(c, [c])
        self.log.append(f"  -> {c['id']}")

    OPS = [("op_mutate", 3), ("op_resize", 1), ("op_checkpoint", 4), ("op_incremental", 1), ("op_recover", 2),
           ("op_recover_var", 1), ("op_recover_id", 0.7), ("op_restart", 1.5), ("op_damage", 2), ("op_damage_spare", 1),
           ("op_finalize", 0.5), ("op_stage", 0.7)]  # the last ones: weight 0 where they do not apply (the draws of
    # the configs without them stay those of their seeds before)

    def weight(self, name: str, w: float) -> float:
        if name == "op_finalize" and not self.cfg.get("keep_last_ckpt") or name == "op_stage" and not self.heads:
            return 0.0
        return w

    def step(self) -> None:
        names = [n for n, _ in self.OPS]
        weights = np.array([self.weight(n, w) for n, w in self.OPS], dtype=float)
        name = str(self.rng.choice(names, p=weights / weights.sum()))
        if self.rank == 0:
            print(f"  {len(self.log)} {name}", flush=True)  # where a hang stopped (the test's timeout shows it)
        getattr(self, name)()

    def close(self) -> None:
        known, kept = self.kept_at_finalize() if self.cfg.get("keep_last_ckpt") else (True, True)
        try:
            self.settle()
            self.ctx.finalize()
        except ftidask.FTIError as exc:  # keep_last_ckpt and no checkpoint can be kept
            self.ctx._close()
            if known and kept is not None or not any(not c["retired"] for c in self.ckpts):
                raise
            agree_ok(True, f"{exc}")
        except Exception:
            self.ctx._close()
            raise


def run_seed(name: str, base: Path, steps: int, seed: int) -> dict:
    if COMM.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    COMM.barrier()
    run = None
    try:
        run = Run(CONFIGS[name], base, seed)
        for _ in range(steps):
            run.step()
        run.op_recover()
        run.close()
        return {"ok": True, "log": run.log, "stats": run.stats}
    except Exception as exc:
        if run is not None:
            try:
                run.ctx._close()
            except Exception:
                pass
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                "log": run.log if run else []}


def app_root(cfg: dict) -> int:
    """The world rank of application rank 0 (after node 0's head)."""
    return 1 if cfg.get("head") else 0


def serve_heads(cfg: dict) -> None:
    """A head: each ``ftidask.init`` the application ranks make (they broadcast its keywords first) serves until they
    close or finalize (SystemExit); None ends the job."""
    while True:
        kwargs = WORLD.bcast(None, root=app_root(cfg))
        if kwargs is None:
            return
        try:
            ftidask.init(comm=WORLD.Dup(), **kwargs)  # as the application ranks do (Dup is collective)
        except SystemExit:
            pass
        else:
            raise AssertionError("init returned on a head")


def main() -> None:
    global COMM
    name, base, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    cfg = CONFIGS[name]
    head = bool(cfg.get("head")) and WORLD.rank % cfg["node_size"] == 0  # local_test: node = rank // node_size
    COMM = WORLD.Split(1 if head else 0, WORLD.rank)
    if head:
        serve_heads(cfg)
        return
    try:
        seeds(name, base, steps)
    finally:
        if cfg.get("head"):
            WORLD.bcast(None, root=app_root(cfg))


def seeds(name: str, base: Path, steps: int) -> None:
    for seed in map(int, sys.argv[4:]):
        if COMM.rank == 0:
            print(f"seed {seed}", flush=True)
        out = run_seed(name, base / f"s{seed}", steps, seed)
        if COMM.rank == 0:
            (base / f"result-{seed}.json").write_text(json.dumps(out))
            print(f"seed {seed} {'ok' if out['ok'] else 'FAILED'}", flush=True)
            if out["ok"]:
                shutil.rmtree(base / f"s{seed}", ignore_errors=True)
        COMM.barrier()


if __name__ == "__main__":
    main()
