"""How processes of one run talk: the collectives the checkpoint engine needs.

A transport moves small JSON-able values between ranks and, for the levels that need it,
whole files between nodes. The engine and the levels never import mpi4py or distributed.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

from ..model.errors import LevelError


class Transport(abc.ABC):
    """One rank's view of the run."""

    name = "abstract"
    rank: int = 0
    size: int = 1
    node: int = 0
    nnodes: int = 1
    #: where nodes are hosts (MPI without ``local_test``): ``{"names": host of each node id, "world": node of each
    #: world rank}``, kept in commit records, so that a restart on the same hosts in another order puts each process
    #: where its host's files are (FTI_ReorderNodes)
    hosts: dict[str, list[Any]] | None = None

    def ranks_text(self) -> str:
        """The ranks this context runs on, for the log line of ``init``."""
        return f"{self.size} rank(s)"

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has reached this call."""

    @abc.abstractmethod
    def allgather(self, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, by rank (collective)."""

    def bcast(self, value: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``value``, on every rank (collective)."""
        return self.allgather(value if self.rank == root else None)[root]

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` is true on every rank (collective)."""
        return all(self.allgather(bool(ok)))

    def levels(self) -> tuple[int, ...]:
        """The levels this transport can run."""
        return (1, 4)

    def check_level(self, level: int) -> None:
        """Raise :class:`LevelError` when this transport cannot run ``level``."""
        if level not in self.levels():
            raise LevelError(
                f"level {level} needs several nodes: the {self.name} backend provides levels "
                f"{', '.join(map(str, self.levels()))}; use the MPI backend (ftidask.init(config, comm=...)) "
                "or the Dask backend (ftidask.init(config, client=...)) for L2 and L3")

    # Hooks for the multi-node levels (L2 partner copy, L3 erasure coding).
    def protect_files(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path) -> None:
        """Add level ``level``'s redundancy for ``own_file`` (a committed L1 file)."""
        if level in (2, 3):
            self.check_level(level)

    def protect_files_delta(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path, delta: Any,
                            xor: Any = None) -> None:
        """Like :meth:`protect_files` for a differential file (levels 5-8).

        Called on every rank of a differential checkpoint (collectively, like protect_files).
        ``delta`` (:class:`ftidask.dcp.delta.FileDelta`, or None when the file was written in full)
        lists the byte ranges of ``own_file`` that differ from the file it was patched from
        (identified by ``delta.base_fb_hash``). A transport whose partner still holds that base can
        send only those ranges: :func:`ftidask.levels.partner_delta.protect` does it for L2 over
        a group channel. By default the whole file is protected. ``xor``
        (:class:`ftidask.dcp.delta.XorDelta`, level 3 only, or None) lets L3 update the parity from
        the changed bytes instead of re-encoding it (:mod:`ftidask.levels.rs_delta`).
        """
        self.protect_files(level, ckpt_id, own_file, ckpt_dir)

    def rebuild_file(self, level: int, ckpt_id: int, own_file: Path, ckpt_dir: Path, ok: bool,
                     record: Any = None) -> bool:
        """Collectively rebuild lost files of a level-``level`` checkpoint; True when this rank has its file."""
        return ok

    def partner_of(self) -> int:
        """The rank whose file this rank keeps as its L2 partner copy (FTI's left partner)."""
        return self.rank

    def group_of(self) -> list[int]:
        """The ranks of this rank's L3 group (for FTI's maxFs)."""
        return [self.rank]

    # Heads (asynchronous post-processing); without heads, everything is inline.
    def write_level(self, level: int, differential: bool = False) -> int:
        """The level the application writes at (1 when a head raises it to ``level`` later)."""
        return level

    def post_process(self, record: Any, level: int, exec_id: str = "") -> None:
        """Hand a committed checkpoint to the head, to be raised to ``level``."""

    def wait_post(self) -> Any:
        """Wait for the head's post-processing; its outcome, or None."""
        return None

    def post_done(self) -> bool:
        """Whether the head has finished the last post-processing request (never blocks); True without heads."""
        return True

    def background(self) -> Transport | None:
        """A transport for the context's background thread (asynchronous checkpoints) whose messages
        never mix with this one's, made now (collective); None when the backend cannot give one."""
        return None

    def no_background(self) -> str:
        """Why :meth:`background` gave None, and what to do about it (said in the warning)."""
        return f"the {self.name} backend gives no background channel"

    def close(self) -> None:
        """Release what the transport holds (a duplicated communicator, ...)."""


class SerialTransport(Transport):
    """A single process: one rank on one node."""

    name = "single-process"

    def background(self) -> Transport:
        """This transport itself: a single process sends no messages to mix."""
        return self  # no messages: the same object serves both threads

    def barrier(self) -> None:
        """Nothing to wait for: the only rank is here."""
        return None

    def allgather(self, value: Any) -> list[Any]:
        """``[value]``: the only rank's value."""
        return [value]
