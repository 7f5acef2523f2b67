"""Random sequences of Dask API calls and real faults on one LocalCluster, checked against a model
(tests/test_dask_random_sequences.py; ``python tests/dask_sequences.py CONFIG STEPS SEED...`` runs a campaign).

One NumPy Generator per seed draws the operations: protect Dask arrays of random dtypes, shapes and chunkings (new
values, values derived from the protected array: its lineage reads the checkpoint back, new shapes, rechunking),
checkpoints at levels 1-4 (5-8 with dCP) waited for or not, incremental ones, recover / recover(ids=) /
recover(ckpt_id, level) / recover(chunks=), a restart (a new Context on the same client, or a new cluster of another
size), finalize and a new run, a file of a checkpoint erased or a byte of it flipped, a worker process SIGKILLed (its
node directory erased too, or not), and the live arrays computed.

The model keeps every committed checkpoint (the arrays' values at the call, its level, its groups, the state of each
file: sound, erased, unknown = a byte flipped) and FTI's retention. A recovery walks the checkpoints newest first as
the product does: one known recoverable (its damage within its level's tolerance) must come back bit for bit; before
it, those whose fate is unknown may come back instead; with none known recoverable, NoCheckpointError (arrays
untouched) is allowed too. Every error must be an ftidask error. Checkpoints retired by FTI's rule may still come back
(the Dask backend keeps a checkpoint live arrays read, and dCP's previous checkpoint), never ahead of one promised;
finalize with keep_last_ckpt may keep any of them (the newest that can be flushed). An asynchronous checkpoint whose
arrays may not compute may fail at its handle, at the wait or at the next checkpoint (docs/async.md): never committed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import ftidask
from ftidask import FTIError, NoCheckpointError, RecoveryError
from ftidask.storage.files import find_paths

IDS = (1, 2, 3)
DTYPES = (np.float64, np.float32, np.int32, np.uint8, np.int64, np.complex64)
SOUND, ERASED, UNKNOWN = "sound", "erased", "unknown"
CONFIGS = {
    "g3": dict(nworkers=3, cfg=dict(group_size=3)),
    "g2": dict(nworkers=4, cfg=dict(group_size=2)),
    "dcp": dict(nworkers=3, cfg=dict(group_size=3, enable_dcp=1, dcp_block_size=512)),
    "keep": dict(nworkers=3, cfg=dict(group_size=3, keep_last_ckpt=1)),
    "zstd": dict(nworkers=3, cfg=dict(group_size=3, compressor="zstd", enable_dcp=1, dcp_block_size=512)),
}


class Failed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


class Clusters:
    """The LocalCluster a run uses (one per test; replaced by a restart on another number of workers)."""

    def __init__(self, nworkers: int) -> None:
        self.cluster = self.client = None
        self.start(nworkers)

    def start(self, nworkers: int) -> None:
        import distributed

        self.close()
        self.nworkers = nworkers
        self.cluster = distributed.LocalCluster(n_workers=nworkers, threads_per_worker=1, processes=True,
                                                dashboard_address=":0", silence_logs=50)
        self.client = distributed.Client(self.cluster)
        self.client.wait_for_workers(nworkers, timeout=60)

    def workers(self) -> list[str]:
        return sorted(self.client.sync(self.client.scheduler.identity)["workers"])

    def kill(self, position: int) -> None:
        """SIGKILL the worker at ``position`` in the sorted addresses; wait until its nanny replaced it."""
        pids = self.client.run(os.getpid)
        address = sorted(pids)[position % len(pids)]
        os.kill(pids[address], signal.SIGKILL)
        end = time.monotonic() + 60
        while address in self.workers():
            check(time.monotonic() < end, "a killed worker stays listed")
            time.sleep(0.05)
        self.wait_workers()

    def wait_workers(self) -> None:
        """The cluster's workers back (a nanny that does not restart its killed worker, seen under load, is
        replaced: conftest.wait_for_replaced_workers)."""
        try:
            self.client.wait_for_workers(self.nworkers, timeout=60)
            return
        except Exception:  # WorkerStartTimeoutError
            pass
        stuck = [name for name, nanny in self.cluster.workers.items() if not nanny.is_alive()]
        self.cluster.scale(len(self.cluster.worker_spec) + len(stuck))
        self.client.wait_for_workers(self.nworkers, timeout=180)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            from daskclose import close_cluster

            close_cluster(self.cluster)
        self.cluster = self.client = None


class Run:
    def __init__(self, clusters: Clusters, base: Path, seed: int, cfg: dict) -> None:
        self.clusters, self.base, self.verbose = clusters, base, False
        self.rng = np.random.default_rng(seed)
        self.dirs = dict(ckpt_dir=str(base / "L"), glbl_dir=str(base / "G"), meta_dir=str(base / "M"), verbosity=3,
                         **cfg)
        self.dcp, self.keep_last = bool(cfg.get("enable_dcp")), bool(cfg.get("keep_last_ckpt"))
        self.compressed = cfg.get("compressor", "none") != "none"
        self.ckpts: list[dict] = []
        self.next_id, self.log, self.handles, self.times = 1, [], [], {}
        self.stats = dict.fromkeys(["exact", "either", "first", "fallback", "none", "damage", "kill", "restart",
                                    "cluster", "finalize", "fragile_error", "checkpoint"], 0)
        self.ctx = ftidask.init(client=self.client, **self.dirs)
        self.values: dict[int, np.ndarray] = {}
        self.arrays: dict = {}
        self.src: dict[int, dict | None] = {}  # the checkpoint each live array reads back its chunks from
        self.killed = False  # a worker killed since the live arrays were made: their lost chunks are read back
        self.readers: list[dict] = []  # the checkpoints whose lineage cut gave ctx.protected's arrays
        for vid in IDS:
            self.new_array(vid)

    @property
    def client(self):
        return self.clusters.client

    # --- values ------------------------------------------------------------------------------------------
    def draw_chunks(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(self.rng.integers(1, n + 1)) for n in shape)

    def new_array(self, vid: int, shape: tuple[int, ...] | None = None, dtype=None) -> None:

        if shape is None:
            shape = ((int(self.rng.integers(1, 300)),) if self.rng.random() < 0.5
                     else (int(self.rng.integers(1, 30)), int(self.rng.integers(1, 30))))
        dtype = np.dtype(DTYPES[int(self.rng.integers(len(DTYPES)))] if dtype is None else dtype)
        vals = (np.random.default_rng(int(self.rng.integers(1 << 30))).random(shape) * 200).astype(dtype)
        self.set_array(vid, vals, self.draw_chunks(shape))

    def set_array(self, vid: int, vals: np.ndarray, chunks) -> None:
        import dask.array as da

        self.values[vid] = vals
        self.arrays[vid] = da.from_array(vals.copy(), chunks=chunks)
        self.src[vid] = None
        self.ctx.protect(vid, self.arrays[vid])

    def refresh(self) -> None:
        """The application makes its arrays again from its values (after an allowed failure of its live arrays)."""
        for vid in IDS:
            self.set_array(vid, self.values[vid], self.arrays[vid].chunks)
        self.readers, self.killed = [], False

    def fragile(self) -> bool:
        """Whether the live arrays may fail to compute: a worker was killed and a checkpoint they read back from
        is damaged (or gone: passed over by a recovery, or retired after a finalize)."""
        readers = [c for c in self.src.values() if c is not None] + self.readers
        return self.killed and any(c["dead"] or c["gone"] or c["files"] is None or any(
            s != SOUND for s in c["files"].values()) for c in readers)

    # --- the model -----------------------------------------------------------------------------------------
    def commit(self, level: int, values: dict[int, np.ndarray], chunks: dict) -> dict:
        base = level - 4 if level > 4 else level
        # A differential checkpoint patches the spare, the file of a checkpoint of its level retired before: a block
        # of it damaged and unchanged since is carried into the new checkpoint (docs/dcp.md), found at recovery.
        # A checkpoint that carried such a block passes it on when it becomes the spare in turn.
        carried = level > 4 and any(o["retired"] and not o["gone"] and o["level"] == base and (o["carried"] or (
            o["files"] and any(s == UNKNOWN for s in o["files"].values()))) for o in self.ckpts)
        retires = [c for c in self.ckpts if not c["retired"] and c["level"] <= base]
        for c in retires:
            c["retired"] = True
        c = {"id": self.next_id, "level": base, "asked": level, "values": values, "chunks": chunks,
             "retired": False, "dead": False, "gone": False, "uncertain": carried, "carried": carried, "files": None,
             "groups": None, "retires": retires}
        self.ckpts.append(c)
        self.next_id += 1
        return c

    def fill(self) -> None:
        """The layout of the checkpoints committed since (ranks and groups: the workers at the call)."""
        recs = {r.ckpt_id: r for r in self.ctx.state.records()}
        for c in self.ckpts:
            if c["files"] is None and c["id"] in recs:
                rec = recs[c["id"]]
                n = rec.nranks
                c["groups"] = rec.extra.get("groups") or [list(range(n))]
                kinds = {1: ["rank"], 2: ["rank", "pcof"], 3: ["rank", "rsed"], 4: ["rank"]}[c["level"]]
                c["files"] = {(k, r): SOUND for k in kinds for r in range(n)}

    def group(self, c: dict, r: int) -> list[int]:
        return next(g for g in c["groups"] if r in g)

    def right(self, c: dict, r: int) -> int:
        g = self.group(c, r)
        return g[(g.index(r) + 1) % len(g)]

    def recoverable(self, c: dict, pessimistic: bool) -> bool:
        if c["files"] is None:
            return not pessimistic

        def lost(key: tuple[str, int]) -> bool:
            state = c["files"][key]
            return state != SOUND if pessimistic else state == ERASED
        nranks = len({r for _k, r in c["files"]})
        own = [r for r in range(nranks) if lost(("rank", r))]
        if c["level"] in (1, 4):
            return not own
        if c["level"] == 2:
            return not any(lost(("pcof", self.right(c, r))) for r in own)
        return all(sum(lost(("rank", r)) + lost(("rsed", r)) for r in g) <= len(g) for g in c["groups"])

    def candidates(self, partial: bool = False) -> tuple[list[dict], bool]:
        """The checkpoints a recovery may give, newest first, and whether NoCheckpointError is allowed.

        ``partial`` (recover(ids=...)): a checkpoint passed over by a full recovery may still give variables whose
        chunks verify (a flipped byte in another variable's chunk: the reads check the chunks they read)."""
        out = []
        for c in reversed(self.ckpts):
            if c["gone"]:
                continue
            if c["dead"]:
                if partial and self.recoverable(c, pessimistic=False):
                    out.append(c)
                continue
            if c["retired"]:
                out.append(c)  # kept for live arrays, or dCP's previous checkpoint: may come back, never promised
                continue
            if not self.recoverable(c, pessimistic=False):
                continue
            out.append(c)
            if not c["uncertain"] and self.recoverable(c, pessimistic=True):
                return out, False
        return out, True

    def recovered(self, got: dict | None, tried: list[dict]) -> None:
        self.stats["none" if got is None else "fallback" if got is not tried[0] else "first"] += 1
        for c in tried:
            if c is got:
                break
            if not c["retired"] and c is not got:
                c["dead"] = True
        if got is None or got["level"] not in (2, 3) or got["files"] is None:
            return
        files = got["files"]
        for g in got["groups"]:
            lost_own = any(files[("rank", r)] != SOUND for r in g)
            for r in g:
                if files[("rank", r)] == ERASED:
                    files[("rank", r)] = SOUND  # rebuilt
                for key in [k for k in files if k[1] == r and k[0] != "rank"]:
                    if lost_own and files[key] != SOUND:
                        files[key] = UNKNOWN  # rebuilt with the lost files, or left as it was
                    elif files[key] == ERASED:
                        files[key] = SOUND  # found missing by a stat: rebuilt

    # --- checks --------------------------------------------------------------------------------------------
    def same(self, got, want: np.ndarray, what: str) -> None:
        check(tuple(got.shape) == want.shape and np.dtype(got.dtype) == want.dtype,
              f"{what}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {want.shape}")
        data = np.asarray(got.compute())
        check(data.dtype == want.dtype and data.tobytes() == want.tobytes(), f"{what}: other values")

    def live_ok(self, what: str) -> bool:
        """Compute the live arrays: their model values, or (fragile) an ftidask error, then made anew."""
        try:
            for vid in IDS:
                self.same(self.arrays[vid], self.values[vid], f"{what}: live array {vid}")
        except FTIError as exc:
            check(self.fragile(), f"{what}: the live arrays failed: {type(exc).__name__}: {exc}")
            self.log.append(f"  live arrays failed (allowed): {type(exc).__name__}")
            self.stats["fragile_error"] += 1
            self.refresh()
            return False
        return True

    # --- operations ----------------------------------------------------------------------------------------
    def op_mutate(self) -> None:
        vid = int(self.rng.choice(IDS))
        if self.rng.random() < 0.5:
            k = int(self.rng.integers(1, 5))
            dtype = self.values[vid].dtype
            self.log.append(f"mutate {vid} +{k}")
            self.arrays[vid] = (self.ctx.protected[vid] + k).astype(dtype)
            self.values[vid] = (self.values[vid] + k).astype(dtype)
            self.ctx.protect(vid, self.arrays[vid])
        else:
            self.log.append(f"mutate {vid} new values")
            self.new_array(vid, self.values[vid].shape, self.values[vid].dtype)

    def op_reshape(self) -> None:
        vid = int(self.rng.choice(IDS))
        self.new_array(vid)
        self.log.append(f"reshape {vid} {self.values[vid].dtype} {self.values[vid].shape} "
                        f"chunks {self.arrays[vid].chunksize}")

    def op_rechunk(self) -> None:
        vid = int(self.rng.choice(IDS))
        chunks = self.draw_chunks(self.values[vid].shape)
        self.log.append(f"rechunk {vid} {chunks}")
        self.arrays[vid] = self.ctx.protected[vid].rechunk(chunks)
        self.ctx.protect(vid, self.arrays[vid])

    def op_checkpoint(self) -> None:
        level = int(self.rng.integers(1, 9 if self.dcp else 5))
        wait = bool(self.rng.random() < 0.6)
        self.clusters.wait_workers()
        rebind = bool(self.rng.random() < 0.7)
        self.log.append(f"checkpoint {self.next_id} L{level} wait={wait} rebind={rebind}")
        values = {vid: v.copy() for vid, v in self.values.items()}
        chunks = {vid: self.ctx.protected[vid].chunks for vid in IDS}
        fragile, later = self.fragile(), False
        try:
            out = self.ctx.checkpoint(self.next_id, level, wait=wait)
            if not wait:
                if self.rng.random() < 0.5:
                    out.result()
                else:
                    later = True
        except ftidask.LevelError as exc:  # a worker dropped out under load (not restarted yet): said so
            check(len(self.clusters.workers()) < 2 and "needs at least 2" in str(exc), f"checkpoint: {exc}")
            self.log.append(f"  refused: {exc}")
            self.clusters.wait_workers()
            return
        except FTIError as exc:
            if self.pending_failed(exc):
                return  # an asynchronous checkpoint in flight failed, raised by this call: this one was not taken
            check(self.fragile(), f"checkpoint failed: {type(exc).__name__}: {exc}")
            self.log.append(f"  failed (allowed): {exc}")
            self.stats["fragile_error"] += 1
            self.refresh()
            return
        c = self.commit(level, values, chunks)
        self.readers.append(c)
        self.stats["checkpoint"] += 1
        if later:  # its failure (allowed where it was fragile at the call) is raised by its handle or the next call
            self.handles.append((out, c, fragile))
        if wait:
            self.fill()
        if rebind:  # the loop of docs/dask.md: x = ctx.protected[1], read back from this checkpoint if lost
            if not wait:
                self.settle()
                if c["gone"]:
                    return
            self.arrays = dict(self.ctx.protected)
            self.src = dict.fromkeys(IDS, c)
            self.killed = False

    def op_incremental(self) -> None:
        level = int(self.rng.integers(1, 9 if self.dcp else 5))
        order = [int(v) for v in self.rng.permutation(IDS)]
        self.log.append(f"incremental {self.next_id} L{level} order={order}")
        self.settle()
        values = {vid: v.copy() for vid, v in self.values.items()}
        chunks = {vid: self.ctx.protected[vid].chunks for vid in IDS}
        if self.compressed and level <= 4:  # refused at init_icp on every backend (docs/dask.md)
            try:
                self.ctx.init_icp(self.next_id, level)
            except ftidask.CheckpointError as exc:
                check("uncompressed" in str(exc), f"init_icp: {exc}")
                self.log.append("  refused: compressed")
                return
            raise Failed("init_icp accepted a compressor at a full level")
        try:
            self.ctx.init_icp(self.next_id, level)
            for vid in order:
                self.ctx.add_var_icp(vid)
                if self.rng.random() < 0.5:  # changed after its write: not in the checkpoint
                    self.new_array(vid, self.values[vid].shape, self.values[vid].dtype)
            self.ctx.finalize_icp()
        except FTIError as exc:
            check(self.fragile(), f"incremental checkpoint failed: {type(exc).__name__}: {exc}")
            self.log.append(f"  failed (allowed): {exc}")
            self.stats["fragile_error"] += 1
            self.refresh()
            return
        self.commit(level, values, chunks)
        self.stats["checkpoint"] += 1
        self.fill()

    def _files(self, c: dict) -> list[tuple[tuple[str, int], Path]]:
        out = []
        for p in sorted(find_paths(self.base, f"ckpt{c['id']}.s*/Ckpt{c['id']}-*")):
            if ".trash" in str(p) or not p.is_file():
                continue
            stem = p.name.split("-", 1)[1].split(".")[0]
            for kind, prefix in (("rank", "Rank"), ("pcof", "Pcof"), ("rsed", "RSed")):
                if stem.startswith(prefix):
                    out.append(((kind, int(stem[len(prefix):])), p))
        return out

    def op_damage(self) -> None:
        self.settle()
        alive = [c for c in self.ckpts if not c["retired"] and not c["dead"] and not c["gone"] and c["files"]]
        if not alive:
            return
        c = alive[-1] if self.rng.random() < 0.6 else alive[int(self.rng.integers(len(alive)))]
        found = self._files(c)
        erase, where = bool(self.rng.random() < 0.5), float(self.rng.uniform(0.0, 1.0))
        if not found:
            return
        key, path = found[int(self.rng.integers(len(found)))]
        if key not in c["files"]:
            raise Failed(f"checkpoint {c['id']}: an unexpected file {path}")
        if erase:
            path.unlink()
        else:
            raw = bytearray(path.read_bytes())
            if not raw:
                return
            raw[min(int(len(raw) * where), len(raw) - 1)] ^= 0xFF
            path.write_bytes(bytes(raw))
        self.log.append(f"damage ckpt {c['id']} {path.name} {'erase' if erase else f'flip@{where:.2f}'}")
        self.stats["damage"] += 1
        # A .hash record erased or changed: the parity is unknown, as a flipped byte
        c["files"][key] = ERASED if erase and path.suffix == ".fti" else UNKNOWN

    def op_kill(self) -> None:
        self.settle()
        position = int(self.rng.integers(self.clusters.nworkers))
        lose_node = bool(self.rng.random() < 0.4)
        self.log.append(f"kill worker {position} lose_node={lose_node}")
        self.clusters.kill(position)
        self.stats["kill"] += 1
        self.killed = True
        if lose_node:
            shutil.rmtree(self.base / "L" / f"node{position}", ignore_errors=True)
            for c in self.ckpts:
                if c["level"] != 4 and c["files"]:
                    for key in c["files"]:
                        if key[1] == position:
                            c["files"][key] = ERASED
        # The chunks the worker held alone are read back (persisted arrays: at once, before the erasure or after), and
        # an L3 read whose rank file is missing rebuilds it from the group's parity, where recovery would
        # (docs/dask-lineage.md): an erased rank file of an L3 checkpoint the live arrays read may be there again.
        readers = [c for c in self.src.values() if c is not None] + self.readers
        for c in readers:
            if c["level"] == 3 and c["files"]:
                for key, state in c["files"].items():
                    if key[0] == "rank" and state == ERASED:
                        c["files"][key] = UNKNOWN

    def op_compute(self) -> None:
        self.log.append("compute the live arrays")
        self.settle()
        self.live_ok("compute")

    def settle(self) -> None:
        """Wait for the asynchronous checkpoints: each handle asked (an allowed failure: :meth:`async_failed`)."""
        handles, self.handles = self.handles, []
        for h, c, fragile in handles:
            try:
                h.result()
            except FTIError as exc:
                self.async_failed(c, fragile, exc)
        self.ctx.wait()
        self.fill()

    def pending_failed(self, exc: Exception) -> bool:
        """Whether ``exc`` (from a checkpoint call) is the failure of an asynchronous checkpoint in flight, raised by
        the next call as docs/async.md says (handled: :meth:`async_failed`)."""
        for entry in self.handles:
            h, c, fragile = entry
            if str(exc).startswith(f"asynchronous checkpoint {c['id']} ") and h.done():
                self.handles.remove(entry)
                self.async_failed(c, fragile, exc)
                return True
        return False

    def async_failed(self, c: dict, fragile: bool, exc: Exception) -> None:
        """An asynchronous checkpoint failed after its call: allowed where its arrays may not compute (fragile at
        the call); it was never committed (what its commit retired stays), and the arrays are made anew."""
        check(fragile, f"asynchronous checkpoint {c['id']} failed: {type(exc).__name__}: {exc}")
        self.log.append(f"  asynchronous checkpoint {c['id']} failed (allowed): {type(exc).__name__}")
        self.stats["fragile_error"] += 1
        c["gone"] = True
        for old in c["retires"]:
            old["retired"] = False
        self.refresh()

    def _restart_ctx(self) -> None:
        self.ctx = ftidask.init(client=self.client, **self.dirs)
        self.arrays, self.src, self.killed, self.readers = {}, dict.fromkeys(IDS), False, []
        self.values = {}

    def op_restart(self) -> None:
        new_cluster = bool(self.rng.random() < 0.25)
        nworkers = int(self.rng.integers(2, 5)) if new_cluster else self.clusters.nworkers
        self.log.append(f"restart new_cluster={new_cluster} nworkers={nworkers}")
        self.settle()
        self.ctx._close()  # the client ends without finalize: its checkpoints stay
        self.stats["restart"] += 1
        if new_cluster:
            self.clusters.start(nworkers)
            self.stats["cluster"] += 1
        self._restart_ctx()
        live = [c for c in self.ckpts if not c["dead"] and not c["gone"]]
        check(self.ctx.status() in ((1,) if live else (0, 1)), f"status {self.ctx.status()}")
        self.restart_recover()

    def restart_recover(self) -> None:
        """A new process: nothing protected; recover() returns every stored array, or nothing is left."""
        cands, none_ok = self.candidates()
        self.log.append(f"recover at restart expecting {[c['id'] for c in cands]} none_ok={none_ok}")
        try:
            out = self.ctx.recover()
        except NoCheckpointError as exc:
            check(none_ok, f"a recoverable checkpoint was not recovered: {exc}")
            self.recovered(None, cands)
            self.log.append("  -> NoCheckpointError")
            self.values = {}
            for vid in IDS:
                self.new_array(vid)
            return
        got = self.match(cands, out, IDS)
        self.recovered(got, cands)
        self.arrays = dict(out)
        self.values = {vid: got["values"][vid].copy() for vid in IDS}
        self.src = dict.fromkeys(IDS, got)

    def match(self, cands: list[dict], out: dict, vids, chunks: dict | None = None) -> dict:
        rf = self.ctx.recovered_from
        which = [c for c in cands if rf is not None and c["id"] == rf[0]]
        check(bool(which), f"recovered_from {rf}, candidates {[c['id'] for c in cands]}")
        c = which[0]
        check(sorted(out) == sorted(vids), f"recover returned ids {sorted(out)}, want {sorted(vids)}")
        for vid in vids:
            self.same(out[vid], c["values"][vid], f"checkpoint {c['id']} variable {vid}")
            want = (chunks or {}).get(vid)
            if want is not None:
                check(out[vid].chunks == want, f"variable {vid}: chunks {out[vid].chunks}, want {want}")
        self.log.append(f"  -> {c['id']}")
        return c

    def _protect_shapes_of(self, c: dict, vids) -> None:
        """Arrays of a checkpoint's shapes and dtypes protected where they differ (recover refuses others)."""
        import dask.array as da

        for vid in vids:
            want = c["values"][vid]
            if self.values[vid].shape != want.shape or self.values[vid].dtype != want.dtype:
                self.values[vid] = np.zeros(want.shape, want.dtype)
                self.arrays[vid] = da.zeros(want.shape, dtype=want.dtype, chunks=self.draw_chunks(want.shape))
                self.src[vid] = None
                self.ctx.protect(vid, self.arrays[vid])

    def _recover(self, vids, ckpt: dict | None = None) -> None:
        """recover() (of ``vids``; of checkpoint ``ckpt``), into arrays of the expected checkpoint's shapes."""
        if ckpt is None:
            cands, none_ok = self.candidates(partial=len(vids) < len(IDS))
        else:
            sure = not ckpt["dead"] and not ckpt["retired"] and not ckpt["uncertain"] and self.recoverable(ckpt, True)
            cands = [] if ckpt["dead"] or ckpt["gone"] or not self.recoverable(ckpt, False) else [ckpt]
            none_ok = not sure
        self.stats["exact" if len(cands) == 1 and not none_ok else "either"] += 1
        given = None
        if self.rng.random() < 0.3 and cands:
            given = {vid: self.draw_chunks(cands[0]["values"][vid].shape) for vid in vids}
        self.log.append(f"recover ids={list(vids)} ckpt={ckpt and ckpt['id']} expecting {[c['id'] for c in cands]} "
                        f"none_ok={none_ok} chunks={given}")
        untouched = {vid: self.ctx.protected[vid] for vid in IDS if vid not in vids}
        for i, target in enumerate(cands or [None]):
            if target is not None:
                self._protect_shapes_of(target, vids)
            before = {vid: self.ctx.protected[vid] for vid in IDS}
            try:
                out = self.ctx.recover(ckpt and ckpt["id"], ckpt and (ckpt["level"] if self.rng.random() < 0.5
                                                                      else None),
                                       chunks=given, ids=None if len(vids) == len(IDS) else list(vids))
            except RecoveryError as exc:
                check(all(self.ctx.protected[vid] is a for vid, a in before.items()),
                      "a refused recovery rebound an array")
                if isinstance(exc, NoCheckpointError):
                    check(none_ok, f"a recoverable checkpoint was not recovered: {exc}")
                    self.log.append("  -> NoCheckpointError")
                    if ckpt is None:
                        self.recovered(None, cands)
                    elif not ckpt["retired"]:
                        ckpt["dead"] = True
                    return
                # a fallback of other shapes: arrays of the next candidate's shapes
                check("protected array is" in str(exc) and i + 1 < len(cands), f"recover refused: {exc}")
                given = None
                continue
            want_chunks = None
            if given is not None and target is not None and i == 0:
                from dask.array.core import normalize_chunks

                want_chunks = {vid: normalize_chunks(given[vid], target["values"][vid].shape) for vid in vids}
            got = self.match(cands, out, vids, want_chunks if self.ctx.recovered_from[0] == target["id"] else None)
            self.recovered(got, cands)
            for vid in vids:
                self.arrays[vid] = out[vid]
                self.values[vid] = got["values"][vid].copy()
                self.src[vid] = got
            check(all(self.ctx.protected[vid] is a for vid, a in untouched.items()), "another variable changed")
            return
        raise Failed("recover() found no candidate to give")

    def op_recover(self) -> None:
        self.settle()
        if not self.live_ok("before recover"):
            return
        self._recover(IDS)

    def op_recover_var(self) -> None:
        self.settle()
        if not self.live_ok("before recover_var"):
            return
        self._recover((int(self.rng.choice(IDS)),))

    def op_recover_id(self) -> None:
        self.settle()
        kept = [c for c in self.ckpts if not c["retired"] and not c["gone"]]
        if not kept or not self.live_ok("before recover(ckpt_id)"):
            return
        self._recover(IDS, kept[int(self.rng.integers(len(kept)))])

    def _finalized(self, none_ok: bool) -> bool:
        """finalize: True when it finished; False when keep_last_ckpt found no checkpoint to flush, none being known
        recoverable: the engine raises the newest's error and the run keeps its checkpoints (docs/guide.md:
        finalize's clean-up failed), which a restart (done here) finds with status 1."""
        try:
            self.ctx.finalize()
        except ftidask.CheckpointError as exc:
            check(self.keep_last and none_ok and "keep_last_ckpt" in str(exc), f"finalize: {exc}")
            self.log.append(f"  finalize refused (allowed): {exc}")
            self._restart_ctx()
            check(self.ctx.status() == 1, f"status {self.ctx.status()} after a failed finalize")
            return False
        return True

    def op_finalize(self) -> None:
        """finalize, then a new run on the same directories (status 0; 2 with keep_last_ckpt)."""
        self.settle()
        self.log.append("finalize and start again")
        self.stats["finalize"] += 1
        cands, none_ok = self.candidates()
        if not self._finalized(none_ok):
            self.restart_recover()
            return
        for c in self.ckpts:
            c["gone"] = True
        if self.keep_last:
            # The newest checkpoint that can be flushed stays, at L4 (status 2): of those a recovery may give, one
            # retired by FTI's rule but kept for live arrays too (docs/dcp.md: the newest that can be flushed).
            self.ckpts = [dict(c, files=None, level=4, gone=False, dead=False, retired=False, kept=True,
                               uncertain=len(cands) > 1 or none_ok, groups=None) for c in reversed(cands)]
        else:
            self.ckpts = []
        self._restart_ctx()
        status = self.ctx.status()
        check(status in ((2, 0) if self.keep_last and none_ok else (2,) if self.ckpts else (0,)),
              f"status {status} after finalize")
        if status == 0:
            self.ckpts = []
        if self.ckpts and not any(c["uncertain"] for c in self.ckpts):
            self.ckpts = self.ckpts[:1]
        if self.ckpts:
            self.restart_recover()
            rf = self.ctx.recovered_from
            self.ckpts = [c for c in self.ckpts if rf is not None and c["id"] == rf[0]]
            for c in self.ckpts:
                c["uncertain"] = False
            self.fill()
        else:
            for vid in IDS:
                self.new_array(vid)

    OPS = [("op_mutate", 3), ("op_reshape", 1), ("op_rechunk", 0.7), ("op_checkpoint", 4), ("op_incremental", 1),
           ("op_recover", 1.5), ("op_recover_var", 0.7), ("op_recover_id", 0.7), ("op_restart", 1),
           ("op_damage", 2), ("op_kill", 0.7), ("op_compute", 0.8), ("op_finalize", 0.25)]

    def step(self) -> None:
        names = [n for n, _ in self.OPS]
        weights = np.array([w for _, w in self.OPS], dtype=float)
        name = str(self.rng.choice(names, p=weights / weights.sum()))
        if self.verbose:
            print(f"  {len(self.log)} {name}", flush=True)  # where a hang stopped
        t = time.monotonic()
        getattr(self, name)()
        took = time.monotonic() - t
        self.times[name] = self.times.get(name, 0.0) + took
        if took > 10:
            self.log.append(f"  ({name} took {took:.0f} s)")

    def close(self) -> None:
        try:
            self.settle()
            if not self._finalized(self.candidates()[1]):  # (the last recovery may have found none: keep seed 3029)
                self.ctx._close()
        except Exception:
            self.ctx._close()
            raise


def run_seed(clusters: Clusters, name: str, base: Path, steps: int, seed: int, verbose: bool = False) -> dict:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    spec = CONFIGS[name]
    if clusters.nworkers != spec["nworkers"] or clusters.client is None:
        clusters.start(spec["nworkers"])
    run = None
    try:
        run = Run(clusters, base, seed, spec["cfg"])
        run.verbose = verbose
        for _ in range(steps):
            run.step()
        run.op_recover()
        run.close()
        return {"ok": True, "log": run.log, "stats": run.stats, "times": {k: round(v, 1) for k, v in run.times.items()}}
    except Exception as exc:
        if run is not None:
            try:
                run.ctx._close()
            except Exception:
                pass
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                "log": run.log if run else []}


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    name, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    clusters = Clusters(CONFIGS[name]["nworkers"])
    try:
        for seed in map(int, sys.argv[4:]):
            t = time.monotonic()
            res = run_seed(clusters, name, out / f"s{seed}", steps, seed, verbose=True)
            (out / f"result-{name}-{seed}.json").write_text(json.dumps(res, default=str))
            print(f"seed {seed} {'ok' if res['ok'] else 'FAILED'} {time.monotonic() - t:.1f}s "
                  f"{res.get('stats', '')} {res.get('times', '')}", flush=True)
            if res["ok"]:
                shutil.rmtree(out / f"s{seed}", ignore_errors=True)
            else:
                print(res["error"][-3000:], flush=True)
                clusters.start(CONFIGS[name]["nworkers"])  # a fresh cluster for the next seed
    finally:
        clusters.close()


if __name__ == "__main__":
    main()
