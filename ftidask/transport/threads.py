"""Members of one L2/L3 group as threads of one process, over an in-memory group channel.

Used where a group's members are not processes of their own: rebuilding an old layout's group
before resharding (one rank plays every member), and the in-process level tests. Each member is
a :class:`ThreadMember`, which has the methods of :class:`ftidask.levels.channel.GroupChannel`; the
level code runs unchanged on it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Seconds a member waits for its peers; a member that fails breaks the barrier at once.
WAIT = 600.0


class ThreadHub:
    """What the members of one simulated group share: a barrier, allgather slots, mailboxes."""

    def __init__(self, size: int, wait: float = WAIT) -> None:
        self.size, self.wait = size, wait
        self.barrier = threading.Barrier(size, timeout=wait)
        self.slots: list[Any] = [None] * size
        self.mail: dict[tuple[int, int], queue.Queue[np.ndarray]] = {
            (a, b): queue.Queue() for a in range(size) for b in range(size)}


class ThreadMember:
    """One member's view of a simulated group (the GroupChannel protocol)."""

    def __init__(self, hub: ThreadHub, index: int) -> None:
        self.hub, self.index, self.size = hub, index, hub.size

    def allgather(self, value: Any) -> list[Any]:
        """Every member's ``value``, by index (the objects themselves, not copies)."""
        self.hub.slots[self.index] = value
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        """A copy of every member's ``block``, by index."""
        return [np.array(b, copy=True) for b in self.allgather(block)]

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        """As :meth:`GroupChannel.exchange`, through the hub's mailboxes; waits at most the hub's ``wait`` seconds."""
        if send is not None and dest is not None:
            self.hub.mail[(self.index, dest)].put(np.array(send, copy=True))
        if source is None:
            return None
        return self.hub.mail[(source, self.index)].get(timeout=self.hub.wait)


def run_group(size: int, step: Callable[[ThreadMember], Any], *, names: Sequence[str] | None = None,
              wait: float = WAIT) -> tuple[list[Any], list[str]]:
    """Run ``step`` once per member, each on its own thread; ``(results by index, errors)``.

    A member that raises is reported in ``errors`` (``"member i: Type: message"``) and breaks the
    barrier, so its peers fail at their next collective instead of waiting for it.
    """
    hub = ThreadHub(size, wait)
    results: list[Any] = [None] * size
    errors: list[str] = []

    def member(i: int) -> None:
        try:
            results[i] = step(ThreadMember(hub, i))
        except Exception as exc:  # noqa: BLE001 - reported; the other members must not wait for this one
            errors.append(f"{names[i] if names else f'member {i}'}: {type(exc).__name__}: {exc}")
            hub.barrier.abort()

    threads = [threading.Thread(target=member, args=(i,), name=f"ftidask-group-{i}") for i in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, errors
