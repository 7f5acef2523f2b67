"""A differential checkpoint (levels 5-8) of thousands of variables: each variable's containers come from the layout's
index, as for a full checkpoint (the dCP writer scanned every container of the file twice per variable: 7 s for a
checkpoint of 5000 arrays of 1 KiB that L1 writes in 0.3 s)."""

from __future__ import annotations

import numpy as np

import ftidask
from ftidask.ftiff.layout import Slot


def test_a_differential_checkpoint_looks_at_each_container_a_few_times_not_once_per_variable(dirs, monkeypatch):
    n = 600
    data = [np.random.default_rng(i).random(16) for i in range(n)]
    with ftidask.init(**dirs, enable_dcp=1) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        ctx.checkpoint(1, 5)
        for a in data[::3]:
            a += 1.0
        reads = [0]
        plain = object.__getattribute__

        def counting(self, attr):
            if attr == "var_id":
                reads[0] += 1
            return plain(self, attr)

        monkeypatch.setattr(Slot, "__getattribute__", counting)
        ctx.checkpoint(2, 5)
        monkeypatch.undo()
        assert reads[0] < 20 * n, f"{reads[0]} reads of a container's variable for {n} variables"  # n * n before
        out = [np.zeros(16) for _ in range(n)]
        for i, a in enumerate(out):
            ctx.protect(i, a)
        ctx.recover()
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
