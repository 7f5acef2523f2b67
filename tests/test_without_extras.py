"""A base install (``pip install -e .``, docs/installation.md: enough for one process and the command line) has no
numcodecs, which compression needs, and no zarr (both the ``zarr`` extra). A compressor asked for, or a compressed file
read, is then a one-line ftidask error that says what to install, at ``init``/``protect`` rather than at every
checkpoint; ``ftidask verify``/``inspect`` of a compressed file or a Zarr store print ``ftidask: error: ...`` (exit 2),
never a traceback, and never call a sound file damaged."""

import sys

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import ConfigError
from ftidask.tools.cli import main as cli_main

pytest.importorskip("numcodecs")  # the compressed file is written with it, then read as if it were not installed
HINT = "pip install 'ftidask[zarr]'"


def _dirs(tmp_path):
    return dict(ckpt_dir=tmp_path / "l", glbl_dir=tmp_path / "g", meta_dir=tmp_path / "m", verbosity=4)


@pytest.fixture
def no_numcodecs(monkeypatch):
    """``import numcodecs`` fails, as in an install without the zarr extra."""
    monkeypatch.setitem(sys.modules, "numcodecs", None)


def test_init_with_a_compressor_says_what_to_install(tmp_path, no_numcodecs):
    with pytest.raises(ConfigError, match=r"numcodecs.*" + HINT.replace("[", r"\[").replace("]", r"\]")):
        ftidask.init(**_dirs(tmp_path), compressor="zstd")
    assert not (tmp_path / "m").exists()  # refused before the run exists


def test_protect_with_a_compressor_says_what_to_install(tmp_path, no_numcodecs):
    ctx = ftidask.init(**_dirs(tmp_path))
    with pytest.raises(ConfigError, match="numcodecs") as info:
        ctx.protect(1, np.zeros(10), compressor="zstd")
    assert HINT in str(info.value)
    ctx.protect(1, np.zeros(10))  # the context goes on
    assert ctx.checkpoint(1, 1).id == 1
    ctx.finalize()


def test_cli_on_a_compressed_file_is_one_line(tmp_path, monkeypatch, capsys):
    ctx = ftidask.init(**_dirs(tmp_path), compressor="zstd")
    ctx.protect(1, np.zeros(1000))
    ctx.checkpoint(1, 1)
    path = next(tmp_path.glob("l/node0/*/l1/*/Ckpt1-Rank0.fti"))
    ctx._close()
    monkeypatch.setitem(sys.modules, "numcodecs", None)
    for argv in (["verify", str(path)], ["inspect", str(path)], ["verify", str(tmp_path / "l")]):
        capsys.readouterr()
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ftidask: error: ") and err.count("\n") == 1, err
        assert "numcodecs" in err and HINT in err, err


def test_cli_verify_of_a_zarr_store_without_zarr_is_an_error_not_damage(tmp_path, monkeypatch, capsys):
    """Without the zarr package, ``ftidask verify STORE`` said ``DAMAGED`` (exit 1) of a sound store."""
    pytest.importorskip("zarr")
    from ftidask.tools.zarr_export import export_checkpoint

    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(10.0))
    ctx.checkpoint(1, 1)
    ctx._close()
    store = tmp_path / "s.zarr"
    export_checkpoint(next(tmp_path.glob("l/node0/*/l1/ckpt1.s*")), store)
    monkeypatch.setitem(sys.modules, "zarr", None)
    capsys.readouterr()
    assert cli_main(["verify", str(store)]) == 2
    out, err = capsys.readouterr()
    assert "DAMAGED" not in out and err.startswith("ftidask: error: ") and HINT in err, out + err


def test_a_recovery_stops_at_a_compressed_checkpoint_it_cannot_read(tmp_path, monkeypatch):
    """Without numcodecs the newest checkpoint, compressed, cannot be decoded here: the recovery says what to install
    and recovers nothing. It went back to the older uncompressed one, which the next checkpoint would then have
    followed, retiring the newest: a state silently lost."""
    dirs = _dirs(tmp_path)
    with ftidask.init(**dirs) as ctx:
        a = np.arange(1000.0)
        ctx.protect(1, a)
        ctx.checkpoint(1, 4)  # an older one that stays (a level-1 commit retires levels 1 only)
        a += 1
        ctx.protect(1, a, compressor="zstd")
        ctx.checkpoint(2, 1)
        ctx._close()
    monkeypatch.setitem(sys.modules, "numcodecs", None)
    ctx = ftidask.init(**dirs)
    out = np.full(1000, -1.0)
    ctx.protect(1, out)
    with pytest.raises(ftidask.RecoveryError, match=r"checkpoint 2 \(level 1\) cannot be read.*numcodecs") as info:
        ctx.recover()
    assert HINT in str(info.value) and "nothing was recovered" in str(info.value)
    assert (out == -1).all()
    assert list(tmp_path.glob("l/node0/*/l1/ckpt2.s*/Ckpt2-Rank0.fti"))  # still there, to recover with numcodecs
    ctx._close()
    monkeypatch.delitem(sys.modules, "numcodecs")
    with ftidask.init(**dirs) as ctx:
        ctx.protect(1, out)
        ctx.recover()
    assert np.array_equal(out, np.arange(1000.0) + 1)


@pytest.mark.dask
def test_a_dask_recovery_stops_at_a_compressed_checkpoint_it_cannot_read(tmp_path, monkeypatch):
    """The same on a cluster whose workers lack numcodecs (threads of this process here, so that they share its
    modules): the check of the newest checkpoint's files says what to install, and nothing older is recovered."""
    da = pytest.importorskip("dask.array")
    distributed = pytest.importorskip("distributed")
    dirs = _dirs(tmp_path)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl, \
            distributed.Client(cl) as client:
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.arange(1000.0, chunks=250))
        ctx.checkpoint(1, 4)
        ctx.protect(1, da.arange(1000.0, chunks=250) + 1, compressor="zstd")
        ctx.checkpoint(2, 1)
        ctx._close()
        monkeypatch.setitem(sys.modules, "numcodecs", None)
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.zeros(1000, chunks=250))
        with pytest.raises(ftidask.RecoveryError, match=r"checkpoint 2 \(level 1\) cannot be read.*numcodecs") as info:
            ctx.recover()
        assert HINT in str(info.value) and "nothing was recovered" in str(info.value)
        ctx._close()
        monkeypatch.delitem(sys.modules, "numcodecs")
        ctx = ftidask.init(client=client, **dirs)
        ctx.protect(1, da.zeros(1000, chunks=250))
        assert np.array_equal(ctx.recover()[1].compute(), np.arange(1000.0) + 1)
        ctx._close()
