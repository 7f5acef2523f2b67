"""What the multi-node levels need from a backend: a group of peers that exchange blocks.

L2 and L3 run over one *group*: the processes handling the same position on each node of an
FTI group, indexed by the node's place in the group (0..size-1, a ring). A backend provides
this small interface (MPI: a sub-communicator); the levels never know which backend runs them.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class GroupChannel(Protocol):
    """One member's view of an L2/L3 group."""

    index: int  # this member's place in the group (its node's index in the FTI group)
    size: int  # group_size

    def allgather(self, value: Any) -> list[Any]:
        """Every member's JSON-able ``value``, by index."""
        ...

    def allgather_blocks(self, block: np.ndarray) -> list[np.ndarray]:
        """Every member's ``block`` (uint8, the same length everywhere), by index."""
        ...

    def exchange(self, send: np.ndarray | None, dest: int | None, recv_nbytes: int,
                 source: int | None) -> np.ndarray | None:
        """Send ``send`` to member ``dest`` while receiving ``recv_nbytes`` from ``source`` (None: skip that side)."""
        ...
