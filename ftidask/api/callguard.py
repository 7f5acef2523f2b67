"""One call of a context at a time: the API's calls are serialized, and a call made while another one of the same
context is in progress on the same thread (a signal handler that checkpoints or finalizes) is refused.

A context is a state machine over files: a checkpoint takes the run's next sequence number, retires older
checkpoints and collects leftovers; two of them interleaved (two threads, or a SIGTERM handler that checkpoints
while the main program is inside ``checkpoint``) took the same number, collected each other's files, and left no
checkpoint at all. Calls from other threads wait for their turn; a re-entered call cannot wait (the thread it would
wait for is itself), so it raises :class:`FTIError` saying what to do instead (set a flag in the handler, or
``ftidask.ResilientLoop``, which checkpoints at the end of the step). The background thread of asynchronous
checkpoints makes no API call: it never waits here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..model.errors import FTIError

F = TypeVar("F", bound=Callable[..., Any])


class CallGuard:
    """The API call of a context in progress: which thread makes it, and the call it may make itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._call = ""
        self._nested = ""  # the API method the call in progress calls itself next (snapshot's checkpoint)
        _guards.add(self)

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        """Around API call ``name``: waits for a call of another thread; refuses one re-entered on this thread."""
        me = threading.get_ident()
        if self._owner == me:
            if self._nested != name:
                raise FTIError(f"{name}() was called while {self._call}() of this context is in progress on the same "
                               "thread (from a signal handler?): a context makes one call at a time; let the handler "
                               "set a flag and call it after the call in progress returns (or use "
                               "ftidask.ResilientLoop)")
            self._nested = ""  # that one call only: a signal handler's during it is refused as any other
            yield
            return
        with self._lock:
            try:
                self._owner, self._call = me, name
                yield
            finally:
                self._owner, self._call, self._nested = None, "", ""

    @contextlib.contextmanager
    def nested(self, name: str) -> Iterator[None]:
        """Around the call of API method ``name`` that the call in progress makes itself."""
        self._nested = name
        try:
            yield
        finally:
            self._nested = ""

    def _after_fork(self) -> None:
        """In a child forked while another thread made a call: that thread is not in the child, nor its call."""
        self._lock, self._owner, self._call, self._nested = threading.Lock(), None, "", ""


_guards: weakref.WeakSet[CallGuard] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [guard._after_fork() for guard in list(_guards)])


def one_at_a_time(method: F) -> F:
    """An API method of a context that holds a :class:`CallGuard` as ``_calls`` (see the module's docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._calls.enter(name):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]
