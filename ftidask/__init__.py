"""ftidask: FTI's multilevel checkpointing (FTI-FF files, levels L1-L4) for NumPy, MPI and Dask."""

from .api.context import Context
from .api.logsetup import log_to_stderr
from .api.resilient import ResilientLoop, resilient
from .api.start import init
from .engine.checkpointing import CheckpointInfo
from .engine.inflight import CheckpointHandle
from .engine.pystate import State, Value
from .model.config import Config, load_config
from .model.constants import *  # noqa: F403 - FTI's names are the public API
from .model.constants import init_type
from .model.decomposition import Block
from .model.errors import (
    CheckpointError,
    ConfigError,
    FormatError,
    FTIError,
    LevelError,
    NoCheckpointError,
    ProtectError,
    RecoveryError,
    RunInUseError,
    StagingError,
)

__version__ = "0.1.0"

__all__ = [
    "Block", "CheckpointError", "CheckpointHandle", "CheckpointInfo", "Config", "ConfigError", "Context", "FTIError",
    "FormatError", "LevelError", "NoCheckpointError", "ProtectError", "RecoveryError", "ResilientLoop",
    "RunInUseError", "StagingError", "State", "Value", "init", "init_type", "load_config", "log_to_stderr",
    "resilient",
]
