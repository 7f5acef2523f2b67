"""A Dask restart reads each byte of its files once (issue 16: restart reads each byte once).

The search checks each file's metadata only and the reads check every chunk's hash; a chunk that fails its
check when read sends the recovery back to check that checkpoint's files in full, before any array is
filled or rebound: the damaged file is then rebuilt from L2/L3, or the checkpoint passed over. The bytes
that pass are counted in every worker process: those read (``rchar``: what read and pread returned) and
those a full check hashes through a map of the file (counted around ``verify_data``, which reads no byte).
"""

import logging
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from test_dask_compression import _files, _flip_in_container  # noqa: E402

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.timeout(180)]
NWORKERS = 4  # one L2 ring / L3 group of four workers (the cluster of the other Dask tests)


@pytest.fixture
def client(dask_client):
    return dask_client


_CHECKED = [0]  # in a worker: bytes that the full checks of files hashed (through a map: no read counted)


def _count_checks(on: bool) -> None:
    from ftidask.backends.dask import tasks

    real = getattr(tasks.verify_data, "real", tasks.verify_data)
    if not on:
        tasks.verify_data = real
        return

    def counting(fh, parsed, only=None):
        _CHECKED[0] += sum(m.chunksize for _b, _c, m in parsed.containers() if m.hascontent)
        return real(fh, parsed, only)

    counting.real = real
    tasks.verify_data = counting


def _passed() -> int:
    """Bytes of files read (``rchar``: read and pread; sockets are received with recv) or fully checked."""
    with open("/proc/self/io") as fh:
        return _CHECKED[0] + next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


@pytest.fixture
def counted(client):
    client.run(_count_checks, True)
    yield
    client.run(_count_checks, False)


def _field(seed=0):
    return da.random.default_rng(seed).random((1024, 1024), chunks=(128, 512))  # 8 MiB in 16 chunks


def _restart(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, da.zeros((1024, 1024), chunks=(128, 512)))
    return ctx


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_restart_reads_each_byte_once(client, dirs, level, counted):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, _field())
    ctx.checkpoint(1, level)
    saved = ctx.protected[1].compute()
    ctx._close()  # as a job that ends: the checkpoint stays
    stored = sum(p.stat().st_size for p in _files(dirs, level))
    assert stored > saved.nbytes
    warm = _restart(client, dirs)  # the workers import what a recovery needs (module files are read too)
    del warm.recover()[1]
    warm._close()
    restart = _restart(client, dirs)
    before = client.run(_passed)
    out = restart.recover()[1]
    read = sum(client.run(_passed)[w] - before[w] for w in before)
    assert out.compute().tobytes() == saved.tobytes()
    # Each own file once (its metadata twice: the search's check, then each read's parse), no partner copy or
    # parity; a check of every byte before the reads made it twice the files.
    assert stored <= read < 1.3 * stored, (read, stored)
    restart._close()


def test_damaged_data_found_by_a_read_goes_back_to_the_older_checkpoint(client, dirs, caplog):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, _field(1))
    ctx.checkpoint(1, 4)
    older = ctx.protected[1].compute()
    ctx.protect(1, ctx.protected[1] + 1)
    ctx.checkpoint(2, 1)
    ctx._close()
    _flip_in_container(_files(dirs, 1), 1, 2)
    restart = _restart(client, dirs)
    held = restart.protected[1]
    with caplog.at_level(logging.WARNING, logger="ftidask"):
        out = restart.recover()
    assert "checking every file of it in full" in caplog.text and "hash does not match" in caplog.text
    assert restart.recovered_from == (1, 4)
    assert out[1].compute().tobytes() == older.tobytes()
    assert held is not restart.protected[1]  # rebound once, to the older checkpoint's array
    restart._close()


def test_damaged_data_and_no_older_checkpoint_touches_nothing(client, dirs):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, _field(2))
    ctx.checkpoint(1, 1)
    ctx._close()
    _flip_in_container(_files(dirs, 1), 1)
    restart = _restart(client, dirs)
    numpy_var = np.full(10, 7.0)
    held = restart.protected[1]
    with pytest.raises(ftidask.NoCheckpointError, match="hash does not match"):
        restart.recover()
    assert restart.protected[1] is held and (numpy_var == 7.0).all()
    restart._close()


@pytest.mark.parametrize("level", [2, 3])
def test_damaged_data_found_by_a_read_is_rebuilt_from_the_level(client, dirs, level):
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, _field(3))
    ctx.checkpoint(1, level)
    saved = ctx.protected[1].compute()
    ctx._close()
    _flip_in_container(_files(dirs, level), 1, 1)
    restart = _restart(client, dirs)
    out = restart.recover()
    assert restart.recovered_from == (1, level)
    assert out[1].compute().tobytes() == saved.tobytes()
    restart._close()
    again = _restart(client, dirs)  # the rebuilt file replaced the damaged one: read once, verified
    assert again.recover()[1].compute().tobytes() == saved.tobytes()
    again._close()


def test_damaged_data_beside_missing_parity_is_checked_before_the_parity_is_rebuilt(client, dirs):
    """A parity rebuilt from an unchecked damaged file would be wrong: with redundancy to rebuild, the files'
    data is checked first (rank 1's data damaged, rank 2's parity erased: both rebuilt from the rest)."""
    ctx = ftidask.init(client=client, **dirs)
    ctx.protect(1, _field(4))
    ctx.checkpoint(1, 3)
    saved = ctx.protected[1].compute()
    ctx._close()
    _flip_in_container(_files(dirs, 3), 1, 1)
    parity = list(Path(dirs["ckpt_dir"]).glob("**/l3/ckpt*/Ckpt1-RSed2.fti"))
    assert len(parity) == 1
    parity[0].unlink()
    restart = _restart(client, dirs)
    assert restart.recover()[1].compute().tobytes() == saved.tobytes()
    restart._close()
    # Then half of the group's files lost, the rebuilt parity among those left: ranks 0 and 1 come back
    # from the data of ranks 2 and 3 and the parity of ranks 2 and 3.
    level_dir = Path(dirs["ckpt_dir"])
    for name in ("Ckpt1-Rank0.fti", "Ckpt1-Rank1.fti", "Ckpt1-RSed0.fti", "Ckpt1-RSed1.fti"):
        (found,) = level_dir.glob(f"**/l3/ckpt*/{name}")
        found.unlink()
    again = _restart(client, dirs)
    assert again.recover()[1].compute().tobytes() == saved.tobytes()
    again._close()
