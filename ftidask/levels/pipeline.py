"""A level's loop over blocks, overlapped: read ahead, exchange, write behind.

An L2/L3 step walks the group's files block by block: read this member's block, exchange it with
the group (a collective, so on the calling thread, in the same order on every member), then
encode and write what came back. Done one after the other, the step costs the sum of the disk
read, the network and the disk write; here block ``i + 1`` is read and block ``i - 1`` encoded and
written on two helper threads while block ``i`` is exchanged, so it costs about the slowest stage.
At most one read and one write are in flight: two blocks of memory beyond the serial loop's.

The stages must not raise (a member that stopped halfway would leave its peers waiting in a
collective): the levels' ``read`` and ``consume`` already record their errors instead
(:mod:`ftidask.levels.blockio`); anything that still escapes is recorded here, and the loop
goes on to the end.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..transport.collective import reason

T = TypeVar("T")
R = TypeVar("R")


def _recorded(errors: list[str], what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded: the group's collectives go on
        errors.append(f"{what}: {reason(exc)}")
        return None


def overlapped(count: int, read: Callable[[int], T], exchange: Callable[[int, T | None], R],
               consume: Callable[[int, R], None], errors: list[str]) -> None:
    """For ``i`` in ``range(count)``: ``consume(i, exchange(i, read(i)))``, with ``read(i + 1)`` and
    ``consume(i - 1, ...)`` on helper threads while ``exchange(i, ...)`` runs on this one.

    ``read`` may return None only where ``exchange`` accepts it (a block that could not be read
    and was not recorded as zeros). ``consume`` calls run in order, one at a time.
    """
    if count <= 0:
        return
    if count == 1:  # nothing to overlap: no threads
        got = read(0)
        consume(0, exchange(0, got))
        return
    with ThreadPoolExecutor(2, thread_name_prefix="ftidask-level") as pool:
        ahead: Future[Any] = pool.submit(_recorded, errors, "read", read, 0)
        behind: Future[Any] | None = None
        for i in range(count):
            block = ahead.result()
            if i + 1 < count:
                ahead = pool.submit(_recorded, errors, "read", read, i + 1)
            got = exchange(i, block)
            if behind is not None:
                behind.result()  # in order, and the buffers of one block in the writer at a time
            behind = pool.submit(_recorded, errors, "write", consume, i, got)
        behind.result()
