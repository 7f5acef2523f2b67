"""Where ftidask's log lines go: to no handler of ours by default (a library adds none: Python's last-resort handler
shows the warnings of a program that configured no logging), stderr when asked.

FTI prints what it does, filtered by ``verbosity`` (1 debug, 2 info, 3 warnings, 4 errors), and
prints information only on rank 0. ftidask logs to the ``"ftidask"`` logger; a handler on stderr
is attached when the verbosity is set explicitly (``ftidask.init(..., verbosity=2)`` or
``verbosity = 2`` in the config file) or by :func:`log_to_stderr`, and only once per process.
"""

from __future__ import annotations

import logging
import sys

from ..model.errors import FTIError

_LOGGER = "ftidask"
_HANDLER_NAME = "ftidask-stderr"
VERBOSITY_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

#: This process's rank (set by each new context): below WARNING, only rank 0 prints, as FTI does,
#: unless the level is DEBUG (verbosity 1).
_rank = 0


class _StderrHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is at the time of each line (a notebook replaces it)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_name(_HANDLER_NAME)
        self.setFormatter(logging.Formatter("[ftidask %(levelname)s%(rank_tag)s] %(message)s"))
        self.addFilter(_rank_filter)

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401 - logging's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def _rank_filter(record: logging.LogRecord) -> bool:
    record.rank_tag = f" rank {_rank}" if _rank else ""
    return record.levelno >= logging.WARNING or _rank == 0 or logging.getLogger(_LOGGER).level <= logging.DEBUG


def _handler() -> logging.Handler | None:
    return next((h for h in logging.getLogger(_LOGGER).handlers if h.get_name() == _HANDLER_NAME), None)


def log_to_stderr(level: int | str = logging.INFO) -> logging.Handler:
    """Print ftidask's log lines at ``level`` and above on stderr (``logging.INFO``: one line per
    checkpoint and recovery). Calling it again changes the level; the handler is attached once."""
    known = isinstance(level, int) and not isinstance(level, bool) or isinstance(level, str) and isinstance(
        logging.getLevelName(level.upper()), int)
    if not known:  # logging's own error would be a raw ValueError or TypeError
        raise FTIError(f"log_to_stderr(level={level!r}): give a logging level, e.g. logging.INFO or 'INFO' "
                       "(DEBUG, INFO, WARNING, ERROR)")
    logger = logging.getLogger(_LOGGER)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    handler = _handler()
    if handler is None:
        handler = _StderrHandler()
        logger.addHandler(handler)
    return handler


def apply_verbosity(verbosity: int, explicit: bool, rank: int) -> None:
    """Set the ``"ftidask"`` logger's level from ``verbosity``. The default verbosity does not
    override a level set before (:func:`log_to_stderr`, the application); an ``explicit`` one does,
    and makes sure the lines are seen: it attaches the stderr handler, unless the application has
    configured logging itself (a handler on the root or ``"ftidask"`` logger already gets them)."""
    global _rank
    _rank = rank
    logger = logging.getLogger(_LOGGER)
    level = VERBOSITY_LEVELS[verbosity]
    if not explicit:
        if logger.level == logging.NOTSET:
            logger.setLevel(level)
        return
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        log_to_stderr(level)
