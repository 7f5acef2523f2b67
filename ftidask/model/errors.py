"""Exceptions of ftidask: one base class, one subclass per kind of failure."""

from __future__ import annotations

import errno
import os


class FTIError(Exception):
    """Base class of every error ftidask raises on purpose."""


class ConfigError(FTIError, ValueError):
    """A configuration key has a missing, unknown or invalid value."""


class ProtectError(FTIError, ValueError):
    """An array cannot be protected (object dtype, bad id, ...)."""


class CheckpointError(FTIError):
    """A checkpoint could not be written; the previous one is still intact."""


class UnkeepableCheckpoint(CheckpointError):
    """keep_last_ckpt: the checkpoint's own files do not verify (damaged, or lost beyond its level's redundancy):
    finalize keeps the next older one. Any other failure of the flush (the global directory full or read-only, the
    copy's record unwritable) is raised: the run keeps its checkpoints, the newest recoverable by a restart."""


class FormatError(FTIError):
    """A file is not an FTI-FF file, or it is damaged (a hash does not match)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class RecoveryError(FTIError):
    """A recovery could not be completed; the protected arrays are untouched."""


class NoCheckpointError(RecoveryError):
    """No checkpoint can be recovered (FTI's FTI_NREC)."""


class RunInUseError(FTIError):
    """The run named by ``exec_id`` is being written by a live process (docs/guide.md, runs sharing a directory)."""


class LevelError(FTIError, ValueError):
    """A checkpoint level is unknown or not provided by the running backend."""


class StagingError(FTIError):
    """Staging is not enabled (raised by every staging call), a staging request is invalid (raised by
    send_file), or requests failed (raised by finalize)."""


#: Errors of the disk being written, not of the data being read: a copy or rebuild that fails with one of them says
#: nothing of the checkpoint it copies (keep_last_ckpt must not pass over a sound checkpoint for a full disk).
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def says_disk_failure(text: str) -> bool:
    """Whether an error's text (reasons gathered from ranks or workers: strings) names one of :data:`DISK_ERRNOS`."""
    return any(os.strerror(code) in text for code in DISK_ERRNOS)
