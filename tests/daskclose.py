"""Closing the tests' LocalClusters of worker processes without hanging the test run.

After workers were SIGKILLed and their nannies restarted them (the fault tests do it all the time), distributed's
``Cluster.close()`` was seen to wait for ever (a CI dry run: the test's body done at 13:31, ``SpecCluster.close``
still waiting at 13:45, the workers idle). :func:`close_cluster` gives it ``timeout`` seconds, then kills the worker
processes it started, so that the next test starts on a clean machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

log = logging.getLogger("ftidask.tests")


def _worker_pids(cluster: Any) -> list[int]:
    pids = []
    for nanny in list(getattr(cluster, "workers", {}).values()):
        with contextlib.suppress(Exception):  # a nanny without a process (closed, or never started)
            pid = nanny.process.process.pid
            if pid:
                pids.append(int(pid))
    return pids


def close_cluster(cluster: Any, timeout: float = 60.0) -> None:
    """``cluster.close()``, at most ``timeout`` seconds; then its worker processes are killed (SIGKILL)."""
    pids = _worker_pids(cluster)
    try:
        cluster.close(timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - TimeoutError, or a closing that failed half way
        log.warning("closing the LocalCluster failed (%r): killing its workers %s", exc, pids)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
