"""A Dask restart and the redundancy beside sound own files, on a real LocalCluster (real files erased).

FTI's ckpt_consistency case: partner copies (or parity files) erased, restart, crash again, every own file
erased, restart: the first restart must have rebuilt the redundancy. A restart with nothing missing only
stats the redundancy files (an audit hook in every worker sees each file opened); redundancy damaged in
place (right size, bytes changed) is left to the next checkpoint, as on the MPI backend.
"""

import json
import logging
import os
import sys
from pathlib import Path

import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_backend import assert_same, make_array  # noqa: E402

import ftidask  # noqa: E402

# 240 s, as test_dask_backend.py: the timeout counts the shared cluster fixture's setup (closing a cluster of another
# size, up to 60 s; waiting for the new workers, up to 60 s), which a loaded machine can take most of 120 s for.
pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]
NWORKERS = 4  # one L2 ring / L3 group of four workers (group_size 4)

_OPENED: list[list[str]] = []  # in a worker: every file opened while a list is installed (all threads)


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _OPENED and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # in every process that imports this module: the workers too (client.run below)


def _watch() -> None:
    _OPENED.append([])


def _opened() -> list[str]:
    return _OPENED.pop() if _OPENED else []


@pytest.fixture
def client(dask_client):
    return dask_client  # the shared cluster of test_dask_backend (conftest.py)


def checkpoint(client, dirs, level):
    """The newest checkpoint at ``level`` (L6/L7: the second of two differential ones); its id and the arrays."""
    ctx = ftidask.init(client=client, **dirs, **({"enable_dcp": 1, "dcp_block_size": 1024} if level > 4 else {}))
    ctx.protect(1, make_array(), name="field")
    ckpt_id = 1
    ctx.checkpoint(ckpt_id, level)
    if level > 4:  # a second one, which sends its partners only the changed ranges or updates the parity
        ctx.protect(1, ctx.protected[1] + 1)
        ckpt_id = 2
        ctx.checkpoint(ckpt_id, level)
    return ckpt_id, {1: ctx.protected[1].compute()}


def files(dirs, ckpt_id, kind):
    found = sorted(Path(dirs["ckpt_dir"]).glob(f"node*/*/l*/ckpt{ckpt_id}.s*/Ckpt{ckpt_id}-{kind}*"))
    return [p for p in found if p.is_file()]


def recover(client, dirs, level):
    """A restart: a new context recovers the newest checkpoint (its info lines logged: verbosity 2)."""
    ctx = ftidask.init(client=client, **dirs | {"verbosity": 2}, **({"enable_dcp": 1} if level > 4 else {}))
    ctx.protect(1, make_array(9))
    out = ctx.recover()
    return ctx, out


@pytest.mark.parametrize(("level", "damage"), [(2, "erased"), (2, "truncated"), (3, "erased"), (3, "truncated"),
                                               (3, "unrecorded"), (6, "erased"), (7, "erased")])
def test_missing_redundancy_is_rebuilt_at_restart(client, dirs, level, damage, caplog):
    """Every partner copy or parity erased, truncated or without its ``.hash`` record: the restart recovers from
    the own files and rebuilds it, the same bytes as the checkpoint wrote; then every own file erased: the next
    restart recovers from the rebuilt redundancy."""
    ckpt_id, saved = checkpoint(client, dirs, level)
    base = (level - 1) % 4 + 1
    red = files(dirs, ckpt_id, "Pcof" if base == 2 else "RSed")
    assert len(red) == NWORKERS * (1 if base == 2 else 2)  # L3: each parity and its .hash record
    before = {p: p.read_bytes() for p in red}
    for path in red:
        if damage == "erased" or (damage == "unrecorded" and path.suffix == ".hash"):
            path.unlink()
        elif damage == "truncated" and path.suffix == ".fti":
            os.truncate(path, path.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="ftidask"):
        ctx, out = recover(client, dirs, level)
    assert_same(out, saved)
    assert ctx.recovered_from == (ckpt_id, base)  # a differential checkpoint's base level
    assert f"rebuilt the missing {'partner copies' if base == 2 else 'parity files'} of rank(s) [0, 1, 2, 3]" \
        in caplog.text
    for path in red:
        if path.suffix == ".hash":  # a re-encoded parity's record names no fb_hashes
            got, was = json.loads(path.read_text()), json.loads(before[path])
            assert (got["hash"], got["size"]) == (was["hash"], was["size"])
        else:
            assert path.read_bytes() == before[path], path.name
    own = files(dirs, ckpt_id, "Rank")
    assert len(own) == NWORKERS
    for path in own:  # a second failure: every own file lost (the group's redundancy alone brings them back)
        path.unlink()
    ctx, out = recover(client, dirs, level)
    assert_same(out, saved)
    assert ctx.recovered_from == (ckpt_id, base)


@pytest.mark.parametrize("level", [2, 3])
def test_nothing_missing_opens_no_redundancy_file(client, dirs, level):
    """Every partner copy or parity damaged in place (sizes kept, records there), every own file sound: the
    restart recovers from the own files, opens no redundancy file and rewrites nothing (the next checkpoint at
    that level does)."""
    ckpt_id, saved = checkpoint(client, dirs, level)
    red = files(dirs, ckpt_id, "Pcof" if level == 2 else "RSed")
    for path in red:
        if path.suffix == ".fti":
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0x5A
            path.write_bytes(bytes(raw))
    before = {p: p.read_bytes() for p in red}
    client.run(_watch)
    try:
        ctx, out = recover(client, dirs, level)
        assert_same(out, saved)
    finally:
        opened = [p for got in client.run(_opened).values() for p in got]
    assert ctx.recovered_from == (ckpt_id, level)
    assert any("-Rank" in p for p in opened)  # the hook sees the workers' reads
    assert [p for p in opened if "Pcof" in p or "RSed" in p] == []
    assert all(p.read_bytes() == b for p, b in before.items())


def test_one_restart_rebuilds_a_lost_file_and_another_groups_partner_copies(client, dirs):
    """Two L2 rings of two workers: rank 0's own file lost, the other ring's partner copies erased. The restart
    rebuilds both (every group that lost something takes part), so that the other ring's own files can go next."""
    ctx = ftidask.init(client=client, **dirs, group_size=2)
    ctx.protect(1, make_array(), name="field")
    ctx.checkpoint(1, 2)
    saved = {1: ctx.protected[1].compute()}
    groups = ctx.state.records()[-1].extra["groups"]
    assert groups == [[0, 1], [2, 3]]
    own, pcof = files(dirs, 1, "Rank"), files(dirs, 1, "Pcof")
    own[0].unlink()
    for path in pcof[2:]:
        path.unlink()
    ctx, out = recover(client, dirs, 2)
    assert_same(out, saved)
    assert all(p.is_file() for p in own + pcof)
    for path in own[2:]:
        path.unlink()
    ctx, out = recover(client, dirs, 2)
    assert_same(out, saved)
    assert ctx.recovered_from == (1, 2)
