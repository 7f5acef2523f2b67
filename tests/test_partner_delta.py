"""L2 for differential files: partners rebuild the new copy from their spare and the changed ranges.

The group channel here connects threads of one process through queues: the same interface
the MPI backend provides with a sub-communicator (real mpiexec tests belong to that backend).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ftidask.dcp.files import write_dcp_file
from ftidask.ftiff.layout import plan_layout
from ftidask.ftiff.reader import parse_ftiff, verify_data
from ftidask.levels.partner_delta import protect
from ftidask.model.arrays import ArrayBytes, VarInfo


class ThreadGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
        self.sent_bytes = [0] * size


class ThreadChannel:
    def __init__(self, group: ThreadGroup, index: int) -> None:
        self.group, self.index, self.size = group, index, group.size

    def allgather(self, value):
        self.group.barrier.wait()
        self.group.slots[self.index] = value
        self.group.barrier.wait()
        out = list(self.group.slots)
        self.group.barrier.wait()
        return out

    def exchange(self, send, dest, recv_nbytes, source):
        if send is not None:
            self.group.sent_bytes[self.index] += len(send)
            self.group.queues[self.index, dest].put(np.array(send, copy=True))
        if source is None:
            return None
        got = self.group.queues[source, self.index].get(timeout=30)
        assert len(got) == recv_nbytes
        return got


def _write(path: Path, arrays, base, pool):
    layout = plan_layout(None, [(vid, a.nbytes) for vid, a in arrays.items()])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        infos = [VarInfo.of(vid, f"v{vid}", a) for vid, a in arrays.items()]
        _w, stats, state = write_dcp_file(fd, layout, {vid: ArrayBytes(a) for vid, a in arrays.items()}, infos,
                                          {"format": "ftidask"}, base, block_size=4096, bid=4, hash_id=2, pool=pool)
    finally:
        os.close(fd)
    return stats, state


@pytest.mark.parametrize("missing_spare", [None, 1])
def test_partners_patch_their_spares(tmp_path, missing_spare):
    size, pool = 3, ThreadPoolExecutor(2)
    rng = np.random.default_rng(0)
    members = []
    for i in range(size):
        d = tmp_path / f"node{i}"
        d.mkdir()
        arrays = {1: rng.random(100_000), 2: rng.integers(0, 9, 30_000).astype(np.int32)}
        base_file = d / "base.fti"
        _stats, state = _write(base_file, arrays, None, pool)
        members.append((d, arrays, base_file, state))
    deltas, owns = [], []
    for i, (d, arrays, base_file, state) in enumerate(members):
        # The right member keeps a copy of this member's base as its spare partner copy.
        right = members[(i + 1) % size][0]
        if missing_spare != (i + 1) % size:
            shutil.copyfile(base_file, right / "spare_pcof.fti")
        arrays[1][rng.integers(0, 100_000, 20)] = -1.0
        own = d / "own.fti"
        shutil.copyfile(base_file, own)
        stats, _state = _write(own, arrays, state, pool)
        assert stats.delta is not None and stats.delta.nbytes < own.stat().st_size // 5
        deltas.append(stats.delta)
        owns.append(own)
    group = ThreadGroup(size)

    def run(i):
        ch = ThreadChannel(group, i)
        return protect(ch, owns[i], members[i][0] / "pcof.fti", members[i][0] / "spare_pcof.fti",
                       owns[i].stat().st_size, deltas[i], 8192)

    with ThreadPoolExecutor(size) as ex:
        errors = list(ex.map(run, range(size)))
    assert errors == [""] * size
    for i in range(size):
        left = (i - 1) % size
        pcof = members[i][0] / "pcof.fti"
        with open(pcof, "rb") as fh, open(owns[left], "rb") as want:
            parsed = parse_ftiff(fh, str(pcof))
            verify_data(fh, parsed)
            assert parsed.fb.hash == parse_ftiff(want, str(owns[left])).fb.hash
        full = missing_spare == i  # that member had no spare: the whole file came
        sent = group.sent_bytes[left]
        assert (sent == owns[left].stat().st_size) if full else (sent == deltas[left].nbytes)
    pool.shutdown()
