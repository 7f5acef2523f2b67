"""FTI's POSIX differential checkpoints (``dcp-id{f}-rank{r}.fti``, ckpt_io = 1 with enable_dcp = 1), read with
FTI's meta file: :mod:`ftidask.ftiff.fti_dcp_posix` through ``recover_file(path, meta=...)``.

The files are the ones FTI's own dCP-POSIX writer made (tests/data/fti_dcp_posix/README.md): five checkpoints with
dcp_stack_size = 3 (file id 0 with layers 0-2, file id 1 with layers 0-1), dcp_block_size = 512; variable 0 is
double[300] (a partial last block), 1 int32[256], 1000 uint8 grown from 700 to 1300 bytes at checkpoint 3 and
shrunk to 600 at checkpoint 5. ``ckpt{k}/`` holds the file and meta file as of checkpoint k and each variable's
bytes then (``var{id}.bin``).
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.errors import NoCheckpointError, RecoveryError
from ftidask.ftiff.fti_dcp_posix import read_dcp_head, read_dcp_posix
from ftidask.model.errors import FormatError
from ftidask.tools.cli import main as cli_main
from ftidask.tools.fti_run import fti_run_files, recover_fti_run

DATA = Path(__file__).parent / "data" / "fti_dcp_posix"
DTYPES = {0: np.dtype("<f8"), 1: np.dtype("<i4"), 1000: np.dtype("u1")}
FILE_OF = {1: "dcp-id0-rank0.fti", 2: "dcp-id0-rank0.fti", 3: "dcp-id0-rank0.fti", 4: "dcp-id1-rank0.fti",
           5: "dcp-id1-rank0.fti"}


def _expected(k: int) -> dict[int, bytes]:
    return {vid: (DATA / f"ckpt{k}" / f"var{vid}.bin").read_bytes() for vid in DTYPES}


def _copy(tmp_path: Path, k: int) -> tuple[Path, Path]:
    where = tmp_path / f"ckpt{k}"
    shutil.copytree(DATA / f"ckpt{k}", where)
    return where / FILE_OF[k], where / "sector0-group0.fti"


def _protect(ctx, k: int, fill: int = 0x5A) -> dict[int, np.ndarray]:
    arrays = {}
    for vid, raw in _expected(k).items():
        arrays[vid] = np.frombuffer(bytearray([fill]) * len(raw), DTYPES[vid])
        ctx.protect(vid, arrays[vid])
    return arrays


def _refused(ctx, arrays: dict[int, np.ndarray], path: Path, meta: Path, match: str) -> None:
    before = {vid: a.tobytes() for vid, a in arrays.items()}
    with pytest.raises(RecoveryError, match=match):
        ctx.recover_file(path, meta=meta)
    assert {vid: a.tobytes() for vid, a in arrays.items()} == before  # nothing touched


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("meta_as", ["file", "directory"])
def test_every_checkpoint_of_fti_s_run_is_read_bit_for_bit(dirs, k, meta_as):
    """Each layer of both file ids: layer 0 alone, layers 0-1, 0-2 (a variable grown), and of the second file."""
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, k)
    meta = DATA / f"ckpt{k}" / "sector0-group0.fti"
    got = ctx.recover_file(DATA / f"ckpt{k}" / FILE_OF[k], meta=meta if meta_as == "file" else meta.parent)
    assert set(got) == set(DTYPES)
    assert {vid: a.tobytes() for vid, a in arrays.items()} == _expected(k)
    ctx.finalize()


@pytest.mark.parametrize("k", [1, 2])
def test_layers_appended_after_the_meta_file_are_not_read(dirs, k):
    """The file as of checkpoint 3 with checkpoint k's meta file: the state of checkpoint k (FTI reads the layers
    its meta file records; a layer written after it is left alone)."""
    got = read_dcp_posix(DATA / "ckpt3" / FILE_OF[3], DATA / f"ckpt{k}" / "sector0-group0.fti")
    assert {vid: bytes(b) for vid, b in got.data.items()} == _expected(k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_unsigned_long_layout_of_earlier_fti_is_read_bit_for_bit(k):
    """FTI's src/diff-checkpoint-posix.c (commit 042fdb56: 8-byte block size and variable sizes), stack size 2:
    tests/data/fti_dcp_posix/ulong."""
    where = DATA / "ulong" / f"ckpt{k}"
    got = read_dcp_posix(next(where.glob("dcp-id*-rank0.fti")), where / "sector0-group0.fti")
    assert {vid: bytes(b) for vid, b in got.data.items()} == {
        vid: (where / f"var{vid}.bin").read_bytes() for vid in (3, 5)}


def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("offset, match", [
    (0, "no dCP file header|layer 0"),           # the block size
    (4, "stack size|no dCP file header"),        # the stack size: 3 becomes 19
    (16 + 8 + 100, "layer 0's blocks do not match"),  # a byte of variable 0 in layer 0
    (4648 + 8 + 6 + 3, "layer 1's blocks do not match"),  # a byte of layer 1's first block
    (4648 + 8 + 2, "not in FTI.s order"),  # block 0 of layer 1 named block 4, the next one
    (5692 + 8 + 518 + 300, "layer 2's blocks do not match"),
    (5692, "the newest layer is checkpoint 19, the meta file's ckpt_id is 3"),  # its checkpoint id: 3 ^ 0x10
    (5696, "the newest layer counts 19 variables"),
    # a block header of layer 2 naming a block past its variable's size then: the block was dropped and the older
    # layer's one recovered in its place, wrong data without a word (FTI's layer hash covers no header)
    (5705, "layer 2 holds block 67108865 of variable 1, past its 1024 bytes at that layer"),
    (5702, "layer 2 holds block 5 of variable 1, past its 1024 bytes at that layer"),
])
def test_a_flipped_byte_is_refused_and_arrays_untouched(tmp_path, dirs, offset, match):
    path, meta = _copy(tmp_path, 3)
    _flip(path, offset)
    ctx = ftidask.init(**dirs)
    _refused(ctx, _protect(ctx, 3), path, meta, match)
    ctx.finalize()


def test_a_damaged_layer_hash_in_the_meta_file_is_refused(tmp_path, dirs):
    path, meta = _copy(tmp_path, 2)
    text = meta.read_text()
    digest = re.search(r"dcp_layer1_hash\s*=\s*([0-9a-f]{32})", text)[1]
    meta.write_text(text.replace(digest, digest[:-1] + ("0" if digest[-1] != "0" else "1")))
    ctx = ftidask.init(**dirs)
    _refused(ctx, _protect(ctx, 2), path, meta, "layer 1's blocks do not match the meta file's dcp_layer1_hash")
    ctx.finalize()


@pytest.mark.parametrize("keep", [0, 11, 30, 4647, 4648 + 500, 7253])
def test_a_file_cut_short_is_refused(tmp_path, dirs, keep):
    path, meta = _copy(tmp_path, 3)
    path.write_bytes(path.read_bytes()[:keep])
    ctx = ftidask.init(**dirs)
    _refused(ctx, _protect(ctx, 3), path, meta, "cut short|shorter than")
    ctx.finalize()


def test_the_meta_file_of_a_full_checkpoint_or_another_file_is_refused(tmp_path):
    path, meta = _copy(tmp_path, 2)
    meta.write_text(re.sub(r"(?m)^(ckpt_type\s*=) dcp$", r"\g<1> full", meta.read_text()))
    with pytest.raises(FormatError, match="ckpt_type is 'full', not dcp"):
        read_dcp_posix(path, meta)
    with pytest.raises(FormatError, match="no section"):
        read_dcp_posix(path, DATA / "ckpt4" / "sector0-group0.fti")


def _assert_clean(path: Path, meta: Path) -> None:
    """Read: either a FormatError, or the data (a field no hash covers may change without harm): never another
    exception."""
    try:
        read_dcp_posix(path, meta)
    except FormatError:
        pass


@pytest.mark.parametrize("seed", range(4))
def test_hostile_header_fields_give_format_errors_only(tmp_path, seed):  # read_dcp_head (inspect) too
    """Seeded fuzz over the fields no hash covers: file header, layer headers, variable headers, block headers,
    set to huge, negative, zero or off-by-one values."""
    rng = random.Random(seed)
    path, meta = _copy(tmp_path, 3)
    original = path.read_bytes()
    # (offset, format) of the header fields of checkpoint 3's file: 16-byte file+layer 0 header, variable headers
    fields = [(0, "<I"), (4, "<I"), (8, "<i"), (12, "<i"), (16, "<i"), (20, "<I"), (24 + 2560, "<i"),
              (28 + 2560, "<I"), (4648, "<i"), (4652, "<i"), (4656, "<I"), (4660, "<H"), (5692 + 8, "<I")]
    for _ in range(60):
        raw = bytearray(original)
        for offset, fmt in rng.sample(fields, rng.randint(1, 3)):
            bits = struct.calcsize(fmt) * 8
            value = rng.choice([0, 1, -1, 2**31 - 1, -2**31, 2**(bits - 1), rng.getrandbits(bits), 511, 513, 10, 11])
            value %= 2**bits
            struct.pack_into(fmt.replace("i", "I").replace("h", "H"), raw, offset, value)
        path.write_bytes(bytes(raw))
        _assert_clean(path, meta)
        try:
            read_dcp_head(path)
        except FormatError:
            pass


@pytest.mark.parametrize("key, values", [
    ("dcp_layer0_size", ["0", "1", "99999999999999", "-5", "4647", "4649", "x"]),
    ("dcp_layer1_size", ["0", "8", "526", "1045", "18446744073709551615"]),
    ("ckpt_file_size", ["0", "7254000", "-1"]),
    ("var0_size", ["0", "2399", "2401", "99999999999", "-1"]),
    ("var2_id", ["0", "-1", "262144", "999"]),
    ("dcp_layer2_hash", ["", "abc", "0" * 8]),
])
def test_hostile_meta_values_give_format_errors(tmp_path, key, values):
    """Sizes and counts of the meta file: huge, negative, overlapping a neighbour's bytes, not numbers."""
    path, meta = _copy(tmp_path, 3)
    text = meta.read_text()
    for value in values:
        changed = re.sub(rf"(?m)^({key}\s*=).*$", rf"\g<1> {value}", text)
        assert changed != text or value in text
        meta.write_text(changed)
        with pytest.raises(FormatError):
            read_dcp_posix(path, meta)


def test_cli_verify_recognises_a_dcp_file(tmp_path, capsys):
    path, meta = _copy(tmp_path, 5)
    assert cli_main(["verify", str(path.parent), "--meta", str(meta)]) == 0
    assert "1 sound, 0 damaged" in capsys.readouterr().out
    _flip(path, 5160 + 8 + 6 + 40)
    assert cli_main(["verify", str(path), "--meta", str(meta)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "layer 1's blocks do not match" in out
    assert cli_main(["verify", str(path)]) == 1  # without its meta file: says what the file is and how to check it
    assert "FTI's POSIX dCP file" in capsys.readouterr().out


def test_level_1_dcp_files_are_listed_after_level_1_s_own_files(tmp_path, dirs):
    """L4 not inline: FTI writes the dCP file to L1's dCP directory, {ckpt_dir}/{exec_id}/dCP, meta file of l1."""
    run = tmp_path / "run"
    (run / "Local/20260101-000000/dCP").mkdir(parents=True)
    (run / "Local/20260101-000000/l1").mkdir(parents=True)
    (run / "Meta/20260101-000000/l1").mkdir(parents=True)
    shutil.copy(DATA / "ckpt3" / FILE_OF[3], run / "Local/20260101-000000/dCP")
    shutil.copy(DATA / "ckpt3" / "sector0-group0.fti", run / "Meta/20260101-000000/l1")
    (run / "Local/20260101-000000/l1/Ckpt9-Rank0.fti").write_bytes(b"not described by the meta file")
    files = fti_run_files(_config(run), 0)
    assert [(f.level, f.path.name) for f in files] == [(1, "Ckpt9-Rank0.fti"), (1, FILE_OF[3])]
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 3)
    found = recover_fti_run(ctx, _config(run), 0)
    assert (found.level, found.path.name, found.meta) == (1, FILE_OF[3], run / "Meta/20260101-000000/l1")
    assert {vid: a.tobytes() for vid, a in arrays.items()} == _expected(3)
    ctx.finalize()


def test_recover_file_without_its_meta_file_says_how_to_read_it(dirs):
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 5)
    _refused(ctx, arrays, DATA / "ckpt5" / FILE_OF[5], None, r"read with its meta file: recover_file\(path, meta=")
    ctx.finalize()


def test_cli_inspect_and_list_recognise_a_dcp_file(tmp_path, capsys):
    """inspect prints the header and layer 0; list checks the file against its run's meta file (level 4, else 1)
    and says what it holds, or why not; the FTI-FF table does not count it as a damaged FTI-FF file."""
    run = _run(tmp_path)
    path = run / "Global/20260101-000000/dCP" / FILE_OF[5]
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FTI POSIX differential checkpoint file" in out and "block size 512, stack size 3" in out
    assert "layer 0: checkpoint 4" in out and "id 1000: 1300 bytes" in out
    assert cli_main(["inspect", str(path), "--json"]) == 0
    assert '"variables"' in capsys.readouterr().out
    assert cli_main(["list", str(run)]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" not in out and f"{FILE_OF[5]}: sound" in out and "id 1000: 600 bytes" in out
    _flip(path, 200)
    assert cli_main(["list", str(run)]) == 0
    assert "DAMAGED: " in capsys.readouterr().out
    (run / "Meta/20260101-000000/l4/sector0-group0.fti").unlink()
    assert cli_main(["list", str(run)]) == 0
    assert "no meta file of run 20260101-000000 names it" in capsys.readouterr().out
    path.write_bytes(b"\x00\x02\x00")  # cut inside the header: inspect says so, no traceback
    assert cli_main(["inspect", str(path)]) == 2
    assert "shorter than a dCP file header" in capsys.readouterr().err


def test_hostile_variable_sizes_ask_for_no_memory(tmp_path):
    """A size the layers cannot hold (both of the meta file's records of it changed) is refused before any buffer
    of that size is made."""
    path, meta = _copy(tmp_path, 3)
    text = meta.read_text()
    meta.write_text(re.sub(r"(?m)^((dcp_layer\d_)?var0_size\s*=).*$", r"\g<1> 99999999999999", text))
    with pytest.raises(FormatError, match="blocks, the layers hold"):
        read_dcp_posix(path, meta)


def _run(tmp_path: Path) -> Path:
    """An FTI run's directories as of checkpoint 5: the dCP file in L4's dCP directory, the meta file of l4."""
    run = tmp_path / "run"
    (run / "Global/20260101-000000/dCP").mkdir(parents=True)
    (run / "Meta/20260101-000000/l4").mkdir(parents=True)
    shutil.copy(DATA / "ckpt5" / FILE_OF[5], run / "Global/20260101-000000/dCP")
    shutil.copy(DATA / "ckpt5" / "sector0-group0.fti", run / "Meta/20260101-000000/l4")
    return run


def _config(root: Path, **keys) -> Path:
    values = {"ckpt_dir": root / "Local", "glbl_dir": root / "Global", "meta_dir": root / "Meta", "node_size": 1,
              "group_size": 1, "local_test": 0, "ckpt_io": 1, "failure": 1, "exec_id": "20260101-000000"} | keys
    sections = {"basic": [k for k in values if k not in ("failure", "exec_id", "local_test")],
                "restart": ["failure", "exec_id"], "advanced": ["local_test"]}
    (root / "config.fti").write_text("".join(f"[{s}]\n" + "".join(f"{k} = {values[k]}\n" for k in ks)
                                             for s, ks in sections.items()))
    return root / "config.fti"


def test_fti_run_files_lists_the_dcp_file_where_fti_keeps_it(tmp_path, dirs):
    """Inline L4: the global dCP directory, the meta file of level 4 (FTI_InitDCPPosix, FTI_WriteMetadata)."""
    run = _run(tmp_path)
    config = _config(run)
    files = fti_run_files(config, 0)
    assert [(f.level, f.ckpt_id, f.path.name, f.meta) for f in files] == [
        (4, 1, FILE_OF[5], run / "Meta/20260101-000000/l4")]
    ctx = ftidask.init(**dirs)
    arrays = _protect(ctx, 5)
    assert recover_fti_run(ctx, config, 0).path.name == FILE_OF[5]
    assert {vid: a.tobytes() for vid, a in arrays.items()} == _expected(5)
    _flip(run / "Global/20260101-000000/dCP" / FILE_OF[5], 100)
    with pytest.raises(NoCheckpointError, match="layer 0's blocks do not match"):
        recover_fti_run(ctx, config, 0)
    ctx.finalize()


def _forged_dcp(folder: Path, nvars: int, nblocks: int) -> bytes:
    """A dCP file of block size 1 whose every hash is right (as a forger computes them): layer 0 lists ``nvars``
    empty variables, layer 1 gives variable 0 ``nblocks`` blocks; its meta file beside it. Variable 0's bytes."""
    layer0 = struct.pack("<II", 1, 2) + struct.pack("<ii", 1, nvars) + b"".join(struct.pack("<iI", j, 0)
                                                                               for j in range(nvars))
    blocks = [bytes([i % 251]) for i in range(nblocks)]
    word = [i << 18 for i in range(nblocks)]  # varId 0, blockId i
    layer1 = struct.pack("<ii", 2, nvars) + b"".join(struct.pack("<IH", w & 0xFFFFFFFF, w >> 32) + block
                                                     for w, block in zip(word, blocks))
    (folder / "dcp-id0-rank0.fti").write_bytes(layer0 + layer1)
    digest = hashlib.md5(b"".join(hashlib.md5(block).digest() for block in blocks)).hexdigest()
    lines = ["[ckpt_info]", "ckpt_type = dcp", "[0]", "ckpt_file_name = dcp-id0-rank0.fti",
             f"ckpt_file_size = {len(layer0) + len(layer1)}", "ckpt_checksum = unused",
             f"dcp_layer0_size = {len(layer0)}", f"dcp_layer0_hash = {hashlib.md5().hexdigest()}",
             f"dcp_layer1_size = {len(layer1)}", f"dcp_layer1_hash = {digest}"]
    lines += [f"var{j}_id = {j}\nvar{j}_size = {nblocks if j == 0 else 0}" for j in range(nvars)]
    (folder / "sector0-group0.fti").write_text("\n".join(lines) + "\n")
    return b"".join(blocks)


def test_many_variables_and_blocks_are_applied_in_linear_time(tmp_path):
    """8 000 variables and 80 000 blocks (a 600 KB file, hashes forged): each variable's blocks are gathered in one
    pass over the layers, not by scanning every block for each variable (a minute that way, hours at the sizes a
    meta file allows), and the result is exact."""
    import time

    want = _forged_dcp(tmp_path, 8_000, 80_000)
    # CPU time of this thread (the read runs here), not the wall clock: on a loaded 2-core machine (CI, another test
    # run) the wall clock measures the other processes too (2.0 s for 0.6 s of CPU seen here); a quadratic pass costs
    # the CPU time all the same.
    start = time.thread_time()
    found = read_dcp_posix(tmp_path / "dcp-id0-rank0.fti", tmp_path / "sector0-group0.fti")
    assert time.thread_time() - start < 8
    assert bytes(found.data[0]) == want and len(found.data) == 8_000
    assert all(len(found.data[j]) == 0 for j in range(1, 8_000))
