"""Thread pools made on first use, shared by a module's callers, and made anew in a forked child.

The codec's frames and the snapshot's parallel copy each keep one pool for the whole process: threads are
started once, not at every checkpoint. A forked child has none of its parent's threads, and a lock another
parent thread held at the fork stays held in the child: both are dropped there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class LazyPool:
    """One :class:`ThreadPoolExecutor` of ``threads`` threads, started by the first :meth:`get`."""

    def __init__(self, threads: int, prefix: str) -> None:
        self.threads, self.prefix = threads, prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def _started(self) -> ThreadPoolExecutor:
        # Under self._lock.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.prefix)
        return self._pool

    def get(self) -> ThreadPoolExecutor:
        """The pool (its tasks must start no task of their own in it: a full pool would wait for itself)."""
        with self._lock:
            return self._started()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` in the pool; safe against a concurrent :meth:`resize` (which a bare ``get().submit``
        is not: the pool it got may be shut down before it submits)."""
        with self._lock:
            return self._started().submit(fn, *args)

    def resize(self, threads: int) -> None:
        """Use ``threads`` threads from now on (at least one). A pool already started is replaced; the tasks
        already submitted to it still run, on its threads, which end once they are done."""
        threads = max(1, int(threads))
        with self._lock:
            if threads == self.threads:
                return
            self.threads, old, self._pool = threads, self._pool, None
        if old is not None:
            old.shutdown(wait=False)
