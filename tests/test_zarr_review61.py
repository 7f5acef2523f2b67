"""The Zarr side, found by a review: a variable name with a backslash (Zarr reads it as "/": a committed level-4
checkpoint that no restart could read), an export over the checkpoint it exports (``--overwrite``: the committed
store replaced), a root array named like a rank's group (``rank0``: a raw zarr traceback), and ``list`` calling a
store that is not the one its commit record names sound."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.api.context import Context
from ftidask.engine.grouplevels import run_ranks
from ftidask.model.config import load_config
from ftidask.model.errors import FTIError
from ftidask.tools.cli import main

pytest.importorskip("zarr")
from ftidask.tools.zarr_export import export_checkpoint, read_zarr  # noqa: E402


@pytest.mark.parametrize("name", ["fields\\u", "\\", "a\\b\\c"])
def test_a_name_with_a_backslash_is_stored_under_its_id_and_recovered(dirs, tmp_path, name):
    ctx = ftidask.init(l4_format="zarr", **dirs)
    a = np.arange(10.0)
    ctx.protect(1, a, name=name)
    ctx.checkpoint(1, 4)
    ctx._close()
    again = ftidask.init(l4_format="zarr", **dirs)
    out = np.zeros(10)
    again.protect(1, out, name=name)
    again.recover()
    assert again.recovered_from == (1, 4) and out.tobytes() == a.tobytes()
    export_checkpoint(None, tmp_path / "x.zarr", **dirs)
    assert [(n, v.tobytes()) for n, v in read_zarr(tmp_path / "x.zarr").values()] == [(name, a.tobytes())]
    again.finalize()


def test_an_export_over_the_checkpoint_it_exports_is_refused(dirs):
    ctx = ftidask.init(l4_format="zarr", **dirs)
    a = np.arange(10.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    (store,) = Path(dirs["glbl_dir"]).glob("*/l4/ckpt1.s*/Ckpt1-Rank0.zarr")
    # the store itself, from its directory or itself; and a path in the run's level directory (another checkpoint's)
    for source, dest in ((store.parent, store), (store, store), (store, store.parent.parent / "ckpt9.s9")):
        with pytest.raises(FTIError, match="would write over the checkpoint it exports"):
            export_checkpoint(source, dest, overwrite=True)
    ctx._close()
    again = ftidask.init(l4_format="zarr", **dirs)
    out = np.zeros(10)
    again.protect(1, out)
    again.recover()
    assert again.recovered_from == (1, 4) and out.tobytes() == a.tobytes()
    again.finalize()


@pytest.mark.parametrize("first", ["per-rank", "replicated"])
def test_a_root_array_named_like_a_ranks_group_is_renamed(tmp_path, first):
    cfg = load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"),
                      local_test=1, node_size=1, verbosity=4)

    def program(t) -> None:
        ctx = Context(cfg, t)
        calls = [lambda: ctx.protect(1, np.full(4, float(t.rank)), name="u"),
                 lambda: ctx.protect(2, np.arange(3.0), name="rank0", replicated=True)]
        for call in (calls if first == "per-rank" else calls[::-1]):
            call()
        ctx.checkpoint(1, 4)
        ctx._close()

    assert run_ranks(cfg, 2, program, wait=60)[1] == []
    export_checkpoint(cfg, tmp_path / "x.zarr")
    import zarr

    root = zarr.open_group(str(tmp_path / "x.zarr"), mode="r")
    assert sorted(root.group_keys()) == ["rank0", "rank1"] and sorted(root.array_keys()) == ["var2"]
    assert root["var2"][...].tolist() == [0.0, 1.0, 2.0] and root["rank1/u"][...].tolist() == [1.0] * 4


def test_list_says_a_store_put_in_another_ones_place_is_not_the_one_named(dirs, tmp_path, capsys):
    ctx = ftidask.init(l4_format="zarr", keep_l4_ckpt=1, **dirs)
    a = np.arange(5.0)
    ctx.protect(1, a)
    ctx.checkpoint(1, 4)
    a += 1
    ctx.checkpoint(2, 4)
    (store1,) = Path(dirs["glbl_dir"]).glob("*/l4/ckpt1.s*/Ckpt1-Rank0.zarr")
    (store2,) = Path(dirs["glbl_dir"]).glob("*/l4/ckpt2.s*/Ckpt2-Rank0.zarr")
    shutil.rmtree(store2)
    shutil.copytree(store1, store2)  # sound, but checkpoint 1's
    assert main(["list", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], " ".join(r[8:])) for r in rows] == [("1", "sound"), ("2", "DAMAGED (1 of 1 files)")], rows
    ctx._close()
