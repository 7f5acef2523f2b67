"""Zarr interop: export (every level, several ranks), L4 written as Zarr, import back, damage."""

import json
import threading
import warnings

import numpy as np
import pytest

import ftidask
from ftidask.engine.checkpointing import write_rank_file
from ftidask.ftiff.layout import plan_layout
from ftidask.model.arrays import ArrayBytes, VarInfo
from ftidask.model.errors import FormatError, NoCheckpointError
from ftidask.storage.files import find_paths
from ftidask.tools.zarr_export import export_checkpoint, import_zarr, main, read_zarr
from ftidask.transport.base import Transport

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
da = pytest.importorskip("dask.array")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


def _dirs(tmp_path, sub="", **kw):
    return dict(ckpt_dir=tmp_path / sub / "l", glbl_dir=tmp_path / sub / "g", meta_dir=tmp_path / sub / "m", **kw)


def _state():
    x = np.linspace(0, 1, 300)
    return {
        1: ("temperature", np.outer(np.sin(6 * x), np.cos(4 * x))),
        2: ("fortran", np.asfortranarray(np.arange(24.0).reshape(4, 6))),
        3: ("counts", np.arange(7, dtype=">i4")),
        4: ("step", np.array(42, dtype=np.int64)),
        5: ("records", np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")])),
    }


def _protect(ctx, state, **kw):
    for vid, (name, arr) in state.items():
        ctx.protect(vid, arr, name=name, **kw)


def _check_store(path, state, *, xarray=True):
    group = zarr.open_group(str(path), mode="r")
    for _vid, (name, arr) in state.items():
        got = group[name][...]
        assert got.shape == arr.shape and np.array_equal(got, arr)
        if arr.dtype.isnative:
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(arr).tobytes()
        if arr.dtype.names is None:
            assert np.array_equal(da.from_zarr(str(path), component=name).compute(), arr)
    if xarray:
        ds = xr.open_zarr(path)
        assert ds["temperature"].values.tobytes() == state[1][1].tobytes()
    return group


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_export_single_process(tmp_path, level, compressor):
    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path))
    _protect(ctx, state, compressor=compressor)
    ctx.checkpoint(3, level)
    out = tmp_path / "out.zarr"
    result = export_checkpoint(None, out, **_dirs(tmp_path))
    assert (result.ckpt_id, result.level, result.nranks) == (3, level, 1)
    group = _check_store(out, state)
    assert group.attrs["checkpoint_id"] == 3 and group.attrs["level"] == level
    assert isinstance(group.attrs["time"], float)
    assert group["temperature"].attrs["ftidask_id"] == 1
    with pytest.raises(FileExistsError):
        export_checkpoint(None, out, **_dirs(tmp_path))


def test_export_from_l4_zarr_and_cli(tmp_path, capsys):
    state = _state()
    cfg = tmp_path / "fti.cfg"
    cfg.write_text(f"[basic]\nckpt_dir = {tmp_path}/l\nglbl_dir = {tmp_path}/g\nmeta_dir = {tmp_path}/m\n"
                   "[advanced]\nl4_format = zarr\n")
    ctx = ftidask.init(cfg)
    _protect(ctx, state)
    ctx.checkpoint(1, 4)
    assert main(["export", str(cfg), "--to-zarr", str(tmp_path / "cli.zarr")]) == 0
    assert "temperature" in capsys.readouterr().out
    _check_store(tmp_path / "cli.zarr", state)
    ckdir = next(tmp_path.glob("g/*/l4/ckpt1.s*"))
    assert main(["export", str(ckdir), "--to-zarr", str(tmp_path / "dir.zarr")]) == 0
    _check_store(tmp_path / "dir.zarr", state)
    assert main(["export", str(cfg), "--id", "9", "--to-zarr", str(tmp_path / "none.zarr")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    from ftidask.tools.cli import main as cli_main

    assert cli_main(["export", str(cfg), "--to-zarr", str(tmp_path / "cli.zarr")]) == 2  # exists
    assert cli_main(["export", str(cfg), "--to-zarr", str(tmp_path / "cli.zarr"), "--overwrite"]) == 0
    _check_store(tmp_path / "cli.zarr", state)


def test_l4_zarr_is_a_plain_zarr_store_and_recovers(tmp_path):
    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    _protect(ctx, state)
    ctx.checkpoint(1, 4)
    (store,) = tmp_path.glob("g/*/l4/ckpt1.s*/Ckpt1-Rank0.zarr")
    group = _check_store(store, state)
    assert group.attrs["checkpoint_id"] == 1 and group.attrs["level"] == 4
    assert not list(tmp_path.glob("g/*/l4/*/*.fti"))
    ctx2 = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    assert ctx2.status() == 1
    outs = {vid: np.zeros_like(arr) for vid, (_n, arr) in state.items()}
    for vid, out in outs.items():
        ctx2.protect(vid, out)
    ctx2.recover()
    assert ctx2.recovered_from == (1, 4)
    for vid, (_n, arr) in state.items():
        assert outs[vid].tobytes() == arr.tobytes()
        assert outs[vid].dtype == arr.dtype
    assert ctx2.stored_size(1) == state[1][1].nbytes


def test_l4_zarr_realloc_and_then_ftiff_levels(tmp_path):
    ctx = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    a = np.arange(100.0)
    ctx.protect(1, a, name="a")
    ctx.checkpoint(1, 4)
    ctx2 = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    new = ctx2.realloc(1)
    ctx2.recover()
    assert new.tobytes() == a.tobytes()
    new += 1
    ctx2.checkpoint(2, 1)  # level 1 stays FTI-FF
    assert list(tmp_path.glob("l/node0/*/l1/ckpt2.s*/Ckpt2-Rank0.fti"))


@pytest.mark.parametrize("damage", ["chunk", "delete", "metadata", "manifest", "extra"])
def test_damaged_zarr_l4_is_detected(tmp_path, damage):
    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    _protect(ctx, state)
    ctx.checkpoint(1, 4)
    (store,) = tmp_path.glob("g/*/l4/*/Ckpt1-Rank0.zarr")
    chunk = next(p for p in find_paths(store / "temperature", "*") if p.is_file() and p.name != "zarr.json")
    if damage == "chunk":
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        chunk.write_bytes(bytes(raw))
    elif damage == "delete":
        chunk.unlink()
    elif damage == "metadata":
        meta = json.loads((store / "temperature" / "zarr.json").read_text())
        meta["fill_value"] = 1.0
        (store / "temperature" / "zarr.json").write_text(json.dumps(meta))
    elif damage == "manifest":
        (store / "ftidask-manifest.json").write_text("{}")
    else:
        (store / "temperature" / "c" / "9").write_bytes(b"x")  # a file the checkpoint never had
    outs = {vid: np.full_like(arr, 3) for vid, (_n, arr) in state.items()}
    before = {vid: out.tobytes() for vid, out in outs.items()}
    ctx2 = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    for vid, out in outs.items():
        ctx2.protect(vid, out)
    if damage == "extra":  # an unlisted file is refused only if read: here it is never read
        ctx2.recover()
        return
    with pytest.raises(NoCheckpointError):
        ctx2.recover()
    assert all(out.tobytes() == before[vid] for vid, out in outs.items())  # nothing reached the arrays


def test_damaged_export_detected_on_read(tmp_path):
    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path))
    _protect(ctx, state)
    ctx.checkpoint(1, 1)
    out = tmp_path / "out.zarr"
    export_checkpoint(None, out, **_dirs(tmp_path))
    assert read_zarr(out)[1][1].tobytes() == state[1][1].tobytes()
    chunk = next(p for p in find_paths(out / "temperature", "*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x80
    chunk.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="does not match its hash"):
        read_zarr(out)
    with pytest.raises(FormatError):
        import_zarr(out, **_dirs(tmp_path, "new"))


def test_export_refuses_damaged_checkpoint(tmp_path):
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.arange(1000.0))
    ctx.checkpoint(1, 1)
    (path,) = tmp_path.glob("l/node0/*/l1/*/Ckpt1-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[200] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="cannot export"):
        export_checkpoint(None, tmp_path / "x.zarr", **_dirs(tmp_path))
    assert not (tmp_path / "x.zarr").exists()


def test_import_roundtrip_and_restart(tmp_path):
    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path))
    _protect(ctx, state)
    ctx.checkpoint(5, 1)
    out = tmp_path / "out.zarr"
    export_checkpoint(None, out, **_dirs(tmp_path))
    info = import_zarr(out, **_dirs(tmp_path, "new"))
    assert (info.id, info.level) == (5, 4)
    ctx2 = ftidask.init(**_dirs(tmp_path, "new"))
    assert ctx2.status() == 2
    outs = {vid: np.zeros_like(arr) for vid, (_n, arr) in state.items()}
    for vid, o in outs.items():
        ctx2.protect(vid, o)
    assert ctx2.snapshot() == ftidask.FTI_SCES
    for vid, (_n, arr) in state.items():
        assert outs[vid].tobytes() == arr.tobytes()


@pytest.mark.parametrize(("value", "want"), [(40, 40), (None, 1), ("abc", None), (True, None)])
def test_import_takes_the_checkpoint_id_of_a_group_without_a_manifest(tmp_path, value, want):
    """A store written (or rewritten) by zarr or xarray has no manifest: its root group's ``checkpoint_id`` is the
    id, as docs/cli.md says (it was ignored: 40 imported as 1, 'abc' accepted)."""
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    if value is not None:
        group.attrs["checkpoint_id"] = value
    group.create_array("u", data=np.arange(4.0))
    if want is None:
        with pytest.raises(FormatError, match="group's checkpoint_id .* is not an integer"):
            import_zarr(tmp_path / "s.zarr", **_dirs(tmp_path, "new"))
        assert not (tmp_path / "new" / "m").exists() or not any((tmp_path / "new" / "m").iterdir())
    else:
        assert import_zarr(tmp_path / "s.zarr", **_dirs(tmp_path, "new")).id == want


def test_import_foreign_zarr_edited_with_xarray(tmp_path):
    x = np.linspace(0, 1, 50)
    ds = xr.Dataset({"u": (("y", "x"), np.outer(x, x)), "v": (("x",), x ** 2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(tmp_path / "edited.zarr", zarr_format=3, consolidated=False)
    arrays = read_zarr(tmp_path / "edited.zarr")
    assert {name for name, _a in arrays.values()} == {"u", "v"}
    import_zarr(tmp_path / "edited.zarr", ckpt_id=1, **_dirs(tmp_path, "run"))
    ctx = ftidask.init(**_dirs(tmp_path, "run"))
    ids = {name: vid for vid, (name, _a) in arrays.items()}
    u = ctx.realloc(ids["u"])
    ctx.recover()
    assert u.tobytes() == ds["u"].values.tobytes()


class _ThreadTransport(Transport):
    """Ranks as threads of one process: the collectives are a shared board and a barrier."""

    name = "threads"

    def __init__(self, rank, size, board, barrier):
        self.rank, self.size, self.node, self.nnodes = rank, size, rank, size
        self._board, self._barrier = board, barrier

    def barrier(self):
        self._barrier.wait()

    def allgather(self, value):
        self._barrier.wait()
        self._board[self.rank] = value
        self._barrier.wait()
        out = list(self._board)
        self._barrier.wait()
        return out


def test_export_several_ranks_as_groups(tmp_path):
    size = 3
    board, barrier = [None] * size, threading.Barrier(size)
    arrays = [np.full((4, 5), r, dtype=np.float32) for r in range(size)]
    errors = []

    def rank(r):
        try:
            cfg = ftidask.load_config(**_dirs(tmp_path, exec_id="threads"))
            ctx = ftidask.Context(cfg, _ThreadTransport(r, size, board, barrier))
            ctx.protect(1, arrays[r], name="block")
            ctx.protect(2, np.arange(r + 1), name="ragged")
            ctx.checkpoint(1, 1)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    result = export_checkpoint(None, tmp_path / "ranks.zarr", **_dirs(tmp_path, exec_id="threads"))
    assert result.nranks == size
    group = zarr.open_group(str(tmp_path / "ranks.zarr"), mode="r")
    for r in range(size):
        assert np.array_equal(group[f"rank{r}/block"][...], arrays[r])
        assert np.array_equal(group[f"rank{r}/ragged"][...], np.arange(r + 1))
    assert read_zarr(tmp_path / "ranks.zarr", group="rank2")[1][1].tobytes() == arrays[2].tobytes()


def test_export_assembles_global_blocks(tmp_path):
    """Rank files that record their block of a global array (as the Dask backend does) are stitched."""
    full = np.arange(6 * 8, dtype=np.float64).reshape(6, 8)
    ckdir = tmp_path / "ckpt1.s1"
    blocks = [(0, 0), (0, 4), (3, 0), (3, 4)]
    for r, (i, j) in enumerate(blocks):
        part = np.ascontiguousarray(full[i:i + 3, j:j + 4])
        info = VarInfo.of(1, "field", part, global_shape=[6, 8], offset=[i, j], chunks=[[3, 3], [4, 4]])
        layout = plan_layout(None, [(1, part.nbytes)])
        write_rank_file(ckdir / f"Ckpt1-Rank{r}.fti", layout, {1: ArrayBytes(part)}, [info], hash_id=2,
                        meta={"format": "ftidask", "ckpt_id": 1, "level": 1, "rank": r, "nranks": 4,
                              "backend": "dask", "time": 0.0})
    result = export_checkpoint(ckdir, tmp_path / "global.zarr")
    assert result.arrays == ("field",)
    z = zarr.open_array(str(tmp_path / "global.zarr"), path="field", mode="r")
    assert z.chunks == (3, 4)
    assert z[...].tobytes() == full.tobytes()
    assert np.array_equal(da.from_zarr(str(tmp_path / "global.zarr"), component="field").compute(), full)


def test_export_missing_run(tmp_path):
    with pytest.raises(NoCheckpointError):
        export_checkpoint(None, tmp_path / "x.zarr", **_dirs(tmp_path))


def test_l4_zarr_several_ranks_and_leftover_temporary_store(tmp_path):
    size = 2
    board, barrier = [None] * size, threading.Barrier(size)
    fields = [np.random.default_rng(r).random((20, 30)) for r in range(size)]
    errors = []

    def run(r, restart):
        try:
            cfg = ftidask.load_config(**_dirs(tmp_path, exec_id="zr", l4_format="zarr", compressor="zstd"))
            ctx = ftidask.Context(cfg, _ThreadTransport(r, size, board, barrier))
            if not restart:
                ctx.protect(1, fields[r], name="field")
                ctx.checkpoint(1, 4)
            else:
                out = np.zeros((20, 30))
                ctx.protect(1, out)
                ctx.recover()
                assert out.tobytes() == fields[r].tobytes()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    for restart in (False, True):
        threads = [threading.Thread(target=run, args=(r, restart)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        if not restart:
            stores = sorted(tmp_path.glob("g/zr/l4/ckpt1.s*/Ckpt1-Rank*.zarr"))
            assert len(stores) == 2
            assert zarr.open_array(str(stores[1]), path="field", mode="r")[...].tobytes() == fields[1].tobytes()
            (stores[0].parent / ".Ckpt1-Rank0.zarr.tmp-999").mkdir()  # as a killed writer leaves it
    assert not list(tmp_path.glob("g/zr/l4/*/.*.tmp-*"))


def test_keep_last_ckpt_flushes_to_zarr(tmp_path):
    state = _state()
    with ftidask.init(**_dirs(tmp_path, l4_format="zarr", keep_last_ckpt=1)) as ctx:
        _protect(ctx, state)
        ctx.checkpoint(7, 1)
    (store,) = tmp_path.glob("g/*/l4/ckpt7.s*/Ckpt7-Rank0.zarr")
    _check_store(store, state)
    ctx2 = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    assert ctx2.status() == 2
    outs = {vid: np.zeros_like(arr) for vid, (_n, arr) in state.items()}
    for vid, o in outs.items():
        ctx2.protect(vid, o)
    ctx2.recover(level=4)
    assert ctx2.recovered_from == (7, 4)
    for vid, (_n, arr) in state.items():
        assert outs[vid].tobytes() == arr.tobytes()


def test_export_stitches_dask_worker_files(tmp_path):
    """Worker files as the Dask backend writes them: each worker's chunks concatenated, recorded in extra["dask"]."""
    full = np.arange(7 * 10, dtype=np.int32).reshape(7, 10)
    chunks = [[4, 3], [5, 5]]
    owner = {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 0}
    ckdir = tmp_path / "ckpt2.s5"
    for rank in (0, 1):
        held = [idx for idx in sorted(owner) if owner[idx] == rank]
        pieces, blocks, dptr = [], [], 0
        for i, j in held:
            r0, c0 = sum(chunks[0][:i]), sum(chunks[1][:j])
            chunk = np.ascontiguousarray(full[r0:r0 + chunks[0][i], c0:c0 + chunks[1][j]])
            blocks.append([[i, j], list(chunk.shape), dptr])
            pieces.append(chunk.reshape(-1))
            dptr += chunk.nbytes
        flat = np.concatenate(pieces)
        info = VarInfo(1, "density", flat.dtype, flat.shape, "C", flat.nbytes,
                       {"dask": {"shape": [7, 10], "chunks": chunks, "kind": "dask", "blocks": blocks}})
        write_rank_file(ckdir / f"Ckpt2-Rank{rank}.fti", plan_layout(None, [(1, flat.nbytes)]),
                        {1: ArrayBytes(flat)}, [info], hash_id=2,
                        meta={"format": "ftidask", "ckpt_id": 2, "level": 1, "rank": rank, "nranks": 2,
                              "backend": "dask", "time": 0.0})
    result = export_checkpoint(ckdir, tmp_path / "dask.zarr")
    assert result.arrays == ("density",) and result.nranks == 2
    z = zarr.open_array(str(tmp_path / "dask.zarr"), path="density", mode="r")
    assert z.chunks == (4, 5)
    assert z[...].tobytes() == full.tobytes()
    assert xr.open_zarr(tmp_path / "dask.zarr")["density"].values.tobytes() == full.tobytes()


def test_cli_import(tmp_path, capsys):
    from ftidask.tools.cli import main as cli_main

    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path))
    _protect(ctx, state)
    ctx.checkpoint(2, 1)
    assert cli_main(["export", str(next(tmp_path.glob("l/node0/*/l1/ckpt2.s*"))), "--to-zarr",
                     str(tmp_path / "s.zarr")]) == 0
    cfg = tmp_path / "new.cfg"
    cfg.write_text(f"[basic]\nckpt_dir = {tmp_path}/nl\nglbl_dir = {tmp_path}/ng\nmeta_dir = {tmp_path}/nm\n")
    assert cli_main(["import", str(tmp_path / "s.zarr"), str(cfg)]) == 0
    assert "as checkpoint 2 (level 4)" in capsys.readouterr().out
    ctx2 = ftidask.init(cfg)
    out = np.zeros_like(state[1][1])
    ctx2.protect(1, out)
    ctx2.recover(ckpt_id=2)
    assert out.tobytes() == state[1][1].tobytes()
    assert cli_main(["import", str(tmp_path / "missing.zarr"), str(cfg)]) == 2


def test_cli_verify_checks_zarr_stores(tmp_path, capsys):
    from ftidask.tools.cli import main as cli_main

    state = _state()
    ctx = ftidask.init(**_dirs(tmp_path, l4_format="zarr"))
    _protect(ctx, state)
    ctx.checkpoint(1, 4)
    (store,) = tmp_path.glob("g/*/l4/*/Ckpt1-Rank0.zarr")
    assert cli_main(["verify", str(tmp_path / "g")]) == 0
    assert "1 sound, 0 damaged" in capsys.readouterr().out
    chunk = next(p for p in find_paths(store / "counts", "*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert cli_main(["verify", str(store)]) == 1
    assert "does not match its hash" in capsys.readouterr().out


def test_export_goes_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    """Checkpoint 1 at L4, checkpoint 2 at L1 damaged: the export is checkpoint 1's (as a recovery loads it),
    with a warning naming checkpoint 2; asked for checkpoint 2 by id, it is refused. Before, the newest
    committed checkpoint was the only one tried: an export failed while a sound checkpoint was there."""
    ctx = ftidask.init(**_dirs(tmp_path))
    a = np.arange(1000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 1)
    (path,) = tmp_path.glob("l/node0/*/l1/*/Ckpt2-Rank0.fti")
    raw = bytearray(path.read_bytes())
    raw[-200] ^= 1
    path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="ftidask"):
        result = export_checkpoint(None, tmp_path / "x.zarr", **_dirs(tmp_path))
    assert (result.ckpt_id, result.level) == (1, 4)
    assert zarr.open_group(str(tmp_path / "x.zarr"), mode="r")["var1"][...].tobytes() == (a - 1).tobytes()
    assert any("checkpoint 2 (level 1)" in r.getMessage() for r in caplog.records)
    with pytest.raises(FormatError, match="cannot export"):
        export_checkpoint(None, tmp_path / "y.zarr", ckpt_id=2, **_dirs(tmp_path))
    assert not (tmp_path / "y.zarr").exists()
    ctx._close()


def test_export_falls_back_to_the_previous_differential_checkpoint(tmp_path):
    """L1_DCP checkpoints 1 and 2; checkpoint 2's file is cut: the export is checkpoint 1, kept as the spare,
    exactly; with both cut, a FormatError names both."""
    ctx = ftidask.init(**_dirs(tmp_path, enable_dcp=1, dcp_block_size=4096))
    a = np.arange(100_000.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 5)
    first = a.copy()
    a[::1000] = -1
    ctx.checkpoint(2, 5)
    ctx._close()
    (newest,) = tmp_path.glob("l/node0/*/l1/*/Ckpt2-Rank0.fti")
    newest.write_bytes(newest.read_bytes()[:-100])
    result = export_checkpoint(None, tmp_path / "x.zarr", **_dirs(tmp_path))
    assert result.ckpt_id == 1
    assert zarr.open_group(str(tmp_path / "x.zarr"), mode="r")["var1"][...].tobytes() == first.tobytes()
    (spare,) = tmp_path.glob("l/node0/*/l1/dcp/Spare-Rank0.fti")
    spare.write_bytes(spare.read_bytes()[:-100])
    with pytest.raises(FormatError, match="no checkpoint verifies") as err:
        export_checkpoint(None, tmp_path / "y.zarr", **_dirs(tmp_path))
    assert "checkpoint 2 (level 5)" in str(err.value) or "checkpoint 2 (level 1)" in str(err.value)
