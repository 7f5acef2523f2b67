"""The single-process API driven by random sequences of calls (hypothesis' stateful testing) against a model.

The model keeps every committed checkpoint (the arrays' values at the call, its level) and FTI's retention:
a level-L commit retires the older checkpoints of levels up to L. Between the calls the arrays change in place,
are replaced by ones of another size, checkpoints are written at levels 1, 4, 5 and 8 (differential), waited for
or not, incrementally, and the process "restarts" (the context closed as a job that ends, a new init, new
arrays). Checked at every recovery: the arrays hold exactly the newest retained checkpoint, bit for bit. Once a
file of the newest checkpoint was damaged (a byte flipped), a recovery may fall back: it must then give exactly
the values of a checkpoint that was committed, every variable from the same one, or raise NoCheckpointError
with the arrays untouched; never a mix, never bytes that were not checkpointed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ftidask
from ftidask import NoCheckpointError, RecoveryError
from ftidask.storage.files import find_paths

IDS = (1, 2, 3)
DTYPES = {1: np.float64, 2: np.int32, 3: np.uint8}
DERANDOMIZE = True  # the same sequences on every run (CI); set False to explore new ones
LEVELS = {1: 1, 4: 4, 5: 1, 8: 4}  # the level asked -> the level whose older checkpoints it retires


def snapshot_of(arrays: dict[int, np.ndarray]) -> dict[int, bytes]:
    return {vid: a.tobytes() for vid, a in arrays.items()}


class ApiMachine(RuleBasedStateMachine):
    config: dict = {}

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="ftidask-sm-"))
        self.dirs = dict(ckpt_dir=str(self.tmp / "L"), glbl_dir=str(self.tmp / "G"), meta_dir=str(self.tmp / "M"),
                         verbosity=4, **self.config)
        self.ctx = ftidask.init(**self.dirs)
        self.rng = np.random.default_rng(0)
        self.arrays = {vid: self._new(vid, 3000 + 1000 * vid) for vid in IDS}
        for vid, a in self.arrays.items():
            self.ctx.protect(vid, a)
        self.committed: list[dict] = []  # {"id", "level", "values", "retired"}, oldest first
        self.next_id = 1
        self.damaged = False  # a file of a retained checkpoint was damaged (cleared once it is retired)
        self.damaged_ckpt: dict | None = None

    def _new(self, vid: int, n: int) -> np.ndarray:
        return (self.rng.random(n) * 250).astype(DTYPES[vid])

    def _commit(self, level: int, values: dict[int, bytes]) -> None:
        base = LEVELS[level]
        for c in self.committed:
            if not c["retired"] and c["level"] <= base:
                c["retired"] = True
        self.committed.append({"id": self.next_id, "level": base, "values": values, "retired": False})
        if self.damaged_ckpt is not None and self.damaged_ckpt["retired"]:
            self.damaged, self.damaged_ckpt = False, None
        self.next_id += 1

    def _retained(self) -> dict | None:
        alive = [c for c in self.committed if not c["retired"]]
        return alive[-1] if alive else None

    # --- the application's work -------------------------------------------------------------------------------
    @rule(vid=st.sampled_from(IDS), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
    def mutate(self, vid: int, frac: float, seed: int) -> None:
        a = self.arrays[vid]
        idx = np.random.default_rng(seed).random(a.size) < frac
        a[idx] = (a[idx] + 7).astype(a.dtype)

    @rule(vid=st.sampled_from(IDS), n=st.integers(1, 9000))
    def resize(self, vid: int, n: int) -> None:
        self.arrays[vid] = self._new(vid, n)
        self.ctx.protect(vid, self.arrays[vid])

    # --- checkpoints ------------------------------------------------------------------------------------------
    @rule(level=st.sampled_from(sorted(LEVELS)), wait=st.booleans())
    def checkpoint(self, level: int, wait: bool) -> None:
        if not self.config.get("enable_dcp"):
            level = LEVELS[level]  # 5 and 8 need enable_dcp
        values = snapshot_of(self.arrays)
        out = self.ctx.checkpoint(self.next_id, level, wait=wait)
        if not wait:
            mutate_at_once = self.arrays[1]
            mutate_at_once[:1] += 1  # the checkpoint holds the values at the call
            out.result()
        self._commit(level, values)

    @rule(level=st.sampled_from([1, 4]))
    def incremental(self, level: int) -> None:
        if self.config.get("compressor"):
            level += 4  # an incremental checkpoint is written uncompressed: a differential level (documented)
        if self.config.get("l4_format") == "zarr":
            level = 1  # and as an FTI-FF file: not at a Zarr level 4
        values = snapshot_of(self.arrays)
        self.ctx.init_icp(self.next_id, level)
        for vid in IDS:
            self.ctx.add_var_icp(vid)
        self.ctx.finalize_icp()
        self._commit(level, values)

    # --- failures and restarts -------------------------------------------------------------------------------
    @precondition(lambda self: self._retained() is not None and not self.damaged)
    @rule(where=st.floats(0.05, 0.95))
    def damage_newest(self, where: float) -> None:
        newest = self._retained()
        self.ctx.wait()
        name = f"Ckpt{newest['id']}-Rank0.fti"
        for _ in range(5):  # the retired checkpoints' trash is removed in the background meanwhile
            try:
                files = [p for p in sorted(find_paths(self.tmp, name)) if ".trash-" not in str(p)]
                if not files:
                    return
                raw = bytearray(files[0].read_bytes())
                break
            except FileNotFoundError:
                continue
        else:
            return
        raw[int(len(raw) * where)] ^= 0xFF
        files[0].write_bytes(bytes(raw))
        self.damaged, self.damaged_ckpt = True, newest

    @rule()
    def restart(self) -> None:
        self.ctx._close()  # the job ends without finalize: its checkpoints stay
        self.ctx = ftidask.init(**self.dirs)
        assert self.ctx.status() == (1 if self._retained() is not None or self.damaged else 0) or self.damaged
        self.arrays = {vid: self._new(vid, 5) for vid in IDS}  # a new process's arrays (realloc'd below)
        for vid, a in self.arrays.items():
            self.ctx.protect(vid, a)
        self.recover()

    @rule()
    def recover(self) -> None:
        expected = self._retained()
        if expected is not None:  # arrays of the stored size where they differ
            for vid in IDS:
                if len(expected["values"][vid]) != self.arrays[vid].nbytes:
                    try:
                        self.arrays[vid] = self.ctx.realloc(vid)
                    except NoCheckpointError:
                        assert self.damaged
        before = snapshot_of(self.arrays)
        try:
            try:
                self.ctx.recover()
            except RecoveryError as exc:  # the fallback's arrays have other sizes: realloc'd to them, then again
                if isinstance(exc, NoCheckpointError):
                    raise
                assert self.damaged and "realloc" in str(exc), exc
                assert snapshot_of(self.arrays) == before, "a refused recovery touched the arrays"
                self.arrays = {vid: self.ctx.realloc(vid) for vid in IDS}
                before = snapshot_of(self.arrays)
                self.ctx.recover()
        except NoCheckpointError:
            assert expected is None or self.damaged, "a sound checkpoint was not recovered"
            assert snapshot_of(self.arrays) == before, "a refused recovery touched the arrays"
            return
        got = snapshot_of(self.arrays)
        if not self.damaged:
            assert expected is not None and got == expected["values"], "not the newest retained checkpoint"
            return
        matches = [c for c in self.committed if c["values"] == got]
        assert matches, "the arrays hold values no checkpoint committed"
        # the model follows what was recovered: the checkpoints after it are of no use (damaged or retired)
        for c in self.committed:
            if c["id"] > matches[-1]["id"]:
                c["retired"] = True
        matches[-1]["retired"] = False
        self.damaged, self.damaged_ckpt = False, None

    @rule(vid=st.sampled_from(IDS))
    def recover_var(self, vid: int) -> None:
        expected = self._retained()
        others = {v: a.tobytes() for v, a in self.arrays.items() if v != vid}
        if expected is not None and len(expected["values"][vid]) != self.arrays[vid].nbytes:
            try:
                self.arrays[vid] = self.ctx.realloc(vid)
            except NoCheckpointError:
                assert self.damaged
        before = self.arrays[vid].tobytes()
        try:
            self.ctx.recover_var(vid)
        except RecoveryError as exc:  # NoCheckpointError, or a fallback of another size (after damage)
            assert self.damaged or (expected is None and isinstance(exc, NoCheckpointError)), exc
            assert self.arrays[vid].tobytes() == before, "a refused recovery touched the array"
            return
        finally:
            assert {v: a.tobytes() for v, a in self.arrays.items() if v != vid} == others, "another variable changed"
        got = self.arrays[vid].tobytes()
        if not self.damaged:
            assert expected is not None and got == expected["values"][vid], "not the newest retained checkpoint"
        else:
            assert any(c["values"][vid] == got for c in self.committed), "values no checkpoint committed"

    @invariant()
    def protected_are_ours(self) -> None:
        assert all(self.ctx.protected[vid] is self.arrays[vid] for vid in IDS)

    def teardown(self) -> None:
        import shutil

        try:
            self.ctx.finalize()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


CONFIGS = {
    "plain": {},
    "dcp-async": dict(enable_dcp=1, dcp_block_size=4096, max_inflight=2),
    "zarr-l4": dict(l4_format="zarr"),
    "zstd-copy": dict(compressor="zstd", async_snapshot="copy", enable_dcp=1, dcp_block_size=4096),
}


def run_machine(config: dict, examples: int, steps: int) -> None:
    machine = type("Machine", (ApiMachine,), {"config": config})
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow], derandomize=DERANDOMIZE,
                                         phases=[p for p in Phase if p is not Phase.explain])
    machine.TestCase().runTest()


@pytest.mark.parametrize("name", CONFIGS)
def test_random_call_sequences_recover_what_was_committed(name):
    run_machine(CONFIGS[name], examples=6, steps=12)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CONFIGS)
def test_random_call_sequences_recover_what_was_committed_long(name):
    run_machine(CONFIGS[name], examples=30, steps=25)


def test_a_variable_protected_after_init_icp_is_said_so(tmp_path):
    """add_var_icp of a variable protected after init_icp said it had "N bytes, None when checkpoint 2 started"."""
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"))
    ctx.protect(1, np.zeros(4))
    ctx.init_icp(2, 1)
    ctx.protect(3, np.zeros(5))
    with pytest.raises(ftidask.CheckpointError, match="variable 3 was not protected when checkpoint 2 started"):
        ctx.add_var_icp(3)
    ctx.add_var_icp(1)
    # Committed without it, the checkpoint could not be recovered by a restart protecting the same variables
    with pytest.raises(ftidask.CheckpointError, match=r"misses protected variables \[3\] protected after init_icp"):
        ctx.finalize_icp()
    assert ctx.stored_size(1) == 0  # nothing committed
    ctx.init_icp(3, 1)
    ctx.add_var_icp(1)
    ctx.add_var_icp(3)
    ctx.finalize_icp()
    ctx.finalize()


def test_finalize_icp_names_each_missing_variable_for_its_own_reason(tmp_path):
    """A variable never added and one protected after init_icp were both reported as "protected after init_icp",
    under the first one's id only."""
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"))
    ctx.protect(0, np.arange(10.0))
    ctx.protect(1, np.arange(5.0))
    ctx.checkpoint(1, 1)
    ctx.init_icp(2, 1)
    ctx.add_var_icp(0)
    ctx.protect(5, np.ones(3))
    with pytest.raises(ftidask.CheckpointError) as err:
        ctx.finalize_icp()
    assert "variables [1] never added; variables [5] protected after init_icp" in str(err.value)
    assert ctx.stored_size(1) == 5 * 8  # checkpoint 1 kept
    ctx.finalize()
