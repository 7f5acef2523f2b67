"""Paths the OS cannot be given (a NUL, a lone surrogate, a name over 255 bytes, a path through a file, a symbolic
link loop) where a user's path enters the API: each is an ftidask error naming the argument, the protected arrays
untouched, never a raw ValueError, UnicodeEncodeError, RuntimeError or OSError from deep inside pathlib or open().
Found by a review (raw exceptions out of recover_file, send_file, export_checkpoint, read_zarr, import_zarr, and
the command line's export --to-zarr through a link loop)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

import ftidask
from ftidask.model.errors import FormatError, FTIError, RecoveryError, StagingError
from ftidask.tools.cli import main as cli_main
from ftidask.zarr_export import export_checkpoint, import_zarr, read_zarr

LONG_NAME = "/tmp/" + "n" * 300
BAD = [("a NUL", "/tmp/a\0b", "NUL character"), ("a lone surrogate", "/tmp/\ud800", "cannot be encoded"),
       ("a long name", LONG_NAME, "a name of 300 bytes")]


def _dirs(base, **kw):
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), **kw}


@pytest.mark.parametrize(("what", "path", "why"), BAD, ids=[b[0] for b in BAD])
def test_recover_file_refuses_a_path_the_os_cannot_take(tmp_path, what, path, why):
    ctx = ftidask.init(**_dirs(tmp_path))
    array = np.full(8, 7.0)
    ctx.protect(0, array)
    ctx.checkpoint(1, 1)
    (ckpt,) = (tmp_path / "L").rglob("Ckpt1-Rank0.fti")
    for kwargs, arg in (({"path": path}, "path"), ({"path": ckpt, "meta": path}, "meta")):
        with pytest.raises(RecoveryError, match=f"recover_file\\({arg}=...\\).*{why}"):
            ctx.recover_file(**kwargs)
    assert (array == 7.0).all()
    ctx.finalize()


def test_send_file_refuses_paths_the_os_refuses(tmp_path):
    ctx = ftidask.init(**_dirs(tmp_path, enable_staging=1))
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    cases = [(LONG_NAME, "a name of 300 bytes"), ("/tmp/\ud800", "cannot be encoded"),
             (f"{plain}/x", "Not a directory"), (tmp_path / "loop", "symbolic links"),
             (f"{tmp_path / 'loop'}/x", "symbolic links")]
    for local, why in cases:
        with pytest.raises(StagingError, match=why):
            ctx.send_file(local, "out.txt")
    staged = ctx.stage_dir() / "staged.txt"
    staged.write_text("x")
    with pytest.raises(StagingError, match="remote_path.*cannot be encoded"):
        ctx.send_file(staged, "out\ud800")
    ctx.finalize()


def _kept_checkpoint(base):
    """The level-4 file of a finished run that kept its last checkpoint."""
    ctx = ftidask.init(**_dirs(base, keep_last_ckpt=1))
    ctx.protect(0, np.arange(6.0))
    ctx.checkpoint(1, 4)
    ctx.finalize()
    (ckpt,) = (base / "G").rglob("Ckpt1-Rank0.fti")
    return ckpt


@pytest.mark.parametrize(("what", "path", "why"), BAD, ids=[b[0] for b in BAD])
def test_zarr_export_and_import_refuse_a_path_the_os_cannot_take(tmp_path, what, path, why):
    ckpt = _kept_checkpoint(tmp_path)
    with pytest.raises(FormatError, match=f"checkpoint=.*{why}"):
        export_checkpoint(path, tmp_path / "out.zarr")
    with pytest.raises(FormatError, match=f"dest=.*{why}"):
        export_checkpoint(ckpt, path)
    with pytest.raises(FormatError, match=f"read_zarr.*{why}"):
        read_zarr(path)
    with pytest.raises(FormatError, match=f"import_zarr.*{why}"):
        import_zarr(path, None, **_dirs(tmp_path / "new"))
    assert not (tmp_path / "out.zarr").exists() and not (tmp_path / "new").exists()


def test_export_to_a_symbolic_link_loop_is_an_error_not_a_traceback(tmp_path):
    ckpt = _kept_checkpoint(tmp_path)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(FTIError, match="cannot be resolved"):
        export_checkpoint(ckpt, tmp_path / "loop1", overwrite=True)
    for dest in ("loop1", "loop1/x"):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli_main(["export", str(ckpt), "--to-zarr", str(tmp_path / dest)])
        assert code in (1, 2) and "ftidask: error:" in err.getvalue() and "Traceback" not in err.getvalue()


def test_read_zarr_of_a_group_the_store_has_not_is_an_error_not_an_empty_dict(tmp_path):
    """A mistyped group (or None, 3) read as an empty group: ``{}``, as if the export held nothing."""
    ckpt = _kept_checkpoint(tmp_path)
    export_checkpoint(ckpt, tmp_path / "s.zarr")
    assert list(read_zarr(tmp_path / "s.zarr")) == [0]
    with pytest.raises(FormatError, match="no variable in group 'rank3'; the store's groups: the root"):
        read_zarr(tmp_path / "s.zarr", group="rank3")
    for group in (None, 3):
        with pytest.raises(FormatError, match="takes the group's name"):
            read_zarr(tmp_path / "s.zarr", group=group)
        with pytest.raises(FormatError, match="takes the group's name"):
            import_zarr(tmp_path / "s.zarr", None, group=group, **_dirs(tmp_path / "new"))
