"""Property test: random protect/grow/shrink/checkpoint/restart sequences against a model."""

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftidask

DTYPES = [np.dtype("<f8"), np.dtype("<i4"), np.dtype("u1"), np.dtype([("a", "<i2"), ("b", "<f4")])]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("protect"), st.integers(1, 4), st.integers(0, 3000), st.sampled_from(range(len(DTYPES)))),
        st.tuples(st.just("touch"), st.integers(1, 4), st.integers(0, 2**31)),
        st.tuples(st.just("checkpoint"), st.integers(1, 5), st.sampled_from([1, 4])),
        st.tuples(st.just("restart")),
    ),
    min_size=1, max_size=25)


def _fill(arr, seed):
    raw = arr.reshape(-1).view(np.uint8)
    raw[:] = np.random.default_rng(seed).integers(0, 256, raw.size, dtype=np.uint8)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops)
def test_random_sequences_match_model(sequence):
    root = tempfile.mkdtemp()
    try:
        dirs = dict(ckpt_dir=root + "/L", glbl_dir=root + "/G", meta_dir=root + "/M", verbosity=4)
        ctx = ftidask.init(**dirs)
        live: dict[int, np.ndarray] = {}
        committed: dict[int, bytes] | None = None  # the model: bytes of each var at the newest checkpoint
        committed_meta: dict[int, tuple] = {}
        for op in sequence:
            if op[0] == "protect":
                _, vid, n, dt = op
                live[vid] = np.zeros(n, DTYPES[dt])
                _fill(live[vid], n)
                ctx.protect(vid, live[vid])
            elif op[0] == "touch" and op[1] in live:
                _fill(live[op[1]], op[2])
            elif op[0] == "checkpoint" and live:
                ctx.checkpoint(op[1], op[2])
                committed = {vid: a.tobytes() for vid, a in live.items()}
                committed_meta = {vid: (a.dtype, a.shape) for vid, a in live.items()}
            elif op[0] == "restart":
                ctx = ftidask.init(**dirs)
                if committed is None:
                    assert ctx.status() == 0
                    live = {}
                    continue
                assert ctx.status() == 1
                # A restarted code protects arrays of the stored size (via realloc) and recovers.
                live = {}
                for vid in committed:
                    live[vid] = ctx.realloc(vid, np.zeros(1, committed_meta[vid][0]))
                    live[vid][...] = np.zeros((), live[vid].dtype)
                ctx.recover()
                for vid, arr in live.items():
                    assert arr.dtype == committed_meta[vid][0] and arr.shape == committed_meta[vid][1]
                    assert arr.tobytes() == committed[vid], vid
    finally:
        shutil.rmtree(root, ignore_errors=True)
