"""Forged FTI-FF files whose hashes and seals are recomputed (found by a review of session 57): a differential file
whose table gives a variable a codec, and rank files whose global-block records an export trusted. Each is refused
with ftidask's error; no array is touched and no store written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from forgetable import rewrite_table

import ftidask
from ftidask.model.errors import RecoveryError


def test_a_differential_file_with_a_codec_in_its_table_is_refused(dirs, capsys):
    """A dCP file is never compressed: its readers copy each container's stored bytes. With a codec in its table
    (its container replaced by a Zstd frame, the digests resealed) recover_file filled the array's first bytes with
    the frame and left the rest as it was, and ``verify`` said OK."""
    from ftidask.tools.cli import main as cli_main

    ctx = ftidask.init(**dirs, enable_dcp=1, dcp_block_size=512)
    ctx.protect(1, np.arange(20_000.0))
    ctx.checkpoint(1, 5)
    ctx._close()
    (path,) = [p for d in ("ckpt_dir", "glbl_dir") for p in Path(dirs[d]).glob("**/Ckpt1-Rank0.fti")]
    rewrite_table(path, lambda t: t["vars"][0].setdefault("extra", {}).update(codec={"id": "zstd", "level": 3}))
    restart = ftidask.init(**dirs)
    out = np.full(20_000, -1.0)
    restart.protect(1, out)
    with pytest.raises(RecoveryError, match="differential .dCP. file whose table gives a variable a codec"):
        restart.recover_file(path)
    assert (out == -1).all()
    assert cli_main(["verify", str(path)]) == 1
    assert "gives a variable a codec" in capsys.readouterr().out


def _rank_file(root: Path, rank: int) -> Path:
    """Rank ``rank``'s file of two (elements 10 * rank .. 10 * rank + 9 of a global array of 20), as an export
    finds it in a checkpoint directory."""
    ctx = ftidask.init(ckpt_dir=str(root / f"l{rank}"), glbl_dir=str(root / f"g{rank}"), meta_dir=str(root / f"m{rank}"),
                       exec_id="run")  # one run's two ranks
    ctx.protect(1, np.arange(10.0) + 10 * rank, global_shape=[20], offset=[10 * rank])
    ctx.checkpoint(1, 1)
    ctx._close()
    (src,) = root.glob(f"l{rank}/**/Ckpt1-Rank0.fti")
    dest = root / "ckpt" / f"Ckpt1-Rank{rank}.fti"
    dest.parent.mkdir(exist_ok=True)
    src.rename(dest)
    rewrite_table(dest, lambda t: t.update(rank=rank, nranks=2))
    return dest


@pytest.mark.parametrize("extra, said", [
    (None, ""),
    ({"offset": [5]}, "per rank"),  # overlapping blocks (halos: a restart on this layout recovers them) and a hole
    ({"global_shape": [2**62]}, "per rank"),  # blocks that hold 20 of its elements
    ({"offset": ["x"]}, "variable 1, rank 1: .*offset is not a list of ints"),
    ({"offset": [-5]}, "variable 1, rank 1: .*does not fit a block"),
    ({"offset": [15]}, "does not fit a block"),
    ({"global_shape": [None]}, "global_shape is not a list of ints"),
], ids=["genuine", "overlap", "huge", "str-offset", "negative", "past-end", "null-shape"])
def test_an_export_checks_the_global_blocks_it_stitches(tmp_path, extra, said):
    """Rank 1's block record forged: a raw ValueError or TypeError traceback (exit status 1), or a store with rank 0's
    values overwritten, a hole of zeros, rank 1's values dropped, or an array of 2**62 elements, with exit status 0.
    A malformed record, or a block outside its array, is refused as a recovery refuses it: exit status 2, ``ftidask:
    error``, no store. Blocks that do not tile their array (overlapping, partial) are exported per rank, each rank's
    own values, as blocks that record no global array are."""
    pytest.importorskip("zarr")
    import zarr

    _rank_file(tmp_path, 0)
    one = _rank_file(tmp_path, 1)
    if extra is not None:
        rewrite_table(one, lambda t: t["vars"][0]["extra"].update(extra))
    out = tmp_path / "out.zarr"
    proc = subprocess.run([sys.executable, "-m", "ftidask.tools.cli", "export", str(one.parent), "--to-zarr",
                           str(out)], capture_output=True, text=True, timeout=120)
    if extra is None or said == "per rank":
        assert proc.returncode == 0, proc.stderr
        group = zarr.open_group(str(out), mode="r")
        if extra is None:
            (name,) = group.array_keys()
            assert np.array_equal(group[name][...], np.arange(20.0))
        else:
            for rank in (0, 1):
                (name,) = group[f"rank{rank}"].array_keys()
                assert np.array_equal(group[f"rank{rank}"][name][...], np.arange(10.0) + 10 * rank)
        return
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "ftidask: error:" in proc.stderr and re.search(said, proc.stderr), proc.stderr
    assert not out.exists()
