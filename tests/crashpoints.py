"""Crash points for the tests: kill a process for real (SIGKILL) at the n-th call of a product function.

The product code holds no test hooks. A test installs a crash point in the process that must die:
a child process of the test (see ``_dcp_crash_child.py``), or a Dask worker, with
``client.run(crashpoints.install, ..., workers=[address])`` (the worker imports this module: the
test's ``sys.path`` is passed on to the worker processes the nanny spawns). A killed worker is
restarted fresh, without the crash point.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import signal
import sys
import types
from collections.abc import Callable
from typing import Any

INSTALLED: list[str] = []  # the crash points installed in this process


def die() -> None:
    """Kill this process at once, as a node failure would: no cleanup, no exit handlers."""
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFailure(RuntimeError):
    """Raised by a ``:raise`` crash point: a task that fails while its process lives on."""


def _counted(original: Callable[..., Any], nth: int, after: bool, fail: bool = False) -> Callable[..., Any]:
    calls = itertools.count(1)  # next() is atomic: safe from the hashing threads too

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hit = next(calls) == nth
        if hit and fail:
            raise InjectedFailure(f"injected failure at call {nth} of {original.__name__}")
        if hit and not after:
            die()
        result = original(*args, **kwargs)
        if hit:
            die()
        return result

    return wrapper


def kill_at_call(owner: Any, name: str, nth: int = 1, *, after: bool = False, fail: bool = False) -> None:
    """Replace ``owner.name`` (``owner``: a module, a class, or a module's dotted name) so that
    its ``nth`` call kills this process: as it starts, or with ``after`` once it has returned;
    with ``fail``, raises :class:`InjectedFailure` instead (the process lives on)."""
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    setattr(owner, name, _counted(getattr(owner, name), nth, after, fail))


def kill_at_block_write(nth: int = 1) -> None:
    """Kill this process before the ``nth`` write of changed blocks into a differential file.

    :class:`ftidask.dcp.files.DcpFileWriter` writes data blocks (and nothing else) with
    ``storage.pwrite_all``: its module sees a ``storage`` whose ``pwrite_all`` counts.
    """
    from ftidask.dcp import files as dcp
    from ftidask.storage import files as storage

    proxy = types.ModuleType(storage.__name__)
    proxy.__dict__.update(vars(storage))
    proxy.pwrite_all = _counted(storage.pwrite_all, nth, after=False)  # type: ignore[attr-defined]
    dcp.storage = proxy  # type: ignore[attr-defined]


def install(point: str, nth: int = 1) -> None:
    """Install a named crash point in this process (``client.run`` target on a Dask worker).

    Points: ``dcp-block`` (a write of changed blocks, :func:`kill_at_block_write`), or
    ``"module:function"`` / ``"module:function:after"`` / ``"module:function:raise"`` (:func:`kill_at_call`);
    ``function`` may be ``Class.method``.
    """
    INSTALLED.append(point)
    if point == "dcp-block":
        kill_at_block_write(nth)
        return
    module, name, *when = point.split(":")
    owner: Any = importlib.import_module(module)
    *classes, name = name.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    kill_at_call(owner, name, nth, after=when == ["after"], fail=when == ["raise"])


def seams() -> list[str]:
    """The test seams installed in this process: its crash points, a slowed staging copy
    (:mod:`slowcopy`). Run on each worker of a shared cluster between tests: a worker that
    carries one is not given to the next test."""
    slowcopy = sys.modules.get("slowcopy")
    slowed = ["slowed staging copy"] if slowcopy is not None and slowcopy.installed() else []
    return [f"crash point {p}" for p in INSTALLED] + slowed
