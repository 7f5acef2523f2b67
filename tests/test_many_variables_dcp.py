"""Differential checkpoints (levels 5-8) of thousands of small variables: each variable's containers came from a
scan of the whole layout (twice per variable: 27 s a checkpoint of 10,000), and each small variable's hashing took
a round trip through the thread pool. The blocks written and the values recovered must stay exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ftidask

N = 2500
BLOCK = 512


def _state() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 2**63, 16 + 97 * (i % 5), dtype=np.int64) for i in range(N)]  # 1 to 4 blocks


@pytest.mark.parametrize("level", [5, 8])
def test_thousands_of_variables_differential_round_trip(dirs, level):
    data = _state()
    first_set, second_set = list(range(3, N, 13)), list(range(5, N, 17))
    with ftidask.init(**dirs, enable_dcp=1, dcp_block_size=BLOCK) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        total = sum(-(-a.nbytes // BLOCK) for a in data)
        for ckpt_id in (1, 2):  # two files in turn (the previous one kept as the spare): both written whole
            info = ctx.checkpoint(ckpt_id, level)
            assert info.blocks_changed == info.blocks_total == total
        for i in first_set:  # the last block of each
            data[i][-1] += 1
        info = ctx.checkpoint(3, level)  # against checkpoint 1's file
        assert (info.blocks_changed, info.blocks_total) == (len(first_set), total)
        for i in second_set:
            data[i][0] += 1
        info = ctx.checkpoint(4, level)  # against checkpoint 2's file: both sets
        last = {i: -(-data[i].nbytes // BLOCK) - 1 for i in first_set}
        blocks = {(i, last[i]) for i in first_set} | {(i, 0) for i in second_set}
        assert (info.blocks_changed, info.blocks_total) == (len(blocks), total)
        ctx._close()
    ctx = ftidask.init(**dirs, enable_dcp=1, dcp_block_size=BLOCK)
    out = [np.zeros_like(a) for a in data]
    for i, a in enumerate(out):
        ctx.protect(i, a)
    ctx.recover()
    assert ctx.recovered_from[0] == 4
    assert all(a.tobytes() == b.tobytes() for a, b in zip(out, data))
    ctx.finalize()


def test_each_of_thousands_of_containers_of_a_differential_file_read_alone(dirs):
    """A Dask worker's read of one chunk of a differential file (tasks.read_chunk): its container's block digests
    only, found in an index of the parsed file (the whole block-hash section was read and checked, and the
    container looked for among all, per chunk). Every chunk comes back exact; a damaged block is named."""
    from ftidask.backends.dask import tasks
    from ftidask.ftiff import reader
    from ftidask.model.arrays import dtype_to_json
    from ftidask.storage.files import find_paths

    data = _state()
    with ftidask.init(**dirs, enable_dcp=1, dcp_block_size=BLOCK) as ctx:
        for i, a in enumerate(data):
            ctx.protect(i, a)
        ctx.checkpoint(1, 5)
        ctx._close()
    path = str(next(iter(find_paths(Path(dirs["ckpt_dir"]), "Ckpt1-Rank0.fti"))))
    with open(path, "rb") as fh:
        parsed = reader.parse_ftiff(fh, path)
    fb_hash = parsed.fb.hash.hex()
    got = [tasks.read_chunk(path, i, 0, dtype_to_json(a.dtype), list(a.shape), fb_hash) for i, a in enumerate(data)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, data))
    meta = next(m for _b, _c, m in parsed.containers() if m.id == 1234)
    with open(path, "r+b") as fh:  # a byte of its second block
        fh.seek(meta.fptr + BLOCK + 3)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ftidask.FormatError, match=r"var id 1234\): data block 1 does not match"):
        tasks.read_chunk(path, 1234, 0, dtype_to_json(data[1234].dtype), list(data[1234].shape), fb_hash)
    assert tasks.read_chunk(path, 1233, 0, dtype_to_json(data[1233].dtype), list(data[1233].shape),
                            fb_hash).tobytes() == data[1233].tobytes()
