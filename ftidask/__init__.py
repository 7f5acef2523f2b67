"""ftidask: FTI's multilevel checkpointing (FTI-FF files, levels L1-L4) for NumPy, MPI and Dask."""

from .checkpointing import CheckpointInfo
from .config import Config, load_config
from .constants import *  # noqa: F403 - FTI's names are the public API
from .constants import init_type
from .context import Context, init
from .decomposition import Block
from .logsetup import log_to_stderr
from .pystate import State, Value
from .resilient import ResilientLoop, resilient
from .errors import (CheckpointError, ConfigError, FormatError, FTIError, LevelError, NoCheckpointError,
                     ProtectError, RecoveryError, RunInUseError, StagingError)

__version__ = "0.1.0"

__all__ = [
    "Block", "CheckpointError", "CheckpointInfo", "Config", "ConfigError", "Context", "FTIError", "FormatError",
    "LevelError", "NoCheckpointError", "ProtectError", "RecoveryError", "ResilientLoop", "RunInUseError",
    "StagingError", "State", "Value", "init", "init_type", "load_config", "log_to_stderr", "resilient",
]
