"""Clear ftidask errors instead of raw exceptions from deep inside (issue 12, item 9).

Each case below once ended in a raw OSError, AttributeError, ValueError, UnicodeDecodeError,
OverflowError... or was silently accepted; now it is an FTIError subclass that says what is
wrong, and nothing is left half-done (no temporary file, no partly filled array, the previous
checkpoint intact).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from diskfull import fill, full_commit_records, tmpfs
from mpi_util import need_mpi, run

import ftidask
from ftidask.storage.files import find_paths

# --- a commit record on a full meta_dir ------------------------------------------------------------


@pytest.fixture
def inprocess_client():
    """Two Dask workers in this process: a commit-record writer patched here is the one the client uses."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


def _temp_files(root: Path) -> list[Path]:
    return [p for p in find_paths(root, "*") if ".tmp-" in p.name]


def _check_previous_recovers(dirs, expected: np.ndarray) -> None:
    ctx = ftidask.init(**dirs)
    out = np.zeros_like(expected)
    ctx.protect(1, out)
    ctx.recover()
    assert ctx.recovered_from == (1, 1)
    np.testing.assert_array_equal(out, expected)
    ctx.finalize()


def test_commit_record_on_full_disk_is_a_checkpoint_error(dirs, monkeypatch):
    ctx = ftidask.init(**dirs)
    data = np.arange(1000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    full_commit_records(monkeypatch.setattr)  # the commit records' disk is full
    data += 1
    with pytest.raises(ftidask.CheckpointError, match="commit record.*No space left"):
        ctx.checkpoint(2, 1)
    monkeypatch.undo()
    assert _temp_files(Path(dirs["meta_dir"])) == []
    assert ctx.last_checkpoint.id == 1
    ctx._close()  # a crashed process: the next one restarts
    _check_previous_recovers(dirs, np.arange(1000.0))


def test_commit_record_on_a_really_full_meta_dir(tmp_path, dirs):
    with tmpfs(tmp_path / "small", "256k") as small:
        dirs = dict(dirs, meta_dir=str(small / "Meta"))
        ctx = ftidask.init(**dirs)
        data = np.arange(1000.0)
        ctx.protect(1, data)
        ctx.checkpoint(1, 1)
        filler = fill(small)
        data += 1
        with pytest.raises(ftidask.CheckpointError, match="commit record"):
            ctx.checkpoint(2, 1)
        assert _temp_files(small) == []
        assert not list(find_paths(Path(dirs["ckpt_dir"]), "ckpt2.*"))  # the uncommitted files are gone too
        filler.unlink()
        ctx._close()
        _check_previous_recovers(dirs, np.arange(1000.0))


@pytest.mark.dask
@pytest.mark.timeout(240)
def test_dask_commit_record_on_full_disk_is_a_checkpoint_error(dirs, monkeypatch, inprocess_client):
    da = pytest.importorskip("dask.array")
    client = inprocess_client
    ctx = ftidask.init(client=client, **dirs)
    first = da.arange(64.0, chunks=16).persist()
    ctx.protect(1, first)
    ctx.checkpoint(1, 1)
    full_commit_records(monkeypatch.setattr)  # the commit records' disk is full
    ctx.protect(1, (first + 1).persist())
    with pytest.raises(ftidask.CheckpointError, match="commit record.*No space left"):
        ctx.checkpoint(2, 1)
    monkeypatch.undo()
    assert _temp_files(Path(dirs["meta_dir"])) == []
    # os.walk, not rglob: the failed checkpoint's trash directory may vanish while it is scanned
    assert not [n for _d, dirnames, files in os.walk(dirs["ckpt_dir"]) for n in dirnames + files
                if n.startswith("ckpt2.")]
    ctx.protect(1, da.zeros(64, chunks=16).persist())
    ctx.recover()
    assert ctx.recovered_from == (1, 1)
    np.testing.assert_array_equal(ctx.protected[1].compute(), np.arange(64.0))
    ctx.finalize()


# --- configuration files and values -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["binary", "directory", "missing", "fifo", "nul in path", "not a path"])
def test_unreadable_config_is_a_config_error(tmp_path, kind):
    path: object = tmp_path / "config.fti"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 8)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opening it for reading would wait for a writer forever
    elif kind == "nul in path":
        path = str(path) + "\0x"
    elif kind == "not a path":
        path = 3  # open(3) would read file descriptor 3
    with pytest.raises(ftidask.ConfigError, match="config"):
        ftidask.load_config(path)


def test_key_in_the_wrong_section_is_named(tmp_path):
    cfg = tmp_path / "config.fti"
    cfg.write_text("[basic]\nckpt_l1 = 1\n[advanced]\nckpt_l4 = 5\n")
    with pytest.raises(ftidask.ConfigError, match=r"ckpt_l4.*\[advanced\].*belongs in \[basic\]"):
        ftidask.load_config(cfg)
    cfg.write_text("[DEFAULT]\nckpt_l4 = 5\n[basic]\n")  # no INI defaults: FTI has none
    with pytest.raises(ftidask.ConfigError, match=r"ckpt_l4.*\[DEFAULT\].*belongs in \[basic\]"):
        ftidask.load_config(cfg)
    cfg.write_text("[Basic]\nCkpt_L4 = 5\n[Advanced]\nl4_format = zarr\n")  # FTI's capitalised names are fine
    assert ftidask.load_config(cfg).ckpt_l4 == 5
    cfg.write_text("[basic]\nckpt_l5 = 5\n")
    with pytest.raises(ftidask.ConfigError, match=r"unknown key \[basic\] ckpt_l5.*did you mean"):
        ftidask.load_config(cfg)


def test_fti_config_files_load(tmp_path):
    """A config as FTI's own examples write it: FTI keys that ftidask has no use for are ignored."""
    cfg = tmp_path / "config.fti"
    cfg.write_text(
        "[Basic]\nHead = 0\nNode_size = 2\nCkpt_dir = ./Local\t#/path/to/local\nCkpt_L1 = 3\nDcp_L4 = 0\n"
        "keep_heads_alive = 0\ndcp_stack_size = 5\nCachedDCP = 0\nh5_single_file_keep = 0\n"
        "h5_single_file_prefix = VPR\nckpt_io = 3\nEnable_dCP = 0\ndCP_Mode = 0\n"
        "[Restart]\nFailure = 0\nExec_ID = XXXX-XX-XX_XX-XX-XX\n"
        "[Injection]\nrank = 0\nindex = 0\nnumber = 0\nposition = 0\nfrequency = 0\n"
        "[Advanced]\nBlock_size = 1024\nTransfer_size = 16\ngeneral_tag = 2612\nckpt_tag = 711\nstage_tag = 406\n"
        "final_tag = 3107\nLocal_test = 1\nlustre_striping_unit = 4194304\nlustre_stiping_factor = -1\n")
    config = ftidask.load_config(cfg)
    assert config.ckpt_l1 == 3 and config.node_size == 2 and config.local_test


@pytest.mark.parametrize("key", sorted(k for k, (_s, d) in ftidask.model.config.config_keys().items()
                                       if isinstance(d, int) and not isinstance(d, bool)))
def test_huge_integer_values_are_refused(tmp_path, key):
    with pytest.raises(ftidask.ConfigError, match=key):
        ftidask.load_config(**{key: 10**400})
    section = ftidask.model.config.config_keys()[key][0]
    cfg = tmp_path / "config.fti"
    cfg.write_text(f"[{section}]\n{key} = {2**63}\n")
    with pytest.raises(ftidask.ConfigError, match=key):
        ftidask.load_config(cfg)


def test_huge_stage_timeout_reaches_no_overflow(dirs):
    with pytest.raises(ftidask.ConfigError, match="stage_timeout"):
        ftidask.init(stage_timeout=10**400, enable_staging=1, **dirs)
    with pytest.raises(ftidask.ConfigError, match="mpi_tag"):
        ftidask.load_config(mpi_tag=10**6)  # above MPI's smallest tag bound (32767)


@pytest.mark.parametrize("value", ["a\0b", "\ud800"])
def test_directory_that_cannot_be_a_path_is_refused(dirs, value):
    with pytest.raises(ftidask.ConfigError, match="ckpt_dir"):
        ftidask.init(**dict(dirs, ckpt_dir=dirs["ckpt_dir"] + value))


def test_directory_given_as_bytes_or_path(dirs):
    config = ftidask.load_config(ckpt_dir=os.fsencode(dirs["ckpt_dir"]), glbl_dir=Path(dirs["glbl_dir"]))
    assert config.ckpt_dir == dirs["ckpt_dir"] and config.glbl_dir == dirs["glbl_dir"]


@pytest.mark.parametrize("spec", ["zstd:99999999999999999999999", "zstd:100", "lz4:99999999999", "blosc:10",
                                  "blosc-zstd:-1"])
def test_compressor_level_out_of_range_is_a_config_error(dirs, spec):
    with pytest.raises(ftidask.ConfigError, match="compressor"):
        ftidask.init(compressor=spec, **dirs)
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ConfigError):
        ctx.protect(1, np.zeros(3), compressor=spec)
    ctx.finalize()


# --- what protect accepts ------------------------------------------------------------------------------


def test_masked_array_is_refused_at_protect(dirs):
    ctx = ftidask.init(**dirs)
    masked = np.ma.masked_array(np.arange(6.0), mask=[0, 1, 0, 0, 1, 0])
    with pytest.raises(ftidask.ProtectError, match="masked"):
        ctx.protect(1, masked)
    assert 1 not in ctx.protected
    ctx.protect(1, masked.data)  # what the message suggests works
    ctx.protect(2, np.ma.getmaskarray(masked))
    ctx.checkpoint(1, 1)
    ctx.finalize()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # numpy's word on np.matrix
@pytest.mark.parametrize("l4_format", ["ftiff", "zarr"])
@pytest.mark.parametrize("make", [
    lambda: np.matrix(np.arange(6.0).reshape(2, 3)),
    lambda: np.matrix(np.arange(12.0).reshape(3, 4))[:, ::2],
    # values that read otherwise in the other byte order (zeros hid that Zarr's structured fields have none)
    lambda: np.rec.array(np.array([(1, 2.5), (3, -4.0), (5, 6.25)], dtype=[("a", "<i4"), ("b", "<f8")])),
    lambda: np.arange(6, dtype=">i8"),
], ids=["matrix", "strided-matrix", "recarray", "big-endian"])
def test_ndarray_subclasses_round_trip(dirs, l4_format, make):
    dirs = dict(dirs, l4_format=l4_format)
    ctx = ftidask.init(**dirs)
    data = make()
    data[...] = np.arange(data.size).reshape(data.shape).astype(data.dtype) if data.dtype.names is None else data
    ctx.protect(1, data)
    ctx.checkpoint(1, 4)
    ctx._close()
    ctx = ftidask.init(**dirs)
    out = make()
    ctx.protect(1, out)
    ctx.recover()
    assert type(out) is type(data)
    assert np.asarray(out).tobytes() == np.asarray(data).tobytes()
    ctx.finalize()


@pytest.mark.parametrize("dtype", [np.clongdouble, np.dtype([("a", "<i4", (2,))]), np.dtype([])],
                         ids=["complex256", "subarray-field", "no-field"])
def test_dtype_zarr_cannot_store_is_a_checkpoint_error(dirs, dtype):
    ctx = ftidask.init(l4_format="zarr", **dirs)
    ctx.protect(1, np.zeros(3, dtype))
    ctx.checkpoint(1, 1)
    with pytest.raises(ftidask.CheckpointError, match="Zarr cannot store"):
        ctx.checkpoint(2, 4)
    assert ctx.last_checkpoint.id == 1
    assert not list(find_paths(Path(dirs["glbl_dir"]), "*.tmp-*"))
    ctx.finalize()


# --- differential checkpoints with level 4 as Zarr -----------------------------------------------------


def test_dcp_recovers_from_a_zarr_level_4(dirs):
    dirs = dict(dirs, enable_dcp=1, l4_format="zarr")
    ctx = ftidask.init(**dirs)
    a, b = np.arange(5000.0), np.ones(300)
    ctx.protect(1, a)
    ctx.protect(2, b)
    ctx.checkpoint(1, 4)
    ctx._close()
    ctx = ftidask.init(**dirs)
    a2, b2 = np.zeros_like(a), np.zeros_like(b)
    ctx.protect(1, a2)
    ctx.protect(2, b2)
    ctx.recover()
    assert ctx.recovered_from == (1, 4)
    np.testing.assert_array_equal(a2, a)
    np.testing.assert_array_equal(b2, b)
    a2[:10] = -1  # differential checkpoints go on from the recovered state
    ctx.checkpoint(2, 8)
    ctx.checkpoint(3, 5)
    ctx._close()
    ctx = ftidask.init(**dirs)
    a3, b3 = np.zeros_like(a), np.zeros_like(b)
    ctx.protect(1, a3)
    ctx.protect(2, b3)
    ctx.recover()
    assert ctx.recovered_from == (3, 1)  # level 5: differential level 1
    np.testing.assert_array_equal(a3, a2)
    ctx.finalize()


# --- variable names in Zarr stores ---------------------------------------------------------------------

_ODD_NAMES = ["zarr.json", "ZARR.JSON", "ftidask-manifest.json", "a\0b", "x" * 300, "é" * 200, "\ud800", "c/d",
              "..", "__x", ".zattrs"]


@pytest.mark.parametrize("name", _ODD_NAMES, ids=range(len(_ODD_NAMES)))
def test_odd_variable_names_in_zarr(dirs, tmp_path, name):
    from ftidask.tools.zarr_export import export_checkpoint

    zarr = pytest.importorskip("zarr")
    ctx = ftidask.init(l4_format="zarr", **dirs)
    a, b = np.arange(4.0), np.ones(3)
    ctx.protect(1, a, name=name)
    ctx.protect(2, b, name="other")
    ctx.checkpoint(1, 1)
    exported = [export_checkpoint(None, tmp_path / "l1.zarr", **dirs)]  # from an FTI-FF file
    ctx.checkpoint(2, 4)  # level 4 as a Zarr store
    exported.append(export_checkpoint(None, tmp_path / "l4.zarr", **dirs))  # from that store
    for result in exported:
        assert result.arrays[1] == "other" and result.arrays[0] in (name, "var1")
        store = zarr.open_group(str(result.path), mode="r")
        assert np.array_equal(store[result.arrays[0]][...], a)
        assert store[result.arrays[0]].attrs["ftidask_id"] == 1
    ctx._close()
    ctx = ftidask.init(l4_format="zarr", **dirs)
    a2, b2 = np.zeros_like(a), np.zeros_like(b)
    ctx.protect(1, a2)
    ctx.protect(2, b2)
    ctx.recover()
    assert ctx.recovered_from == (2, 4)
    assert np.array_equal(a2, a) and np.array_equal(b2, b)
    ctx.finalize()


def test_protect_says_what_to_do_with_a_dask_array_without_dask(dirs):
    da = pytest.importorskip("dask.array")
    ctx = ftidask.init(**dirs)
    with pytest.raises(ftidask.ProtectError, match="Dask backend"):
        ctx.protect(1, da.zeros(4))
    ctx.finalize()


@pytest.mark.dask
def test_dask_backend_refuses_masked_chunks(dirs):
    da = pytest.importorskip("dask.array")
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        ctx = ftidask.init(client=client, **dirs)
        with pytest.raises(ftidask.ProtectError, match="masked"):
            ctx.protect(1, da.ma.masked_equal(da.arange(8, chunks=4), 3))
        ctx.protect(1, da.arange(8, chunks=4))
        ctx.finalize()


def test_init_takes_a_built_config(dirs):
    config = ftidask.load_config(**dirs)
    ctx = ftidask.init(config, ckpt_l1=2)
    assert ctx.config.ckpt_l1 == 2 and ctx.config.meta_dir == dirs["meta_dir"]
    ctx.finalize()


def test_mpi_commit_record_failure_fails_every_rank(tmp_path):
    nranks = 3
    run(nranks, "commit_fail_job.py", str(tmp_path), timeout=120)  # a rank left in a barrier would time out
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(nranks)]
    assert {r.get("error") for r in results} == {"CheckpointError"}, results
    assert len({r["message"] for r in results}) == 1 and "commit record" in results[0]["message"]
    assert all(r["source"] == [1, 1] and r["intact"] for r in results), results
    assert _temp_files(tmp_path / "Meta") == []


for _mark in need_mpi():
    test_mpi_commit_record_failure_fails_every_rank = _mark(test_mpi_commit_record_failure_fails_every_rank)


def test_keep_last_flush_on_full_meta_dir_is_a_checkpoint_error(dirs, monkeypatch):
    dirs = dict(dirs, keep_last_ckpt=1)
    ctx = ftidask.init(**dirs)
    data = np.arange(1000.0)
    ctx.protect(1, data)
    ctx.checkpoint(1, 1)
    full_commit_records(monkeypatch.setattr)  # the commit records' disk is full
    with pytest.raises(ftidask.CheckpointError, match="keep_last_ckpt.*commit record"):
        ctx.finalize()
    monkeypatch.undo()
    assert _temp_files(Path(dirs["meta_dir"])) == []
    assert not list(find_paths(Path(dirs["glbl_dir"]), "ckpt1.*"))  # the uncommitted L4 copy is gone
    _check_previous_recovers(dirs, np.arange(1000.0))  # the run was not finalized: it restarts


@pytest.mark.dask
@pytest.mark.timeout(240)
def test_dask_keep_last_flush_on_full_meta_dir_is_a_checkpoint_error(dirs, monkeypatch, inprocess_client):
    """The Dask client commits its L4 copy through the engine's seal too: the copy goes, the checkpoint stays."""
    da = pytest.importorskip("dask.array")
    client = inprocess_client
    dirs = dict(dirs, keep_last_ckpt=1)
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.arange(64.0, chunks=16).persist())
    ctx.checkpoint(1, 1)
    full_commit_records(monkeypatch.setattr)  # the commit records' disk is full
    with pytest.raises(ftidask.CheckpointError, match="keep_last_ckpt.*commit record.*No space left"):
        ctx.finalize()
    monkeypatch.undo()
    assert _temp_files(Path(dirs["meta_dir"])) == []
    # os.walk, not rglob: the uncommitted copy's trash directory may vanish while it is scanned
    assert not [n for _d, dirnames, files in os.walk(dirs["glbl_dir"]) for n in dirnames + files
                if n.startswith("ckpt1.")]
    ctx = ftidask.init(client=client, **dirs)  # the run was not finalized: it restarts from checkpoint 1
    ctx.protect(1, da.zeros(64, chunks=16).persist())
    ctx.recover()
    assert ctx.recovered_from == (1, 1)
    np.testing.assert_array_equal(ctx.protected[1].compute(), np.arange(64.0))
    ctx.finalize()
