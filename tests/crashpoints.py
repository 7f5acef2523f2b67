"""Crash points for the tests: kill a process for real (SIGKILL) at the n-th call of a product function,
or interrupt it there as Ctrl-C does in a notebook (KeyboardInterrupt, the process lives on).

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


def _counted(original: Callable[..., Any], nth: int, after: bool, fail: bool = False,
             interrupt: bool = False) -> Callable[..., Any]:
    calls = itertools.count(1)  # next() is atomic: safe from the hashing threads too

    def hit_now() -> None:
        if interrupt:
            raise KeyboardInterrupt(f"injected interrupt at call {nth} of {original.__name__}")
        die()

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        hit = next(calls) == nth
        if hit and fail:
            raise InjectedFailure(f"injected failure at call {nth} of {original.__name__}")
        if hit and not after:
            hit_now()
        result = original(*args, **kwargs)
        if hit:
            hit_now()
        return result

    return wrapper


def kill_at_call(owner: Any, name: str, nth: int = 1, *, after: bool = False, fail: bool = False,
                 interrupt: bool = False) -> None:
    """Replace ``owner.name`` (``owner``: a module, a class, or a module's dotted name) so that
    its ``nth`` call kills this process: as it starts, or with ``after`` once it has returned;
    with ``fail``, raises :class:`InjectedFailure` instead (the process lives on); with ``interrupt``,
    raises KeyboardInterrupt, as Ctrl-C in a notebook does (the process lives on)."""
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    setattr(owner, name, _counted(getattr(owner, name), nth, after, fail, interrupt))


def interrupt_at_call(owner: Any, name: str, nth: int = 1, *, after: bool = False) -> Callable[[], None]:
    """:func:`kill_at_call` with ``interrupt``: the ``nth`` call of ``owner.name`` raises KeyboardInterrupt (as it
    starts, or with ``after`` once it has returned). Returns the function that puts the original back."""
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    original = getattr(owner, name)
    kill_at_call(owner, name, nth, after=after, interrupt=True)
    return lambda: setattr(owner, name, original)


class InterruptAt:
    """``with InterruptAt(n) as hit:``: Ctrl-C at the ``n``-th event of ftidask's code in this thread: a call or a
    return of one of its functions, or a call of a C function (``os.replace``, ``os.fsync``...) from one. As the
    signal, it reaches the main thread only, between two bytecodes of whatever runs there. ``hit.where`` says
    where it was raised (None: the code under test made fewer events: the sweep is over). ``skip``: events
    (``"return create_temp"``) never interrupted, for windows known to be open."""

    EVENTS = ("call", "return", "c_call")
    #: Called by the with statement itself: a signal is never handled between it and the call (the lock of a
    #: ``with lock:`` is always released), while the profiler sees them as calls of C functions. And ``close``:
    #: CPython handles a signal after a C call returns, never before it starts, so the ``os.close`` that begins a
    #: ``finally`` block always runs (the profiler's c_call event comes before it).
    ATOMIC = ("__enter__", "__exit__", "close")

    def __init__(self, nth: int, package: str = "ftidask", skip: tuple[str, ...] = ()) -> None:
        self.nth, self.package, self.count, self.skip = nth, package + ".", 0, skip
        self.where: str | None = None

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event in self.EVENTS and (frame.f_globals.get("__name__", "") + ".").startswith(self.package) and not (
                event == "c_call" and getattr(arg, "__name__", "") in self.ATOMIC):
            if f"{event} {frame.f_code.co_qualname}" in self.skip:
                return
            self.count += 1
            if self.count == self.nth:
                called = f" -> {getattr(arg, '__name__', arg)}" if event == "c_call" else ""
                self.where = f"{event} {frame.f_code.co_qualname}{called} ({frame.f_code.co_filename})"
                raise KeyboardInterrupt(f"injected interrupt at {self.where}")  # the profiler is unset with it

    def __enter__(self) -> InterruptAt:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(None)


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
    ``"module:function"`` / ``"module:function:after"`` / ``"module:function:raise"`` /
    ``"module:function:interrupt"`` (:func:`kill_at_call`); ``function`` may be ``Class.method``.
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
    kill_at_call(owner, name, nth, after=when == ["after"], fail=when == ["raise"], interrupt=when == ["interrupt"])


def seams() -> list[str]:
    """The test seams installed in this process: its crash points, a slowed staging copy
    (:mod:`slowcopy`). Run on each worker of a shared cluster between tests: a worker that
    carries one is not given to the next test."""
    slowcopy = sys.modules.get("slowcopy")
    slowed = ["slowed staging copy"] if slowcopy is not None and slowcopy.installed() else []
    return [f"crash point {p}" for p in INSTALLED] + slowed
