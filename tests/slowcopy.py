"""Slow staging transfers for the tests: each piece (8 MiB) a mover writes takes ``delay`` seconds more.

The product has no throttle: a test slows the copy where it runs, by wrapping
``ftidask.staging.copy._write_all`` (the one write of each piece) in that process: this one (the
thread mover), the process mover's child (:func:`slow_movers` starts it with the wrapper), or a
Dask worker (``client.run(slowcopy.install, delay)``, undone with ``client.run(slowcopy.uninstall)``).
"""

from __future__ import annotations

import functools
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftidask.staging import copy as staging_copy
from ftidask.staging import process as staging_process

_ORIGINAL = staging_copy._write_all
_TESTS = str(Path(__file__).resolve().parent)


def slowed(delay: float, gate: str | None = None) -> Callable[[int, memoryview], None]:
    """``staging_copy._write_all``, then a pause of ``delay`` seconds; with ``gate``, then a wait until the file
    ``gate`` exists (at most 120 s): a copy that cannot end before the test opens the gate, whatever the load."""

    @functools.wraps(_ORIGINAL)
    def write_all(fd: int, data: memoryview) -> None:
        _ORIGINAL(fd, data)
        time.sleep(delay)
        if gate is not None:
            hold(gate)

    return write_all


def install(delay: float, gate: str | None = None) -> None:
    """Slow every transfer this process runs from now on (:func:`slowed`)."""
    staging_copy._write_all = slowed(delay, gate)


def uninstall() -> None:
    staging_copy._write_all = _ORIGINAL


def hold(gate: str, timeout: float = 120.0) -> None:
    """Keep this thread (a Dask worker's only one) busy until the file ``gate`` exists: the tasks queued behind it
    wait, whatever the machine's load."""
    deadline = time.monotonic() + timeout
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def installed() -> bool:
    """Whether this process's transfers are slowed."""
    return staging_copy._write_all is not _ORIGINAL


def slow_movers(delay: float, setattr: Callable[[Any, str, Any], None] = setattr, gate: Path | None = None) -> None:
    """Slow the thread mover of this process and the process movers it starts from now on
    (``setattr``: pytest's ``monkeypatch.setattr`` to undo it after the test). With ``gate``, each transfer also
    waits after its first piece until the file ``gate`` exists (:func:`slowed`): a test that must act while a copy
    runs (change its source, kill its mover, block the next request's path) opens the gate once it has acted, instead
    of hoping that ``delay`` is longer than its own step takes on a loaded machine."""
    gate_name = None if gate is None else str(gate)
    setattr(staging_copy, "_write_all", slowed(delay, gate_name))
    popen = subprocess.Popen

    def popen_slowed(args: list[str], *rest: Any, **kwargs: Any) -> Any:
        # The mover runs ``python -c CODE``: install the same slowdown first.
        i = args.index("-c") + 1
        prefix = (f"import sys; sys.path.insert(0, {_TESTS!r}); import slowcopy; "
                  f"slowcopy.install({delay!r}, {gate_name!r}); ")
        return popen([*args[:i], prefix + args[i], *args[i + 1:]], *rest, **kwargs)

    setattr(staging_process.subprocess, "Popen", popen_slowed)
