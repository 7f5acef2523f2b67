"""The client's side of the cluster: place tasks on workers, wait for them while watching for
lost workers, show progress with Dask's own bar."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from distributed import Client, Future, wait
from distributed.diagnostics.progressbar import TextProgressBar, is_kernel

from ..errors import FTIError

log = logging.getLogger("ftidask")


class WorkerLost(FTIError):
    """A worker that a task was placed on left the cluster before the task finished."""


class TaskFailed(FTIError):
    """A task raised an exception on its worker."""


class Cluster:
    """Task placement and waiting on one ``distributed.Client``."""

    def __init__(self, client: Client, progress: str = "auto", poll: float = 0.25) -> None:
        self.client = client
        self.progress = progress
        self.poll = poll
        self._batch: list[Future] | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Release every future submitted inside the block when it ends.

        A finished level task whose result the client still held would be recomputed if its
        worker died later: the client must forget them once the checkpoint is decided.
        """
        outer, self._batch = self._batch, []
        try:
            yield
        finally:
            for f in self._batch:
                try:
                    f.release()
                except Exception:  # noqa: BLE001 - best effort on a failing cluster
                    pass
            self._batch = outer

    def workers(self) -> list[str]:
        """Addresses of the live workers, sorted: a worker's position is its rank."""
        # Not Client.scheduler_info(): a periodic refresh may replace its cache with one that lists no worker.
        info = self.client.sync(self.client.scheduler.identity, n_workers=-1)
        return sorted(a for a, w in info["workers"].items() if w.get("status", "running") == "running")

    def submit(self, fn: Callable[..., Any], *args: Any, key: Any, worker: str, **kwargs: Any) -> Future:
        """Run ``fn`` on ``worker`` only (its files or chunks are there), under a readable key."""
        future = self.client.submit(fn, *args, key=key, workers=[worker], allow_other_workers=False, pure=False,
                                    **kwargs)
        if self._batch is not None:
            self._batch.append(future)
        return future

    def run(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """``fn(*args)`` on every live worker (small values only)."""
        return self.client.run(fn, *args, on_error="return")

    def _show_progress(self, futures: Sequence[Future]) -> None:
        enabled = self.progress == "on" or (self.progress == "auto" and is_kernel())
        if not enabled or not futures:
            return
        keys = [f.key for f in futures]
        address = self.client.scheduler.address

        def bar() -> None:
            try:
                TextProgressBar(keys, scheduler=address, complete=True)
            except Exception as exc:  # noqa: BLE001 - a progress bar must never fail a checkpoint
                log.debug("progress bar stopped: %s", exc)

        threading.Thread(target=bar, name="ftidask-progress", daemon=True).start()

    def wait_all(self, futures: Sequence[Future], addresses: Iterable[str], what: str,
                 gather: bool = True) -> list[Any]:
        """The results of ``futures``; :class:`WorkerLost` or :class:`TaskFailed` on failure.

        Tasks are pinned to their workers, so a lost worker would leave them waiting forever:
        the loop checks that every worker they were placed on is still alive.
        """
        needed = set(addresses)
        self._show_progress(futures)
        while True:
            try:
                wait(list(futures), timeout=self.poll)
                break
            except TimeoutError:
                pass
            if any(f.status in ("error", "cancelled", "lost") for f in futures):
                break
            gone = needed - set(self.workers())
            if gone:
                self.cancel(futures)
                raise WorkerLost(f"{what}: worker(s) {', '.join(sorted(gone))} left the cluster")
        errors = []
        for f in futures:
            if f.status == "finished":
                continue
            try:
                exc = f.exception(timeout=self.poll * 4)
            except Exception as err:  # noqa: BLE001 - cancelled or lost futures raise here
                exc = err
            errors.append(f"{f.key}: {type(exc).__name__}: {exc}")
        if errors:
            self.cancel(futures)
            gone = needed - set(self.workers())
            cls = WorkerLost if gone else TaskFailed
            raise cls(f"{what}: " + "; ".join(errors[:8]) + (f" (and {len(errors) - 8} more)" if len(errors) > 8
                                                              else ""))
        return self.client.gather(list(futures)) if gather else []

    def cancel(self, futures: Sequence[Future]) -> None:
        try:
            self.client.cancel(list(futures), force=True)
        except Exception as exc:  # noqa: BLE001 - best effort on a failing cluster
            log.debug("cancel failed: %s", exc)
