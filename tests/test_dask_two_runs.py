"""Two ftidask runs on one Dask cluster at once (two clients, as two notebooks on a shared cluster), each with its own
directories, checkpointing at L3 together: on workers of one thread each, a run's group member held a worker's only
thread while waiting for its peers, queued behind the other run's members on the other workers, whose own peer
queued behind it: both checkpoints waited for ever (the members give up after 600 s). A member now leaves the
worker's task slots while it waits (distributed's secede). The crossing is a race: each pair of checkpoints may hit it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import ftidask  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.slow, pytest.mark.timeout(600)]
NWORKERS = 3  # the shared cluster of three workers of one thread each (conftest.py)
PAIRS = 10
BOUND = 60  # seconds a pair of checkpoints may take before the test calls it a deadlock


def executing(dask_worker=None) -> dict:
    state = dask_worker.state
    return {"executing": sorted(str(t.key) for t in state.executing), "ready": sorted(str(t.key) for t in state.ready)}


def test_two_runs_checkpointing_together_on_one_cluster_never_deadlock(dask_client, tmp_path):
    clients = [distributed.Client(dask_client.scheduler.address, set_as_default=False) for _ in range(2)]
    try:
        ctxs = [ftidask.init(client=c, ckpt_dir=str(tmp_path / r / "L"), glbl_dir=str(tmp_path / r / "G"),
                             meta_dir=str(tmp_path / r / "M"), verbosity=3) for r, c in zip("ab", clients)]
        expected: dict[int, np.ndarray] = {}
        for ckpt in range(1, PAIRS + 1):
            errors: list[BaseException] = []

            def one(k: int, ckpt: int = ckpt) -> None:
                try:
                    array = da.random.default_rng(10 * ckpt + k).random((400, 400), chunks=(100, 100))
                    ctxs[k].protect(1, clients[k].persist(array), name="f")
                    ctxs[k].checkpoint(ckpt, 3)
                    expected[k] = clients[k].compute(ctxs[k].protected[1]).result()
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(BOUND)
            assert not any(t.is_alive() for t in threads), (f"checkpoints {ckpt} of both runs deadlocked",
                                                            dask_client.run(executing))
            assert not errors, errors
        for k, ctx in enumerate(ctxs):
            ctx._close()
            again = ftidask.init(client=clients[k], **{d: str(tmp_path / "ab"[k] / n) for d, n in
                                                      (("ckpt_dir", "L"), ("glbl_dir", "G"), ("meta_dir", "M"))})
            out = again.recover()[1]
            assert again.recovered_from == (PAIRS, 3)
            assert clients[k].compute(out).result().tobytes() == expected[k].tobytes()
            again.finalize()
    finally:
        for c in clients:
            c.close()
