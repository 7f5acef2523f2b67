"""FTI's own level-3 parity decoded (:mod:`ftidask.ftiff.fti_rs`, :mod:`ftidask.tools.fti_l3`), against bytes of an oracle.

tests/data/fti_l3 holds a group of 4 POSIX rank files and one of 4 FTI-FF rank files, and the parity that an oracle
built on Jerasure 2.0 (FTI's deps/jerasure) computed for them following FTI_RSenc (README.md there says how). Here:
the encoder gives those parity bytes, every pattern of 1 to 4 lost files among the 8 comes back bit for bit, a fifth
loss or a damaged parity is a clear error, and recover_fti_run rebuilds a deleted level-3 rank file of a POSIX and of
an FTI-FF run and fills the arrays from it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import itertools
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from ftiff_builders import fti11_file, fti_rsed_file

import ftidask
from ftidask.errors import NoCheckpointError, RecoveryError
from ftidask.ftiff import fti_rs
from ftidask.model.config import load_config
from ftidask.model.errors import FormatError
from ftidask.tools.fti_l3 import rebuild_rank_file
from ftidask.tools.fti_run import recover_fti_run

DATA = Path(__file__).parent / "data" / "fti_l3"
EXEC = "2024-01-02_03-04-05"
K = 4
_spec = importlib.util.spec_from_file_location("fti_l3_inputs", DATA / "make_inputs.py")
inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inputs)


def _rank(kind: str, g: int) -> bytes:
    return (DATA / kind / f"Ckpt1-Rank{g}.fti").read_bytes()


def _parity(kind: str, g: int) -> bytes:
    return (DATA / kind / f"parity{g}.bin").read_bytes()


def _max_fs(kind: str) -> int:
    return len(_parity(kind, 0))


def _padded(kind: str, g: int) -> bytes:
    """Rank g's file as FTI_RSenc encodes it: zeros to maxFs, an FTI-FF file's size in its last 8 bytes."""
    raw, max_fs = _rank(kind, g), _max_fs(kind)
    if kind == "ftiff":
        return raw + bytes(max_fs - 8 - len(raw)) + struct.pack("<q", len(raw))
    return raw.ljust(max_fs, b"\0")


def _reader(raw: bytes):
    return lambda offset, nbytes: raw[offset:offset + nbytes].ljust(nbytes, b"\0")


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_the_encoder_gives_the_oracles_parity(kind):
    """Same field, same matrix, same word order and padding as FTI_RSenc on Jerasure: the very bytes."""
    assert fti_rs.encode(K, [_padded(kind, g) for g in range(K)], _max_fs(kind)) == [_parity(kind, g) for g in range(K)]


def test_the_field_is_jerasures():
    log, antilog = fti_rs.tables()
    assert antilog[16] == 0x100B and len(set(antilog[:fti_rs.ORDER].tolist())) == fti_rs.ORDER
    assert fti_rs.gf_mul(0x8000, 2) == 0x100B and fti_rs.gf_div(1, 1) == 1
    assert fti_rs.coding_matrix(4)[0][0] == fti_rs.gf_div(1, 4)  # 1 / (0 ^ (k + 0))
    assert all(fti_rs.gf_mul(x, fti_rs.gf_div(1, x)) == 1 for x in (1, 2, 3, 0x1234, 0xFFFF))


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_every_loss_pattern_of_up_to_k_files_comes_back_bit_for_bit(kind):
    """All 162 patterns of 1..4 lost files among the 8 (rank files, parity files, mixes). POSIX's maxFs is odd (3001):
    byte maxFs - 1 of a rebuild that read parity is unknown and said so (exact_end False): the rank file whose size is
    maxFs gets it back from its MD5 (test below), the others are cut before it."""
    files = [_padded(kind, g) for g in range(K)] + [_parity(kind, g) for g in range(K)]
    max_fs = _max_fs(kind)
    for lost in (c for n in range(1, K + 1) for c in itertools.combinations(range(2 * K), n)):
        sinks = {i: io.BytesIO() for i in lost}
        exact = fti_rs.rebuild(K, max_fs, {i: _reader(f) for i, f in enumerate(files) if i not in lost}, sinks,
                               piece=1024)
        survivors = sorted(set(range(2 * K)) - set(lost))[:K]  # FTI's dm_ids
        assert exact == (max_fs % 2 == 0 or all(s < K for s in survivors)), lost
        for i in lost:
            got, want = sinks[i].getvalue(), files[i]
            assert got[:max_fs - 1] == want[:max_fs - 1], (lost, i)
            assert got == want or not exact, (lost, i)


def test_five_losses_are_too_many():
    files = [_padded("posix", g) for g in range(K)] + [_parity("posix", g) for g in range(K)]
    with pytest.raises(FormatError, match="5 of the group's 8 files .* at most 4"):
        fti_rs.rebuild(K, 3001, {i: _reader(files[i]) for i in (1, 4, 7)}, {0: io.BytesIO()})


@pytest.mark.parametrize("seed", range(6))
def test_the_decoder_inverts_the_encoder_on_random_groups(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 7))
    sizes = rng.integers(0, 5000, k)
    max_fs = int(sizes.max()) + int(rng.integers(0, 3))
    files = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes().ljust(max_fs, b"\0") for n in sizes]
    every = files + fti_rs.encode(k, files, max_fs)
    for _ in range(20):
        lost = rng.choice(2 * k, int(rng.integers(1, k + 1)), replace=False).tolist()
        sinks = {i: io.BytesIO() for i in lost}
        exact = fti_rs.rebuild(k, max_fs, {i: _reader(f) for i, f in enumerate(every) if i not in lost}, sinks,
                               piece=int(rng.integers(1, 600)) * 2)
        for i in lost:
            assert sinks[i].getvalue()[:max_fs - 1] == every[i][:max_fs - 1]
            assert sinks[i].getvalue() == every[i] or not exact


# --- the files of an FTI run --------------------------------------------------------------------------------------


def _config(root: Path, kind: str) -> Path:
    text = (f"[basic]\nckpt_dir = {root / 'Local'}\nglbl_dir = {root / 'Global'}\nmeta_dir = {root / 'Meta'}\n"
            f"node_size = 1\ngroup_size = {K}\nckpt_io = {1 if kind == 'posix' else 3}\n"
            f"[restart]\nfailure = 1\nexec_id = {EXEC}\n[advanced]\nlocal_test = 1\nblock_size = 1\n")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.fti").write_text(text)
    return root / "config.fti"


def _l3(root: Path, g: int) -> Path:
    return root / f"Local/node{g}/{EXEC}/l3"


def _write_run(root: Path, kind: str) -> Path:
    """FTI's level-3 files of checkpoint 1 of a group of 4 nodes of one process each: rank files, parity (POSIX: the
    bytes alone, their MD5 in the meta file; FTI-FF: with the record FTI_RSenc appends), and the meta file."""
    sections = []
    for g in range(K):
        folder = _l3(root, g)
        folder.mkdir(parents=True)
        raw, parity = _rank(kind, g), _parity(kind, g)
        (folder / f"Ckpt1-Rank{g}.fti").write_bytes(raw)
        (folder / f"Ckpt1-RSed{g}.fti").write_bytes(parity if kind == "posix" else fti_rsed_file(parity, len(raw)))
        entries = {"ckpt_file_name": f"Ckpt1-Rank{g}.fti", "ckpt_file_size": len(raw), "ckpt_file_maxs": len(parity),
                   "ckpt_checksum": hashlib.md5(raw).hexdigest(), "rsed_checksum": hashlib.md5(parity).hexdigest(),
                   "var0_id": 0, "var0_size": 800, "var1_id": 1, "var1_size": len(raw) - 800}
        sections.append(f"[{g}]\n" + "".join(f"{key:<30} = {value}\n" for key, value in entries.items()))
    if kind == "posix":
        meta = root / f"Meta/{EXEC}/l3/sector0-group0.fti"
        meta.parent.mkdir(parents=True)
        meta.write_text("\n".join(sections))
    return _config(root, kind)


def _expected(kind: str, g: int) -> dict[int, bytes]:
    if kind == "ftiff":
        return inputs.ftiff_vars(g)
    raw = _rank(kind, g)
    return {0: raw[:800], 1: raw[800:]}


def _recover(dirs, config: Path, kind: str, g: int):
    ctx = ftidask.init(**dirs)
    arrays = {vid: np.zeros(len(raw), "u1") for vid, raw in _expected(kind, g).items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    try:
        found = recover_fti_run(ctx, config, g)
        assert {vid: a.tobytes() for vid, a in arrays.items()} == _expected(kind, g)
        return found
    finally:
        ctx.finalize()


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
@pytest.mark.parametrize("g", [1, 2])
def test_recover_fti_run_rebuilds_a_deleted_level_3_file(tmp_path, dirs, kind, g):
    """The rank's L3 file deleted (POSIX rank 2: the largest, of odd size maxFs, its last byte found by its MD5)."""
    config = _write_run(tmp_path / "fti", kind)
    (_l3(tmp_path / "fti", g) / f"Ckpt1-Rank{g}.fti").unlink()
    found = _recover(dirs, config, kind, g)
    assert (found.level, found.ckpt_id, found.rebuilt) == (3, 1, True)
    assert found.path.read_bytes() == _rank(kind, g)  # put back in place, as FTI does
    assert not [p for p in found.path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_an_mpiio_runs_level_3_is_posix_and_rebuilt_as_such(tmp_path, dirs):
    """ckpt_io = 2 writes levels 1-3 with FTI's POSIX writer (only level 4 is the shared MPI-IO file): a lost L3
    rank file is rebuilt from POSIX parity and the meta file, as with ckpt_io = 1."""
    config = _write_run(tmp_path / "fti", "posix")
    config.write_text(config.read_text().replace("ckpt_io = 1\n", "ckpt_io = 2\n"))
    (_l3(tmp_path / "fti", 1) / "Ckpt1-Rank1.fti").unlink()
    found = _recover(dirs, config, "posix", 1)
    assert (found.level, found.rebuilt, found.meta) == (3, True, tmp_path / f"fti/Meta/{EXEC}/l3")


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_a_lost_node_directory_is_made_again_and_its_file_rebuilt(tmp_path, dirs, kind):
    """Node 2 lost whole: its l3 directory (rank file and parity) is gone; FTI makes it again and decodes into it."""
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    shutil.rmtree(root / "Local/node2")
    found = _recover(dirs, config, kind, 2)
    assert found.rebuilt and found.path == _l3(root, 2) / "Ckpt1-Rank2.fti"
    assert sorted(p.name for p in _l3(root, 2).iterdir()) == ["Ckpt1-Rank2.fti"]  # its parity is not rebuilt


def _rebuild_patterns(tmp_path: Path, kind: str, patterns) -> None:
    """Rank 2's file lost with each of ``patterns`` (ids of the other files: rank files 0-3, parity 4-7) lost too:
    rebuilt on disk exactly, each time."""
    cfg = load_config(_write_run(tmp_path / "fti", kind))
    root = tmp_path / "fti"
    names = [(g, f"Ckpt1-Rank{g}.fti") for g in range(K)] + [(g, f"Ckpt1-RSed{g}.fti") for g in range(K)]
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for extra in patterns:
        for i in (2, *extra):
            g, name = names[i]
            shutil.move(_l3(root, g) / name, hidden / name)
        assert rebuild_rank_file(cfg, 2, 1).read_bytes() == _rank(kind, 2), extra
        for i in extra:
            g, name = names[i]
            shutil.move(hidden / name, _l3(root, g) / name)


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_the_rank_file_is_rebuilt_on_disk_with_other_losses(tmp_path, kind):
    """A few patterns (the exhaustive set is a slow test): parity only, another rank file, three parity files."""
    _rebuild_patterns(tmp_path, kind, [(), (6,), (0, 5), (4, 5, 7), (1, 3, 4)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_every_pattern_with_the_rank_file_lost_rebuilds_it_on_disk(tmp_path, kind):
    """Rank 2's file lost with 0 to 3 of the other 7 files (64 patterns: rank files, parity, mixes)."""
    others = [i for i in range(2 * K) if i != 2]
    _rebuild_patterns(tmp_path, kind, [c for n in range(K) for c in itertools.combinations(others, n)])


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_a_fifth_loss_or_damaged_parity_is_a_clear_error(tmp_path, dirs, kind):
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    for g in (0, 1, 2):
        (_l3(root, g) / f"Ckpt1-Rank{g}.fti").unlink()
    (_l3(root, 3) / "Ckpt1-RSed3.fti").unlink()
    rsed = _l3(root, 0) / "Ckpt1-RSed0.fti"
    raw = bytearray(rsed.read_bytes())
    raw[5] ^= 0x40  # a parity byte: its MD5 (meta file, or its record) no longer matches
    rsed.write_bytes(bytes(raw))
    ctx = ftidask.init(**dirs)
    ctx.protect(0, np.zeros(800, "u1"))
    with pytest.raises(NoCheckpointError) as info:
        recover_fti_run(ctx, config, 1)
    ctx.finalize()
    message = str(info.value)
    assert "5 of the group's 8 files are lost or damaged" in message and "at most 4" in message
    assert "Ckpt1-RSed0.fti" in message and ("MD5" in message or "damaged" in message)
    assert "Ckpt1-RSed3.fti: missing" in message
    assert not (_l3(root, 1) / "Ckpt1-Rank1.fti").exists()  # nothing written


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_damaged_parity_is_left_out_and_a_damaged_rank_file_rebuilt(tmp_path, dirs, kind):
    """A rank file with a flipped byte is refused, rebuilt (in place) without the damaged parity of another rank."""
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    own = _l3(root, 3) / "Ckpt1-Rank3.fti"
    for path in (own, _l3(root, 1) / "Ckpt1-RSed1.fti"):
        raw = bytearray(path.read_bytes())
        raw[7] ^= 1
        path.write_bytes(bytes(raw))
    found = _recover(dirs, config, kind, 3)
    assert found.rebuilt and own.read_bytes() == _rank(kind, 3)


def test_a_rebuild_that_does_not_verify_is_not_put_in_place(tmp_path):
    """Files of another checkpoint in the group (their MD5 in a meta file of that one): the rebuilt bytes fail the
    lost file's ckpt_checksum, and nothing is written."""
    root = tmp_path / "fti"
    cfg = load_config(_write_run(root, "posix"))
    meta = root / f"Meta/{EXEC}/l3/sector0-group0.fti"
    raw = bytearray(_rank("posix", 0))
    raw[10] ^= 1  # rank 0's file changed, its checksum too: the group is no longer what the parity encodes
    (_l3(root, 0) / "Ckpt1-Rank0.fti").write_bytes(bytes(raw))
    meta.write_text(meta.read_text().replace(hashlib.md5(_rank("posix", 0)).hexdigest(), hashlib.md5(raw).hexdigest()))
    (_l3(root, 2) / "Ckpt1-Rank2.fti").unlink()
    with pytest.raises(RecoveryError, match="does not match the meta file's ckpt_checksum"):
        rebuild_rank_file(cfg, 2, 1)
    assert sorted(p.name for p in _l3(root, 2).iterdir()) == ["Ckpt1-RSed2.fti"]


def test_a_group_past_rebuilding_sends_the_search_on_to_level_4(tmp_path, dirs):
    """Five of the eight FTI-FF files gone: the rebuild's reason is kept and level 4 is read, as FTI goes on."""
    root = tmp_path / "fti"
    config = _write_run(root, "ftiff")
    for g in (0, 1, 3):
        (_l3(root, g) / f"Ckpt1-Rank{g}.fti").unlink()
    for g in (0, 2):
        (_l3(root, g) / f"Ckpt1-RSed{g}.fti").unlink()
    l4 = root / f"Global/{EXEC}/l4/Ckpt1-Rank1.fti"
    l4.parent.mkdir(parents=True)
    l4.write_bytes(_rank("ftiff", 1))
    found = _recover(dirs, config, "ftiff", 1)
    assert (found.level, found.rebuilt) == (4, False)
    l4.unlink()
    with pytest.raises(NoCheckpointError, match="rank file rebuilt from FTI's parity: 5 of the group's 8 files"):
        _recover(dirs, config, "ftiff", 1)


def test_an_fti_1_1_group_is_decoded_with_zero_padding_alone(tmp_path, dirs):
    """FTI 1.1's FTI_RSenc pads its FTI-FF files with zeros only (no size word) and ends each parity file with its raw
    96-byte struct: the rebuilt file's size is its parity record's ckptSize (else its file block's fs)."""
    root = tmp_path / "fti"
    config = _config(root, "ftiff")
    variables = [inputs.ftiff_vars(g) for g in range(K)]

    def file_of(g: int, max_fs: int) -> bytes:
        blocks = [[(0, 0, 1, 0, len(variables[g][0])), (1, 1, 1, 0, len(variables[g][1]))]]
        return fti11_file(variables[g], blocks, max_fs=max_fs)

    max_fs = max(len(file_of(g, -1)) for g in range(K))
    files = [file_of(g, max_fs) for g in range(K)]
    parity = fti_rs.encode(K, files, max_fs)
    for g in range(K):
        _l3(root, g).mkdir(parents=True)
        (_l3(root, g) / f"Ckpt1-Rank{g}.fti").write_bytes(files[g])
        (_l3(root, g) / f"Ckpt1-RSed{g}.fti").write_bytes(fti_rsed_file(parity[g], len(files[g]), record="1.1"))
    (_l3(root, 1) / "Ckpt1-Rank1.fti").unlink()
    (_l3(root, 1) / "Ckpt1-RSed1.fti").unlink()  # the size then comes from the rebuilt file block
    found = _recover(dirs, config, "ftiff", 1)
    assert found.rebuilt and found.path.read_bytes() == files[1]


def test_the_group_of_a_rank_on_nodes_of_two_processes(tmp_path, dirs):
    """node_size 2: rank 5 (node 2, second process) is at place 2 of the group of ranks 1, 3, 5, 7 (nodes 0-3): its
    files and its group's are found where FTI keeps them, named by global rank."""
    root = tmp_path / "fti"
    config = _config(root, "ftiff")
    config.write_text(config.read_text().replace("node_size = 1", "node_size = 2"))
    for g in range(K):
        folder, member = _l3(root, g), 2 * g + 1
        folder.mkdir(parents=True)
        (folder / f"Ckpt1-Rank{member}.fti").write_bytes(_rank("ftiff", g))
        (folder / f"Ckpt1-RSed{member}.fti").write_bytes(fti_rsed_file(_parity("ftiff", g), len(_rank("ftiff", g))))
    (_l3(root, 2) / "Ckpt1-Rank5.fti").unlink()
    ctx = ftidask.init(**dirs)
    arrays = {vid: np.zeros(len(raw), "u1") for vid, raw in inputs.ftiff_vars(2).items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    found = recover_fti_run(ctx, config, 5)
    ctx.finalize()
    assert found.rebuilt and found.path == _l3(root, 2) / "Ckpt1-Rank5.fti"
    assert {vid: a.tobytes() for vid, a in arrays.items()} == inputs.ftiff_vars(2)


# A rebuild in a child whose files may grow to 64 MiB at most (SIGXFSZ ignored: a write past it fails with EFBIG),
# under a timeout: before the room was checked, a hostile group made it write a terabyte, or hash one.
_REBUILD_CHILD = """
import resource, signal, sys
import ftidask
from ftidask.tools.fti_l3 import rebuild_rank_file
from ftidask.model.config import load_config
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
try:
    rebuild_rank_file(load_config(sys.argv[1]), 0, 1)
except ftidask.RecoveryError as exc:
    print("REFUSED", exc)
else:
    print("REBUILT")
"""
_SPARSE = 1 << 43  # 8 TiB of nothing on disk: a sparse file costs no space, more than any test machine has free


def _sparse(path: Path, size: int, tail: bytes = b"") -> None:
    try:
        with open(path, "r+b" if path.exists() else "w+b") as fh:
            fh.truncate(size)
            if tail:
                fh.seek(size)
                fh.write(tail)
    except OSError as exc:  # a file system without sparse files this large
        pytest.skip(f"no sparse file of {size} bytes here: {exc}")


def test_a_posix_group_whose_maxfs_exceeds_the_free_space_is_not_rebuilt(tmp_path):
    """The meta file says the lost file is 8 TiB (ckpt_file_maxs and its ckpt_file_size, no RSed_checksum) and the
    parity files are sparse files of that size: the rebuild, which writes maxFs bytes, is refused before any file is
    read or written, not left to fill the disk (it wrote until the child's 64 MiB limit before)."""
    import re

    from conftest import run_python

    config = _write_run(tmp_path, "posix")
    meta = tmp_path / f"Meta/{EXEC}/l3/sector0-group0.fti"
    text = re.sub(r"(?m)^(ckpt_file_maxs\s*=).*$", rf"\g<1> {_SPARSE}", meta.read_text())
    text = re.sub(r"(?m)^(rsed_checksum\s*=).*$", r"\g<1> ", text)
    meta.write_text(re.sub(r"(?m)^(ckpt_file_size\s*=).*$", rf"\g<1> {_SPARSE}", text, count=1))  # rank 0's
    for g in range(K):
        _sparse(_l3(tmp_path, g) / f"Ckpt1-RSed{g}.fti", _SPARSE)
    (_l3(tmp_path, 0) / "Ckpt1-Rank0.fti").unlink()
    out = run_python(_REBUILD_CHILD, str(config), timeout=60).stdout
    assert out.startswith("REFUSED") and f"ckpt_file_maxs is {_SPARSE} bytes" in out and "free" in out, out
    assert sorted(p.name for p in _l3(tmp_path, 0).iterdir()) == ["Ckpt1-RSed0.fti"]  # no temporary file left


def test_an_ftiff_parity_record_larger_than_the_free_space_is_left_out_unread(tmp_path):
    """An FTI-FF parity file made a sparse 8 TiB with a sound record saying so: it is left out as a lost file before
    its MD5 is computed (hours over 8 TiB before: the child's timeout), and the rank file is rebuilt from the group's
    other files, bit for bit."""
    from conftest import run_python
    from ftiff_builders import fti_record

    config = _write_run(tmp_path, "ftiff")
    record = fti_record("196f77d2", "0" * 32, ckpt_size=1000, meta_size=0, data_size=0, fs=_SPARSE,
                        max_fs=_SPARSE, pt_fs=-1)
    parity = _l3(tmp_path, 1) / "Ckpt1-RSed1.fti"
    parity.unlink()
    _sparse(parity, _SPARSE, record)
    rank0 = _l3(tmp_path, 0) / "Ckpt1-Rank0.fti"
    want = rank0.read_bytes()
    rank0.unlink()
    assert run_python(_REBUILD_CHILD, str(config), timeout=60).stdout == "REBUILT\n"
    assert rank0.read_bytes() == want


def test_a_posix_groups_meta_file_is_parsed_once_per_rebuild(tmp_path, monkeypatch):
    """The group's k sections are looked up in one pass over the meta file: one by one, a 16 MiB meta file (10 s a
    parse) was parsed k times per checkpoint id, up to 255 (group_size) times: 40 minutes for one rebuild. Counted
    with a spy around the real parser (which still runs); the rebuilt file is exact."""
    from ftidask.ftiff import posix

    parses = []
    real = posix.read_meta
    monkeypatch.setattr(posix, "read_meta", lambda path: parses.append(path) or real(path))
    config = _write_run(tmp_path, "posix")
    target = _l3(tmp_path, 2) / "Ckpt1-Rank2.fti"
    want = target.read_bytes()
    target.unlink()
    assert rebuild_rank_file(load_config(config), 2, 1) == target
    assert target.read_bytes() == want
    assert len(parses) == 1, parses


# --- odd group members (found by a review) ---------------------------------------------------------------------------


@pytest.mark.parametrize("odd", ["other maxFs", "FTI 1.1 record"])
def test_one_parity_file_that_disagrees_counts_as_lost(tmp_path, dirs, odd):
    """One parity file whose record gives another maxFs or FTI version stopped the rebuild ("the group's parity files
    disagree"), although the other seven files were sound: the group's majority is taken, the odd one counted lost."""
    root = tmp_path / "fti"
    config = _write_run(root, "ftiff")
    if odd == "other maxFs":
        forged = fti_rsed_file(_parity("ftiff", 3) + b"\0" * 64, 100)
    else:
        forged = fti_rsed_file(_parity("ftiff", 3), len(_rank("ftiff", 3)), record="1.1")
    (_l3(root, 3) / "Ckpt1-RSed3.fti").write_bytes(forged)
    (_l3(root, 1) / "Ckpt1-Rank1.fti").unlink()
    found = _recover(dirs, config, "ftiff", 1)
    assert found.rebuilt and found.path.read_bytes() == _rank("ftiff", 1)


def test_a_member_left_padded_is_read_without_its_padding(tmp_path, dirs):
    """A rank file that an interrupted FTI_RSdec left padded, with bytes other than zeros in its padding (never
    verified, never read: docs/format.md), was read as it is into the decoding: the rebuilt file did not verify."""
    root = tmp_path / "fti"
    config = _write_run(root, "ftiff")
    raw, max_fs = _rank("ftiff", 0), _max_fs("ftiff")
    (_l3(root, 0) / "Ckpt1-Rank0.fti").write_bytes(raw + b"\xff" * (max_fs - 8 - len(raw)) + struct.pack("<q", len(raw)))
    (_l3(root, 3) / "Ckpt1-Rank3.fti").unlink()
    found = _recover(dirs, config, "ftiff", 3)
    assert found.rebuilt and found.path.read_bytes() == _rank("ftiff", 3)


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_a_rank_file_replaced_by_a_directory_is_rebuilt_in_its_place(tmp_path, dirs, kind):
    """The rebuilt file could not replace a directory at its name ("Is a directory"): the search went on to level 4.
    ftidask's own levels clear such a directory; FTI's level 3 does too now."""
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    own = _l3(root, 1) / "Ckpt1-Rank1.fti"
    own.unlink()
    own.mkdir()
    (own / "x").write_text("x")
    found = _recover(dirs, config, kind, 1)
    assert found.rebuilt and own.read_bytes() == _rank(kind, 1)


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_a_level_directory_replaced_by_a_link_is_not_rebuilt_through(tmp_path, dirs, kind):
    """A lost node's l3 directory replaced by a link to a directory outside the run: the rebuild wrote the rank file
    there, in place of a user's directory of the same name (moved to the trash and removed)."""
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    outside = tmp_path / "OUTSIDE"
    (outside / "Ckpt1-Rank1.fti").mkdir(parents=True)
    (outside / "Ckpt1-Rank1.fti" / "precious.txt").write_text("user data")
    lost = _l3(root, 1)
    shutil.rmtree(lost)
    lost.symlink_to(outside)
    with pytest.raises(NoCheckpointError, match="is a symbolic link"):
        _recover(dirs, config, kind, 1)
    assert (outside / "Ckpt1-Rank1.fti" / "precious.txt").read_text() == "user data"


@pytest.mark.parametrize("kind", ["posix", "ftiff"])
def test_a_sound_file_refused_for_the_arrays_is_not_rebuilt(tmp_path, dirs, kind):
    """A sound level-3 file refused only because the protected arrays have other sizes was rebuilt from the parity
    and replaced (a new inode, for every older checkpoint too), and the refusal was said twice."""
    root = tmp_path / "fti"
    config = _write_run(root, kind)
    own = _l3(root, 1) / "Ckpt1-Rank1.fti"
    inode = own.stat().st_ino
    ctx = ftidask.init(**dirs)
    for vid, raw in _expected(kind, 1).items():
        ctx.protect(vid, np.zeros(len(raw) + 8, "u1"))
    with pytest.raises(NoCheckpointError) as info:
        recover_fti_run(ctx, config, 1)
    ctx.finalize()
    assert own.stat().st_ino == inode and own.read_bytes() == _rank(kind, 1)
    assert "rebuilt from FTI's parity" not in str(info.value)
