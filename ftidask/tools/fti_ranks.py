"""Which process of an FTI run a rank names, with FTI's heads (``[basic] head = 1``) or without.

FTI_Init (src/api.c) takes ``myRank`` from the communicator it is given (the *global* one, heads included) and every
file is named after it (``Ckpt{id}-Rank{myRank}.fti``, src/checkpoint.c ``FTI_WriteCkpt``). FTI_Topology
(src/topo.c) places the processes node by node (``local_test``: ``node{myRank / node_size}``; else by host name,
taken here as consecutive ranks), ``node_size`` counting the head; with ``head = 1`` the first process of each node
(``nodeRank == 0``) is the head, which keeps no checkpoint of its own, and the application's ``FTI_COMM_WORLD`` is
made of the others in node order (``userProcList``): application rank ``a`` is the process at place
``1 + a % (node_size - 1)`` of node ``a // (node_size - 1)``. A rank is therefore ambiguous once there are heads:
a caller says which communicator it is a rank of (``comm="global"`` or ``comm="app"``), or is refused, so that no
other process's file (which verifies by its own hashes just as well) is ever read for it.
"""

from __future__ import annotations

from ..model.config import Config
from ..model.errors import ConfigError, RecoveryError

COMMS = ("global", "app")


def _check_rank(rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise RecoveryError(f"rank must be a non-negative int, got {rank!r}")
    return rank


def _check_heads(cfg: Config) -> None:
    if cfg.head and cfg.node_size < 2:
        raise ConfigError(f"head = 1 with node_size = {cfg.node_size}: the head would be each node's only process, "
                          "leaving no application process (FTI's node_size counts the head)")


def global_rank(cfg: Config, rank: int, comm: str | None = None) -> int:
    """The rank in FTI's global communicator (the one its file names carry) of the application process ``rank``
    names: a rank of ``comm`` (``"global"``: the communicator given to FTI_Init, heads included; ``"app"``: FTI's
    ``FTI_COMM_WORLD``, application processes only). Without heads the two are the same and ``comm`` may be
    omitted; with ``head = 1`` it must be said (ConfigError otherwise), and a global rank that is a head's is
    refused (ConfigError: a head keeps no checkpoint)."""
    rank = _check_rank(rank)
    if comm is not None and comm not in COMMS:
        raise ConfigError(f"comm = {comm!r}: say 'global' (a rank in the communicator given to FTI_Init, heads "
                          "included, as in FTI's file names) or 'app' (a rank in FTI_COMM_WORLD)")
    _check_heads(cfg)
    if not cfg.head:
        return rank
    if comm is None:
        raise ConfigError(f"this FTI run has heads (head = 1, node_size = {cfg.node_size}): an application "
                          "process's rank in FTI_COMM_WORLD and its rank in the global communicator differ, so rank "
                          f"{rank} could name two processes; say which with comm='app' (FTI_COMM_WORLD) or "
                          "comm='global' (heads included, as in Ckpt{id}-Rank{r}.fti)")
    per_node = cfg.node_size
    if comm == "app":
        return rank // (per_node - 1) * per_node + 1 + rank % (per_node - 1)
    if rank % per_node == 0:
        raise ConfigError(f"global rank {rank} is the head of node {rank // per_node} (head = 1: the first process "
                          "of each node, FTI_Topology), which keeps no checkpoint of its own; its node's "
                          f"application processes are global ranks {rank + 1}..{rank + per_node - 1}")
    return rank


def app_rank(cfg: Config, rank: int) -> int:
    """The rank in FTI_COMM_WORLD of the application process of global rank ``rank`` (ConfigError for a head)."""
    rank = global_rank(cfg, rank, "global")
    if not cfg.head:
        return rank
    return rank // cfg.node_size * (cfg.node_size - 1) + rank % cfg.node_size - 1
