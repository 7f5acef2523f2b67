"""A chunk read back from an L3 checkpoint whose own rank file is damaged (there, bytes changed: a container hash
fails) is read from the file rebuilt from its group's parity, as ``recover()`` rebuilds it, on a real LocalCluster of
worker processes: both for the arrays whose lineage a checkpoint cut and for those ``recover()`` returned. Before,
such a read stopped at the hash mismatch although the group's parity could rebuild the file.
"""

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from test_dask_lineage import CHUNKS, NWORKERS, flip_each_chunk, initial, kill_rank  # noqa: E402, F401

import ftidask  # noqa: E402
from ftidask.backends.dask import lineage, reads, recorded  # noqa: E402
from ftidask.backends.dask.restore import file_sources  # noqa: E402
from ftidask.storage.files import find_paths  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(420)]
RANK = 1  # the rank whose file is damaged and whose worker is killed (one L3 group of the 4 workers)


@pytest.fixture
def client(dask_client):
    return dask_client


def l3_file(ctx, name: str, rank: int) -> Path:
    return next(Path(ctx.config.ckpt_dir).glob(f"node{rank}/*/l3/ckpt1.*/{name}"))


def flip_middle(path: Path) -> None:
    """Flip one bit in the middle of a file that is not FTI-FF (a parity), its size unchanged."""
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))


def checkpoint_l3(client, dirs, recovered: bool):
    """An L3 checkpoint of :func:`initial`; the array that reads it back if a chunk is lost (the cut array, or the
    one ``recover()`` returns in a second context), and the contexts to finalize."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 3)
    if not recovered:
        return ctx, ctx.protected[1], [ctx]
    ctx2 = ftidask.init(client=client, **dirs)
    return ctx, ctx2.recover()[1], [ctx2, ctx]


def damage(ctx, own: bool = True, data=(), parity=(), erase=()) -> None:
    """Flip a bit in each chunk of rank RANK's own file, in those of the data files of ``data``, in the middle of the
    parity files of ``parity``; erase the parity files of ``erase``."""
    for r in ([RANK] if own else []) + list(data):
        flip_each_chunk(l3_file(ctx, f"Ckpt1-Rank{r}.fti", r))
    for r in parity:
        flip_middle(l3_file(ctx, f"Ckpt1-RSed{r}.fti", r))
    for r in erase:
        os.unlink(l3_file(ctx, f"Ckpt1-RSed{r}.fti", r))


@pytest.mark.parametrize("recovered", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_damaged_own_file_is_rebuilt_from_parity(client, dirs, recovered):
    """The own file of the rank whose worker dies is damaged in place, and so is another data file of its group
    (it differs from the whole-file hash the parity records keep: no decoding input, a parity is used instead): the
    lost chunks come back bit for bit from the file rebuilt in place of the damaged one, which is the checkpointed
    file again, byte for byte."""
    ctx, y, contexts = checkpoint_l3(client, dirs, recovered)
    own = l3_file(ctx, f"Ckpt1-Rank{RANK}.fti", RANK)
    sound = own.read_bytes()
    damage(ctx, data=[2])
    assert own.read_bytes() != sound
    kill_rank(client, ctx, RANK, erase=False, replaced=False)
    assert client.compute(y).result(timeout=60).tobytes() == initial().compute().tobytes()
    assert own.read_bytes() == sound  # replaced by the rebuilt file (renamed over it: no temporary file left)
    assert not [p.name for p in own.parent.iterdir() if ".tmp-" in p.name]
    if not recovered:
        events = [e for e in lineage.restores(client, ctx.exec_id) if e["ckpt_id"] == 1]
        assert events and {e["how"] for e in events} <= {"rebuilt from the group's parity", "its file"}
        assert "rebuilt from the group's parity" in {e["how"] for e in events}
    del y
    for c in contexts:
        c.finalize()


@pytest.mark.parametrize("recovered", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_damaged_own_file_beyond_the_parity_fails_cleanly(client, dirs, recovered):
    """Own file damaged, two more data files damaged, a parity damaged and one erased: 3 of the 7 other files verify,
    4 are needed. The read fails with a RecoveryError naming the checkpoint and the rank, never with wrong data, and
    the damaged file is left as it was (no unverified file in its place)."""
    ctx, y, contexts = checkpoint_l3(client, dirs, recovered)
    damage(ctx, data=[0, 2], parity=[0], erase=[3])
    own = l3_file(ctx, f"Ckpt1-Rank{RANK}.fti", RANK)
    damaged = own.read_bytes()
    kill_rank(client, ctx, RANK, erase=False, replaced=False)
    with pytest.raises(ftidask.RecoveryError,
                       match=rf"checkpoint 1 \(level 3\): the file of rank {RANK} cannot be rebuilt from its group's "
                             r"parity: 3 of the 7 other files verify, 4 are needed"):
        client.compute(y).result(timeout=60)
    assert own.read_bytes() == damaged
    assert not [p.name for p in own.parent.iterdir() if ".tmp-" in p.name]
    del y
    for c in contexts:
        c.finalize()


def test_concurrent_reads_of_a_damaged_file_rebuild_it_once(client, dirs, caplog):
    """Every chunk of the damaged file read at once by threads of one process (as a worker's threads do): the file is
    rebuilt once (the reads waiting meanwhile read the rebuilt file), each chunk bit for bit."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 3)
    record = ctx.state.records()[-1]
    lay = recorded.layout(record)
    hosts = {r: (lay.workers[r], str(l3_file(ctx, f"Ckpt1-Rank{r}.fti", r))) for r in range(record.nranks)}
    src = file_sources(ctx, record, hosts)[RANK]
    mine = [at for at in lay.chunks[1] if at.rank == RANK]
    assert len(mine) >= 2
    damage(ctx)
    want = initial().compute()

    def read(at):
        return reads.read_lineage_chunk(src, 1, "field", list(at.index), at.dptr, lay.raw_dtypes[1], list(CHUNKS))

    with caplog.at_level(logging.INFO, logger="ftidask"), ThreadPoolExecutor(len(mine)) as pool:
        got = list(pool.map(read, mine))
    for at, chunk in zip(mine, got):
        i, j = at.index
        assert chunk.tobytes() == want[i * CHUNKS[0]:(i + 1) * CHUNKS[0], j * CHUNKS[1]:(j + 1) * CHUNKS[1]].tobytes()
    rebuilt = [r.getMessage() for r in caplog.records if "rebuilt from its group's parity" in r.getMessage()]
    assert rebuilt == [f"checkpoint 1: the damaged file of rank {RANK} rebuilt from its group's parity"]
    ctx.finalize()


def _lose_inputs_mid_rebuild(monkeypatch, ctx, ranks):
    """Each decode of the rebuild first loses the node of the next rank of ``ranks`` whose data file is one of its
    inputs (its directory erased, as a second node lost while the first is being rebuilt): the inputs read then are
    gone. The ranks lost, in order."""
    real, lost = reads.decode_files, []

    def decode_losing_a_node(data, parity, sizes, out):
        for r in ranks:
            if r not in lost and any(p is not None and p.endswith(f"Ckpt1-Rank{r}.fti") for p in data):
                shutil.rmtree(Path(ctx.config.ckpt_dir) / f"node{r}")
                lost.append(r)
                break
        return real(data, parity, sizes, out)

    monkeypatch.setattr(reads, "decode_files", decode_losing_a_node)
    return lost


def _lineage_reads(ctx):
    """The rank RANK's chunks of the checkpointed array, and a function reading one back as a lineage read does."""
    record = ctx.state.records()[-1]
    lay = recorded.layout(record)
    hosts = {r: (lay.workers[r], str(l3_file(ctx, f"Ckpt1-Rank{r}.fti", r))) for r in range(record.nranks)}
    src = file_sources(ctx, record, hosts)[RANK]

    def read(at):
        return reads.read_lineage_chunk(src, 1, "field", list(at.index), at.dptr, lay.raw_dtypes[1], list(CHUNKS))

    return [at for at in lay.chunks[1] if at.rank == RANK], read


def test_a_node_lost_while_a_file_is_rebuilt_leaves_the_rebuild_to_the_others(client, dirs, monkeypatch):
    """Rank RANK's node is lost; while its file is being rebuilt from parity, the node of one of the rebuild's
    inputs is lost too (the CI failure of test_two_workers_lost_where_the_level_survives[3]): the rebuild chooses
    again among the files left (half the group is still there) and every chunk comes back bit for bit."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 3)
    mine, read = _lineage_reads(ctx)
    shutil.rmtree(Path(ctx.config.ckpt_dir) / f"node{RANK}")
    lost = _lose_inputs_mid_rebuild(monkeypatch, ctx, [next(r for r in range(NWORKERS) if r != RANK)])
    want = initial().compute()
    for at in mine:
        i, j = at.index
        part = want[i * CHUNKS[0]:(i + 1) * CHUNKS[0], j * CHUNKS[1]:(j + 1) * CHUNKS[1]]
        assert read(at).tobytes() == part.tobytes()
    assert len(lost) == 1
    ctx.finalize()


def test_nodes_lost_while_a_file_is_rebuilt_beyond_the_parity_fail_cleanly(client, dirs, monkeypatch):
    """Every other data file's node lost one after the other while the file is being rebuilt: once fewer than half the
    group is left the read fails naming the chunk and what is missing, with no temporary file left behind."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 3)
    mine, read = _lineage_reads(ctx)
    shutil.rmtree(Path(ctx.config.ckpt_dir) / f"node{RANK}")
    lost = _lose_inputs_mid_rebuild(monkeypatch, ctx, [r for r in range(NWORKERS) if r != RANK])
    with pytest.raises(ftidask.RecoveryError, match=r"chunk \(\d+, \d+\) of variable 1 \(field\) was lost with its "
                                                    r"worker and cannot be restored from checkpoint 1 \(level 3\).*"
                                                    r"2 of the 7 other files verify, 4 are needed"):
        read(mine[0])
    assert lost  # the rebuild was tried
    own = Path(ctx.config.ckpt_dir) / f"node{RANK}"
    assert not [p.name for p in find_paths(own, "*") if ".tmp-" in p.name]
    ctx.finalize()


def test_a_node_lost_while_its_file_is_read_rebuilds_it_from_parity(client, dirs, monkeypatch):
    """Rank RANK's file is found, then its node is lost before the chunk is read from it (its directory erased between
    the look and the read, as a node lost while a surviving worker reads its file): the file is rebuilt from its
    group's parity as a missing one, and every chunk comes back bit for bit. (Before, the read failed with a
    RecoveryError: the vanished file was taken for one rebuilt meanwhile and read again.)"""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, initial(), name="field")
    ctx.checkpoint(1, 3)
    mine, read = _lineage_reads(ctx)
    node, real, lost = Path(ctx.config.ckpt_dir) / f"node{RANK}", reads.tasks.read_chunk, []

    def read_after_losing_the_node(path, *args, **kwargs):
        if not lost and path.endswith(f"Ckpt1-Rank{RANK}.fti"):
            shutil.rmtree(node)
            lost.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reads.tasks, "read_chunk", read_after_losing_the_node)
    want = initial().compute()
    with ThreadPoolExecutor(1) as pool:  # (read on another thread, as a worker's task is)
        got = [pool.submit(read, at).result() for at in mine]
    assert lost
    for at, chunk in zip(mine, got):
        i, j = at.index
        assert chunk.tobytes() == want[i * CHUNKS[0]:(i + 1) * CHUNKS[0], j * CHUNKS[1]:(j + 1) * CHUNKS[1]].tobytes()
    assert Path(lost[0]).exists()  # rebuilt in its place
    assert not [p.name for p in find_paths(node, "*") if ".tmp-" in p.name]
    ctx.finalize()
