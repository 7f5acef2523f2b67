"""A run FTI wrote with heads (``head = 1``): the files of each application process found and read, never another's.

Built here as FTI lays them out (src/topo.c FTI_Topology, src/checkpoint.c FTI_WriteCkpt/FTI_PostCkpt,
src/postckpt.c FTI_RSenc/FTI_FlushPosix/FTI_FlushMPI; docs/format.md "Runs with heads"): ``node_size`` counts the
head, the first process of each node (``local_test``: node ``r // node_size``); files are named by global rank; the
meta files are ``sector{s}-group{p}.fti`` per place ``p >= 1`` on the node, one section per node of the sector; the
heads encode level 3 place by place with the heads' group, i.e. the same groups and column order as inline; level 4
flushed by the heads is the local file copied (POSIX, FTI-FF) or the local files put one after the other in node
order (MPI-IO, the order of FTI_COMM_WORLD), the local files then kept as level 1, the meta files only at level 4.

Level-3 parity: place 1 is the group of 4 POSIX files and the parity that the Jerasure oracle computed
(tests/data/fti_l3); place 2's is ftidask's encoder, pinned against that oracle by tests/test_fti_l3_decode.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
from ftiff_builders import fti_rsed_file

import ftidask
from ftidask.errors import NoCheckpointError
from ftidask.ftiff import fti_rs
from ftidask.model.config import load_config
from ftidask.model.errors import ConfigError
from ftidask.tools.fti_l3 import rebuild_rank_file
from ftidask.tools.fti_ranks import app_rank, global_rank
from ftidask.tools.fti_run import fti_run_files, recover_fti_run

L3_DATA = Path(__file__).parent / "data" / "fti_l3" / "posix"
EXEC = "2025-06-07_08-09-10"
NODE_SIZE = 3  # a head and 2 application processes per node


def _config(root: Path, nodes: int, ckpt_io: int = 1, **keys) -> Path:
    values = {"ckpt_dir": root / "Local", "glbl_dir": root / "Global", "meta_dir": root / "Meta", "head": 1,
              "node_size": NODE_SIZE, "group_size": nodes, "ckpt_io": ckpt_io, "inline_l2": 0, "inline_l3": 0,
              "inline_l4": 0} | keys
    text = ("[basic]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
            + f"[restart]\nfailure = 1\nexec_id = {EXEC}\n[advanced]\nlocal_test = 1\nblock_size = 1\n")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.fti").write_text(text)
    return root / "config.fti"


def _local(root: Path, node: int, level: int) -> Path:
    return root / f"Local/node{node}/{EXEC}/l{level}"


def _section(name: str, raw: bytes, max_fs: int, parity: bytes | None = None) -> dict[str, object]:
    entries = {"ckpt_file_name": name, "ckpt_file_size": len(raw), "ckpt_file_maxs": max_fs,
               "ckpt_checksum": hashlib.md5(raw).hexdigest()}
    if parity is not None:
        entries["rsed_checksum"] = hashlib.md5(parity).hexdigest()
    return entries | {"var0_id": 0, "var0_size": 800, "var1_id": 1, "var1_size": len(raw) - 800}


def _write_meta(path: Path, sections: list[dict[str, object]]) -> None:
    """FTI_WriteMetadata's file: a section per group rank (the node's place in the sector)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(f"[{g}]\n" + "".join(f"{k:<30} = {v}\n" for k, v in s.items())
                              for g, s in enumerate(sections)) + "\n")


def _place2_files() -> list[bytes]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (1200, 2222, 901, 3100)]


def _l3_group(root: Path, ckpt: int, place: int) -> list[bytes]:
    """Level 3 of place ``place`` on 4 nodes: its rank files, parity files and meta file, as the heads leave them."""
    if place == 1:  # the oracle's group and parity
        files = [(L3_DATA / f"Ckpt1-Rank{g}.fti").read_bytes() for g in range(4)]
        parity = [(L3_DATA / f"parity{g}.bin").read_bytes() for g in range(4)]
    else:
        files = _place2_files()
        max_fs = max(map(len, files))
        parity = fti_rs.encode(4, [f.ljust(max_fs, b"\0") for f in files], max_fs)
    max_fs = len(parity[0])
    sections = []
    for node in range(4):
        rank = node * NODE_SIZE + place
        folder = _local(root, node, 3)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"Ckpt{ckpt}-Rank{rank}.fti").write_bytes(files[node])
        (folder / f"Ckpt{ckpt}-RSed{rank}.fti").write_bytes(parity[node])
        sections.append(_section(f"Ckpt{ckpt}-Rank{rank}.fti", files[node], max_fs, parity[node]))
    _write_meta(root / f"Meta/{EXEC}/l3/sector0-group{place}.fti", sections)
    return files


def _l1_bytes(rank: int) -> bytes:
    """Level 1's file of global rank ``rank``: every rank the same sizes (800 + 1000 bytes), its own bytes, so that
    another rank's file would verify just as well: only the mapping tells them apart."""
    return np.random.default_rng(100 + rank).integers(0, 256, 1800, dtype=np.uint8).tobytes()


def _l1(root: Path, ckpt: int, nodes: int) -> None:
    for place in (1, 2):
        sections = []
        for node in range(nodes):
            rank = node * NODE_SIZE + place
            raw = _l1_bytes(rank)
            folder = _local(root, node, 1)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"Ckpt{ckpt}-Rank{rank}.fti").write_bytes(raw)
            sections.append(_section(f"Ckpt{ckpt}-Rank{rank}.fti", raw, 1800))
        _write_meta(root / f"Meta/{EXEC}/l1/sector0-group{place}.fti", sections)


def _recover(dirs, config: Path, rank: int, expected: bytes, **kwargs):
    ctx = ftidask.init(**dirs)
    arrays = {0: np.zeros(800, "u1"), 1: np.zeros(len(expected) - 800, "u1")}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    try:
        found = recover_fti_run(ctx, config, rank, **kwargs)
        assert arrays[0].tobytes() + arrays[1].tobytes() == expected, (rank, found)
        return found
    finally:
        ctx.finalize()


def test_ranks_of_a_run_with_heads(tmp_path):
    """node_size 3: heads are global ranks 0, 3, 6; FTI_COMM_WORLD ranks 0..3 are global 1, 2, 4, 5."""
    cfg = load_config(_config(tmp_path / "a", 2))
    assert [global_rank(cfg, a, "app") for a in range(6)] == [1, 2, 4, 5, 7, 8]
    assert [app_rank(cfg, g) for g in (1, 2, 4, 5, 7, 8)] == list(range(6))
    assert global_rank(cfg, 4, "global") == 4
    for head in (0, 3, 6):
        with pytest.raises(ConfigError, match=f"global rank {head} is the head of node {head // 3}"):
            global_rank(cfg, head, "global")
    with pytest.raises(ConfigError, match="has heads .* comm='app'"):
        global_rank(cfg, 1)
    with pytest.raises(ConfigError, match="comm = 'world'"):
        global_rank(cfg, 1, "world")
    without = load_config(_config(tmp_path / "b", 2, head=0))
    assert global_rank(without, 3) == global_rank(without, 3, "app") == global_rank(without, 3, "global") == 3
    with pytest.raises(ConfigError, match="no application process"):
        global_rank(load_config(_config(tmp_path / "c", 2, node_size=1)), 0, "app")


def test_a_run_with_heads_refuses_a_rank_without_its_communicator(tmp_path):
    config = _config(tmp_path / "fti", 4)
    with pytest.raises(ConfigError, match="could name two processes"):
        fti_run_files(config, 1)
    with pytest.raises(ConfigError, match="head of node 1"):
        fti_run_files(config, 3, comm="global")
    with pytest.raises(ConfigError, match="head of node 2"):
        rebuild_rank_file(load_config(config), 6, 1)
    ctx = ftidask.init(ckpt_dir=str(tmp_path / "L"), glbl_dir=str(tmp_path / "G"), meta_dir=str(tmp_path / "M"))
    array = np.full(8, 7, "u1")
    ctx.protect(0, array)
    with pytest.raises(ConfigError, match="could name two processes"):
        recover_fti_run(ctx, config, 2)
    assert (array == 7).all()
    ctx.finalize()


def test_each_application_rank_gets_its_own_level_1_file(tmp_path, dirs):
    """Same sizes, other bytes in every rank's file: FTI_COMM_WORLD rank a and global rank g each read their own
    (app 1 is global 2, not global 1; app 2 is global 4)."""
    root = tmp_path / "fti"
    config = _config(root, 2)
    _l1(root, 5, 2)
    for app, glob in enumerate((1, 2, 4, 5)):
        found = _recover(dirs, config, app, _l1_bytes(glob), comm="app")
        assert (found.level, found.path.name, found.path.parent.parent.parent.name) == (
            1, f"Ckpt5-Rank{glob}.fti", f"node{glob // NODE_SIZE}")
        assert _recover(dirs, config, glob, _l1_bytes(glob), comm="global").path == found.path


def test_a_lost_node_falls_back_to_level_3_rebuilt_from_the_heads_parity(tmp_path, dirs):
    """Level 1 (checkpoint 2) on 4 nodes, level 3 (checkpoint 1) encoded by the heads, place by place. Node 1 lost
    whole (its head, global ranks 4 and 5): both its application ranks rebuild their own level-3 file, each from its
    own group (place 1: the oracle's parity; place 2: another group), the other nodes read level 1."""
    root = tmp_path / "fti"
    config = _config(root, 4)
    _l1(root, 2, 4)
    place1, place2 = _l3_group(root, 1, 1), _l3_group(root, 1, 2)
    shutil.rmtree(root / "Local/node1")
    for glob, want in ((4, place1[1]), (5, place2[1])):
        found = _recover(dirs, config, glob, want, comm="global")
        assert (found.level, found.ckpt_id, found.rebuilt) == (3, 1, True)
        assert found.path == _local(root, 1, 3) / f"Ckpt1-Rank{glob}.fti" and found.path.read_bytes() == want
    assert _recover(dirs, config, 4, _l1_bytes(7), comm="app").level == 1  # app 4 = global 7, on node 2
    assert not (_local(root, 1, 3) / "Ckpt1-RSed4.fti").exists()  # parity is not rebuilt, as FTI does not


def test_the_largest_file_of_the_oracles_group_rebuilt_with_heads(tmp_path, dirs):
    """Global rank 7 (node 2, place 1) holds the oracle's odd-sized largest file (3001 bytes = maxFs): rebuilt
    exactly, its last byte found from its MD5, with another file of its group lost too."""
    root = tmp_path / "fti"
    config = _config(root, 4)
    place1 = _l3_group(root, 1, 1)
    _l3_group(root, 1, 2)
    (_local(root, 2, 3) / "Ckpt1-Rank7.fti").unlink()
    (_local(root, 0, 3) / "Ckpt1-RSed1.fti").unlink()
    found = _recover(dirs, config, 4, place1[2], comm="app")
    assert found.rebuilt and found.path.name == "Ckpt1-Rank7.fti"


def test_too_many_losses_in_one_place_leave_the_other_place_whole(tmp_path, dirs):
    """Place 2's group loses 5 of its 8 files: its ranks cannot be rebuilt (clear error, nothing written); place 1's
    group is another group (its own parity) and still rebuilds."""
    root = tmp_path / "fti"
    config = _config(root, 4)
    place1 = _l3_group(root, 1, 1)
    _l3_group(root, 1, 2)
    for node in (0, 1, 2):
        (_local(root, node, 3) / f"Ckpt1-Rank{node * 3 + 2}.fti").unlink()
    for node in (0, 3):
        (_local(root, node, 3) / f"Ckpt1-RSed{node * 3 + 2}.fti").unlink()
    (_local(root, 1, 3) / "Ckpt1-Rank4.fti").unlink()
    with pytest.raises(NoCheckpointError, match="5 of the group's 8 files are lost"):
        _recover(dirs, config, 5, _place2_files()[1], comm="global")
    assert not (_local(root, 1, 3) / "Ckpt1-Rank5.fti").exists()
    assert _recover(dirs, config, 4, place1[1], comm="global").rebuilt


def _flushed_posix(root: Path, ckpt: int, nodes: int) -> None:
    """Level 4 flushed by the heads (inline_l4 = 0, FTI_FlushPosix): the local files copied as they are, same names;
    FTI_PostCkpt then renames the local directory to level 1's and the meta directory to level 4's only."""
    _l1(root, ckpt, nodes)
    shutil.move(root / f"Meta/{EXEC}/l1", root / f"Meta/{EXEC}/l4")
    l4 = root / f"Global/{EXEC}/l4"
    l4.mkdir(parents=True)
    for node in range(nodes):
        for path in _local(root, node, 1).iterdir():
            shutil.copyfile(path, l4 / path.name)


def test_level_4_flushed_by_the_heads_posix(tmp_path, dirs):
    """Level 1's copies have no meta file (refused, as FTI's own level 1 fails), level 4's are read, each rank's."""
    root = tmp_path / "fti"
    config = _config(root, 2)
    _flushed_posix(root, 3, 2)
    for app, glob in enumerate((1, 2, 4, 5)):
        found = _recover(dirs, config, app, _l1_bytes(glob), comm="app")
        assert (found.level, found.path.name) == (4, f"Ckpt3-Rank{glob}.fti")


def _part(rank: int) -> bytes:
    """Rank ``rank``'s local file for the MPI-IO test: sizes differ (a real prefix sum), ranks 4 and 5 alike."""
    size = {1: 1000, 2: 1300}.get(rank, 1700)
    return np.random.default_rng(200 + rank).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_level_4_flushed_by_the_heads_mpiio(tmp_path, dirs):
    """ckpt_io = 2, inline_l4 = 0: FTI_FlushMPI, run by the heads on their FTI_COMM_WORLD, puts each application
    process's local file at the sum of the sizes before it in node order ((node_size - 1) * nodeID + proc - 1),
    which is FTI_COMM_WORLD's order: the inline writer's layout. Each rank's part is found and verified."""
    root = tmp_path / "fti"
    config = _config(root, 2, ckpt_io=2)
    ranks = (1, 2, 4, 5)
    for place in (1, 2):
        members = [node * NODE_SIZE + place for node in range(2)]
        sections = [_section(f"Ckpt6-Rank{r}.fti", _part(r), max(len(_part(m)) for m in members)) for r in members]
        _write_meta(root / f"Meta/{EXEC}/l4/sector0-group{place}.fti", sections)
    for rank in ranks:  # the local files, kept as level 1 without a meta file
        folder = _local(root, rank // NODE_SIZE, 1)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"Ckpt6-Rank{rank}.fti").write_bytes(_part(rank))
    shared = root / f"Global/{EXEC}/l4/Ckpt6-mpiio.fti"
    shared.parent.mkdir(parents=True)
    shared.write_bytes(b"".join(_part(r) for r in ranks))
    for app, glob in enumerate(ranks):
        found = _recover(dirs, config, app, _part(glob), comm="app")
        assert (found.level, found.path, found.rank) == (4, shared, glob)
    shared.write_bytes(b"".join(_part(r) for r in (1, 2, 5, 4)))  # parts of 4 and 5 (same size) swapped
    with pytest.raises(NoCheckpointError, match="MD5 does not match"):
        _recover(dirs, config, 5, _part(5), comm="global")


def test_level_2_copies_made_by_the_heads_are_read_for_a_lost_node(tmp_path, dirs):
    """inline_l2 = 0: node 0's head receives, place by place, node 1's files (its left in the ring of 2 nodes) and
    names each copy after the process at the same place on node 0 (FTI_RecvPtner): Pcof1 holds global rank 4's
    bytes, Pcof2 rank 5's; each is read with its left neighbour's section of its place's meta file."""
    root = tmp_path / "fti"
    config = _config(root, 2)
    _l1(root, 4, 2)
    shutil.move(root / f"Meta/{EXEC}/l1", root / f"Meta/{EXEC}/l2")
    for node in range(2):
        shutil.move(_local(root, node, 1), _local(root, node, 2))
        for place in (1, 2):
            keeper, kept = node * NODE_SIZE + place, (1 - node) * NODE_SIZE + place
            (_local(root, node, 2) / f"Ckpt4-Pcof{keeper}.fti").write_bytes(_l1_bytes(kept))
    shutil.rmtree(root / "Local/node1")
    for app, glob, keeper in ((2, 4, 1), (3, 5, 2)):
        found = _recover(dirs, config, app, _l1_bytes(glob), comm="app")
        assert (found.level, found.path) == (2, _local(root, 0, 2) / f"Ckpt4-Pcof{keeper}.fti")
    assert _recover(dirs, config, 2, _l1_bytes(2), comm="global").path.name == "Ckpt4-Rank2.fti"


def test_a_partner_copy_of_another_rank_is_refused(tmp_path, dirs):
    """If the processes were not placed node by node (hosts, not local_test), the copy kept as Pcof1 may be another
    process's: here the meta file says node 1's place-1 process is global rank 7 and Pcof1 holds its bytes (same
    sizes as rank 4's, verifying). Rank 4 must not get them: refused, saying whose copy it is."""
    root = tmp_path / "fti"
    config = _config(root, 2)
    sections = [_section(f"Ckpt4-Rank{r}.fti", _l1_bytes(r), 1800) for r in (1, 7)]
    _write_meta(root / f"Meta/{EXEC}/l2/sector0-group1.fti", sections)
    _local(root, 0, 2).mkdir(parents=True)
    (_local(root, 0, 2) / "Ckpt4-Pcof1.fti").write_bytes(_l1_bytes(7))
    with pytest.raises(NoCheckpointError, match="this copy holds Ckpt4-Rank7.fti .* not Ckpt4-Rank4.fti"):
        _recover(dirs, config, 4, _l1_bytes(4), comm="global")


def test_an_fti_ff_group_encoded_by_the_heads(tmp_path, dirs):
    """ckpt_io = 3: the oracle's FTI-FF group at place 1 of 4 nodes (global ranks 1, 4, 7, 10), parity files with
    FTI_RSenc's record; node 2 lost whole: global rank 7 (FTI_COMM_WORLD 4) rebuilt from the other nodes' files."""
    root = tmp_path / "fti"
    config = _config(root, 4, ckpt_io=3)
    data = L3_DATA.parent / "ftiff"
    for node in range(4):
        rank, raw = node * NODE_SIZE + 1, (data / f"Ckpt1-Rank{node}.fti").read_bytes()
        _local(root, node, 3).mkdir(parents=True)
        (_local(root, node, 3) / f"Ckpt1-Rank{rank}.fti").write_bytes(raw)
        (_local(root, node, 3) / f"Ckpt1-RSed{rank}.fti").write_bytes(
            fti_rsed_file((data / f"parity{node}.bin").read_bytes(), len(raw)))
    shutil.rmtree(root / "Local/node2")
    spec = importlib.util.spec_from_file_location("fti_l3_inputs", L3_DATA.parent / "make_inputs.py")
    inputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inputs)
    want = inputs.ftiff_vars(2)
    ctx = ftidask.init(**dirs)
    arrays = {vid: np.zeros(len(raw), "u1") for vid, raw in want.items()}
    for vid, array in arrays.items():
        ctx.protect(vid, array)
    found = recover_fti_run(ctx, config, 4, comm="app")
    ctx.finalize()
    assert found.rebuilt and found.path == _local(root, 2, 3) / "Ckpt1-Rank7.fti"
    assert found.path.read_bytes() == (data / "Ckpt1-Rank2.fti").read_bytes()
    assert {vid: a.tobytes() for vid, a in arrays.items()} == want
