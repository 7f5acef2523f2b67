"""A run FTI wrote, read in FTI_RecoverFiles' order (src/recover.c): :func:`ftidask.tools.fti_run.recover_fti_run`.

FTI keeps one rank's checkpoint at ``{ckpt_dir}[/node{rank // node_size}]/{exec_id}/l1|l2|l3/Ckpt{id}-Rank{r}.fti``
(``node{n}`` with ``local_test = 1``, src/conf.c FTI_CreateDirs), its partner copy on the next node of its group as
``Ckpt{id}-Pcof{keeper}.fti`` (postckpt.c FTI_RecvPtner), level 4 at ``{glbl_dir}/{exec_id}/l4`` and, in POSIX mode,
the meta files at ``{meta_dir}/{exec_id}/l{level}``. FTI tries level 1, 2, 3, then 4 (only 4 after a keep_last_ckpt
finalize: ``failure = 2``). The FTI-FF files are the ones FTI's own writer made (tests/data/fti_written/r2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import NoCheckpointError
from ftidask.model.errors import ConfigError
from ftidask.tools.fti_run import fti_run_files, recover_fti_run

DATA = Path(__file__).parent / "data" / "fti_written"
EXEC = "2023-05-04_10-20-30"
PAIR = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [0, 8], "itemsize": 16})
DTYPES = {0: np.dtype("<i4"), 1: np.dtype("<f8"), 2: np.dtype("S1"), 3: np.dtype("<i8"), 4: PAIR}


def _config(root: Path, **keys) -> Path:
    values = {"ckpt_dir": root / "Local", "glbl_dir": root / "Global", "meta_dir": root / "Meta", "node_size": 1,
              "group_size": 2, "local_test": 1, "ckpt_io": 3, "failure": 1, "exec_id": EXEC} | keys
    sections = {"basic": [k for k in values if k not in ("failure", "exec_id", "local_test")],
                "restart": ["failure", "exec_id"], "advanced": ["local_test"]}
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {values[k]}\n" for k in ks) for s, ks in sections.items())
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.fti").write_text(text)
    return root / "config.fti"


def _place(root: Path, level: int, ckpt: int, ranks=(0, 1), partner: bool = False) -> None:
    """FTI's files of checkpoint ``ckpt`` (FTI-FF, written by FTI) where FTI puts them at ``level``."""
    for rank in ranks:
        src = DATA / "r2" / f"Ckpt{ckpt}-Rank{rank}.fti"
        if level == 4:
            dest = root / f"Global/{EXEC}/l4/Ckpt{ckpt}-Rank{rank}.fti"
        else:
            dest = root / f"Local/node{rank}/{EXEC}/l{level}/Ckpt{ckpt}-Rank{rank}.fti"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        if partner:  # rank's copy on the next node (group of 2): named after the keeper's rank
            keeper = (rank + 1) % 2
            copy = root / f"Local/node{keeper}/{EXEC}/l2/Ckpt{ckpt}-Pcof{keeper}.fti"
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, copy)


def _expected(ckpt: int, rank: int) -> dict[int, bytes]:
    folder = DATA / "expected" / "r2" / f"ckpt{ckpt}" / f"rank{rank}"
    return {vid: (folder / f"var{vid}.bin").read_bytes() for vid in DTYPES}


def _recover(dirs, config: Path, ckpt: int, rank: int, only=tuple(DTYPES), **kw):
    """Rank ``rank``'s checkpoint ``ckpt`` of the FTI run: the file read (variables ``only`` protected)."""
    ctx = ftidask.init(**dirs)
    arrays = {vid: np.frombuffer(bytearray(len(raw)), DTYPES[vid]) for vid, raw in _expected(ckpt, rank).items()
              if vid in only}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    try:
        found = recover_fti_run(ctx, config, rank, **kw)
        assert {vid: a.tobytes() for vid, a in arrays.items()} == {v: _expected(ckpt, rank)[v] for v in arrays}
        return found
    finally:
        ctx.finalize()


@pytest.fixture
def fti(tmp_path):
    """The FTI run's directories, apart from those of the ftidask run that reads it (``dirs``)."""
    return tmp_path / "fti"


@pytest.mark.parametrize("rank", [0, 1])
def test_level_1_files_are_found_where_fti_keeps_them(fti, dirs, rank):
    _place(fti, 1, 1)
    found = _recover(dirs, _config(fti), 1, rank)
    assert (found.level, found.ckpt_id, found.path.name) == (1, 1, f"Ckpt1-Rank{rank}.fti")


def test_a_lost_level_1_file_falls_back_to_level_4_as_fti_does(fti, dirs):
    _place(fti, 1, 2)
    _place(fti, 4, 3)
    (fti / f"Local/node0/{EXEC}/l1/Ckpt2-Rank0.fti").unlink()
    assert _recover(dirs, _config(fti), 3, 0).level == 4
    assert _recover(dirs, _config(fti), 2, 1).level == 1  # rank 1's own file is there


def test_every_rank_gets_the_checkpoint_every_rank_can_recover_as_fti_does(fti, dirs):
    """FTI takes a level only when every rank's recovery from it succeeds (an allreduce per level): rank 1 read its
    own level-1 checkpoint 2 while rank 0 read checkpoint 3 from level 4, a mix of two checkpoints without a word.
    One process reading the ranks one by one says how many there are (``nranks``)."""
    _place(fti, 1, 2)
    _place(fti, 4, 3)
    (fti / f"Local/node0/{EXEC}/l1/Ckpt2-Rank0.fti").unlink()
    same = (0, 3, 4)  # variables of the same sizes in checkpoints 2 and 3: either one fits
    assert [(f.level, f.ckpt_id) for f in (_recover(dirs, _config(fti), 3, r, same, nranks=2) for r in (0, 1))] == [
        (4, 3), (4, 3)]
    assert _recover(dirs, _config(fti), 2, 1, same).level == 1  # without nranks: rank 1's own newest file


def test_a_damaged_newer_file_of_one_rank_sends_every_rank_to_the_older_checkpoint(fti, dirs):
    _place(fti, 1, 1)
    _place(fti, 1, 2)
    damaged = fti / f"Local/node1/{EXEC}/l1/Ckpt2-Rank1.fti"
    raw = bytearray(damaged.read_bytes())
    raw[40] ^= 0x10  # a data byte of its first variable
    damaged.write_bytes(raw)
    same = (0, 3, 4)  # variables of the same sizes in checkpoints 1 and 2: either one fits
    assert [(f.level, f.ckpt_id) for f in (_recover(dirs, _config(fti), 1, r, same, nranks=2) for r in (0, 1))] == [
        (1, 1), (1, 1)]
    assert _recover(dirs, _config(fti), 2, 0).ckpt_id == 2  # rank 0 alone: its own newest file


def test_the_ranks_of_an_mpi_context_agree_on_the_checkpoint(fti, tmp_path):
    """With ``ctx`` on several ranks (here threads over the real engine), the ranks agree as FTI's do."""
    from ftidask.api.context import Context
    from ftidask.engine.grouplevels import run_ranks
    from ftidask.model.config import load_config

    _place(fti, 1, 2)
    _place(fti, 4, 3)
    (fti / f"Local/node0/{EXEC}/l1/Ckpt2-Rank0.fti").unlink()
    config = _config(fti)
    cfg = load_config(None, ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"),
                      meta_dir=str(tmp_path / "M"), local_test=1, node_size=1, verbosity=4)

    def program(t):
        ctx = Context(cfg, t)
        # (variables 0, 3 and 4 have the same sizes in checkpoints 2 and 3: either one fits)
        arrays = {vid: np.frombuffer(bytearray(len(raw)), DTYPES[vid]) for vid, raw in _expected(3, t.rank).items()
                  if vid in (0, 3, 4)}
        for vid, array in arrays.items():
            ctx.protect(vid, array)
        found = recover_fti_run(ctx, config, t.rank)
        same = all(a.tobytes() == _expected(3, t.rank)[vid] for vid, a in arrays.items())
        ctx._close()
        return found.level, found.ckpt_id, same

    results, errors = run_ranks(cfg, 2, program, wait=60)
    assert errors == [] and results == [(4, 3, True)] * 2, (results, errors)


def test_level_2_reads_the_partner_copy_of_a_lost_node(fti, dirs):
    _place(fti, 2, 2, partner=True)
    shutil.rmtree(fti / "Local/node1")  # node 1 lost: its own file and the copy of rank 0's
    found = _recover(dirs, _config(fti), 2, 1)
    assert (found.level, found.path.name, found.path.parent.parent.parent.name) == (2, "Ckpt2-Pcof0.fti", "node0")
    assert _recover(dirs, _config(fti), 2, 0).path.name == "Ckpt2-Rank0.fti"


def test_failure_2_recovers_from_level_4_only(fti, dirs):
    """keep_last_ckpt's finalize sets failure = 2: FTI_RecoverFiles tries level 4 alone."""
    _place(fti, 1, 2)
    _place(fti, 4, 3)
    config = _config(fti, failure=2)
    assert [f.level for f in fti_run_files(config, 0)] == [4]
    assert _recover(dirs, config, 3, 0).level == 4


def test_a_damaged_file_is_passed_over(fti, dirs):
    _place(fti, 1, 2)
    _place(fti, 4, 3)
    path = fti / f"Local/node1/{EXEC}/l1/Ckpt2-Rank1.fti"
    raw = bytearray(path.read_bytes())
    raw[3] ^= 1
    path.write_bytes(bytes(raw))
    assert _recover(dirs, _config(fti), 3, 1).level == 4


def test_nothing_to_recover_is_no_checkpoint_and_arrays_untouched(fti, dirs):
    _place(fti, 1, 1, ranks=(1,))
    ctx = ftidask.init(**dirs)
    array = np.full(16, 7, "<i4")
    ctx.protect(0, array)
    with pytest.raises(NoCheckpointError, match="no checkpoint file of rank 0"):
        recover_fti_run(ctx, _config(fti), 0)
    assert (array == 7).all()
    ctx.finalize()


def test_a_config_without_exec_id_is_refused(fti):
    with pytest.raises(ConfigError, match="exec_id"):
        fti_run_files(_config(fti, exec_id=""), 0)


def test_posix_run_reads_the_partner_copy_with_its_meta_file(fti, dirs):
    """ckpt_io = 1: files with FTI's meta files, level 2's partner copy read with its left partner's section."""
    import hashlib

    raws = {r: (np.arange(6, dtype="<f8") + 10 * r).tobytes() for r in range(2)}
    meta = fti / f"Meta/{EXEC}/l2/sector0-group0.fti"
    meta.parent.mkdir(parents=True)
    meta.write_text("".join(f"[{r}]\nckpt_file_name = Ckpt4-Rank{r}.fti\nckpt_file_size = 48\n"
                            f"ckpt_file_maxs = 48\nckpt_checksum = {hashlib.md5(raws[r]).hexdigest()}\n"
                            "var0_id = 9\nvar0_size = 48\n" for r in range(2)))
    for r in range(2):
        node = fti / f"Local/node{r}/{EXEC}/l2"
        node.mkdir(parents=True)
        (node / f"Ckpt4-Pcof{r}.fti").write_bytes(raws[(r - 1) % 2])
    (fti / f"Local/node0/{EXEC}/l2/Ckpt4-Rank0.fti").write_bytes(raws[0])  # node 1 lost its own file
    ctx = ftidask.init(**dirs)
    array = np.zeros(6)
    ctx.protect(9, array)
    found = recover_fti_run(ctx, _config(fti, ckpt_io=1), 1)
    assert (found.level, found.path.name, found.meta) == (2, "Ckpt4-Pcof0.fti", meta.parent)
    assert array.tobytes() == raws[1]
    ctx.finalize()


@pytest.mark.parametrize("key", ["ckpt_dir", "glbl_dir", "meta_dir"])
def test_a_directory_no_os_can_name_is_a_config_error(fti, key):
    """A name of 3000 bytes in a directory key (a damaged config) is refused when the config loads: every stat,
    open and listing of it would raise ENAMETOOLONG (a raw OSError out of the level-4 lookup, found by the fuzz)."""
    with pytest.raises(ConfigError, match=f"{key}.*a file system takes names of at most 255"):
        fti_run_files(_config(fti, **{key: "x" * 3000}), 0)
    with pytest.raises(ConfigError, match=key):
        ftidask.init(**{key: str(fti / ("y" * 256))})
    with pytest.raises(ConfigError, match=key):
        ftidask.init(**{key: "/" + "/".join(["z" * 200] * 20)})  # names that fit, a path that does not
    ftidask.init(**{key: str(fti / ("y" * 255))}).finalize()


def test_a_level_directory_the_os_refuses_to_list_is_a_recovery_error(fti, dirs, monkeypatch):
    """An unlistable level directory (permissions; root reads every mode, so the OS's refusal is injected at the
    listing) is an ftidask error naming it, the arrays untouched, never a raw OSError."""
    _place(fti, 1, 1)
    l1 = fti / f"Local/node0/{EXEC}/l1"
    real = Path.iterdir

    def refused(self):
        if self == l1:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refused)
    ctx = ftidask.init(**dirs)
    array = np.full(16, 7, "<i4")
    ctx.protect(0, array)
    with pytest.raises(ftidask.RecoveryError, match="cannot list the FTI run's directory .*l1.*Permission denied"):
        recover_fti_run(ctx, _config(fti), 0)
    assert (array == 7).all()
    ctx.finalize()


def test_a_meta_path_no_os_can_name_is_a_recovery_error(fti, dirs):
    """``recover_file(meta=...)`` with a name of 3000 bytes: a RecoveryError naming the meta path, not a raw OSError
    out of its lookup."""
    _place(fti, 1, 1)
    ctx = ftidask.init(**dirs)
    array = np.full(16, 7, "<i4")
    ctx.protect(0, array)
    with pytest.raises(ftidask.RecoveryError, match=r"recover_file\(meta=...\).*a name of 3000 bytes"):
        ctx.recover_file(fti / f"Local/node0/{EXEC}/l1/Ckpt1-Rank0.fti", meta=fti / ("m" * 3000))
    assert (array == 7).all()
    ctx.finalize()


@pytest.mark.parametrize("how", ["recover_fti_run", "recover_file"])
def test_a_checkpoint_after_reading_an_fti_file_is_recovered(fti, dirs, how):
    """FTI 1.2+ files (metadata at the end, as FTI's writer made tests/data/fti_written/r2) count each container's
    fptr from the start of the data. The next checkpoint planned on the file's layout copied those fptr: its data
    went over its own file block, checkpoint() said it succeeded, and every restart refused it (the run's newest
    state lost). Now the layout is placed anew."""
    _place(fti, 1, 2)
    for level in (1, 4):
        ctx = ftidask.init(**dirs)
        arrays = {vid: np.frombuffer(bytearray(len(raw)), DTYPES[vid]) for vid, raw in _expected(2, 0).items()}
        for vid, array in arrays.items():
            ctx.protect(vid, array)
        if how == "recover_fti_run":
            recover_fti_run(ctx, _config(fti), 0)
        else:
            ctx.recover_file(fti / f"Local/node0/{EXEC}/l1/Ckpt2-Rank0.fti")
        assert {vid: a.tobytes() for vid, a in arrays.items()} == _expected(2, 0)
        arrays[0] += 1000
        wrote = {vid: a.tobytes() for vid, a in arrays.items()}
        ctx.checkpoint(10 + level, level)
        ctx._close()  # the job ends without finalize: the checkpoint stays for the restart
        again = ftidask.init(**dirs)
        back = {vid: np.zeros_like(a) for vid, a in arrays.items()}
        for vid, array in back.items():
            again.protect(vid, array)
        again.recover()
        assert again.recovered_from == (10 + level, level)
        assert {vid: a.tobytes() for vid, a in back.items()} == wrote
        again.finalize()
        for key in ("ckpt_dir", "glbl_dir", "meta_dir"):  # the next level starts afresh
            shutil.rmtree(dirs[key], ignore_errors=True)
