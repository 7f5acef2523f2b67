"""Progress bars: when they show, and that the byte paths they use keep data bit for bit."""

import logging

import numpy as np
import pytest
from conftest import run_python

import ftidask
from ftidask.engine import progress


def test_enabled_rules():
    assert progress.enabled("on", 4) is True
    assert progress.enabled("off", 1) is False
    # auto: never above verbosity 2, and only in a terminal or a notebook
    assert progress.enabled("auto", 3) is False
    assert progress.enabled("auto", 2) == progress.interactive()


def test_auto_is_off_in_a_non_interactive_run():
    proc = run_python("from ftidask.engine import progress; print(progress.interactive(), progress.enabled('auto', 1))",
                      stdin=None)
    assert proc.stdout.split() == ["False", "False"]


def test_bar_kinds():
    assert isinstance(progress.bar(100, "x", mode="off"), progress._NoBar)
    assert isinstance(progress.bar(0, "x", mode="on"), progress._NoBar)
    tqdm = pytest.importorskip("tqdm")
    bar = progress.bar(100, "x", mode="on")
    try:
        assert isinstance(bar, tqdm.std.tqdm)
        assert bar.delay == progress.DELAY
    finally:
        bar.close()


@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_tracked_checkpoint_and_recovery_are_exact(tmp_path, monkeypatch, compressor):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(progress, "MIN_BYTES", 0)  # show bars for small test data
    dirs = dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m", progress="on")
    a = np.random.default_rng(3).random((300, 200))
    b = np.asfortranarray(np.arange(5000, dtype=np.int16).reshape(50, 100))
    c = np.arange(40.0)[::2]  # not contiguous
    ctx = ftidask.init(**dirs)
    ctx.protect(1, a, compressor=compressor)
    ctx.protect(2, b)
    ctx.protect(3, c)
    streams, bar = progress.tracked({1: ftidask.model.arrays.ArrayBytes(a)}, ctx.config, "t")
    assert isinstance(streams[1], progress.Tracked)
    bar.close()
    ctx.checkpoint(1, 1)
    ctx2 = ftidask.init(**dirs)
    outs = [np.zeros_like(a), np.zeros_like(b), np.zeros(20)]
    for i, o in enumerate(outs):
        ctx2.protect(i + 1, o)
    ctx2.recover()
    assert outs[0].tobytes() == a.tobytes() and outs[1].tobytes() == b.tobytes()
    assert np.array_equal(outs[2], c)


def test_verbosity_sets_the_logger_level(tmp_path):
    for verbosity, level in ((1, logging.DEBUG), (2, logging.INFO), (3, logging.WARNING), (4, logging.ERROR)):
        ftidask.init(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m",
                     verbosity=verbosity)
        assert logging.getLogger("ftidask").level == level
