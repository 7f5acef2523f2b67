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
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..model.errors import FTIError

F = TypeVar("F", bound=Callable[..., Any])


class CallGuard:
    """The API call of a context in progress: which thread makes it, and whether it may call another itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._call = ""
        self._nesting = 0  # > 0 while the call in progress makes its own call of another API method

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        """Around API call ``name``: waits for a call of another thread; refuses one re-entered on this thread."""
        me = threading.get_ident()
        if self._owner == me:
            if self._nesting:
                yield  # the call in progress calls it itself (snapshot's checkpoint or recover)
                return
            raise FTIError(f"{name}() was called while {self._call}() of this context is in progress on the same "
                           "thread (from a signal handler?): a context makes one call at a time; let the handler set a "
                           "flag and call it after the call in progress returns (or use ftidask.ResilientLoop)")
        with self._lock:
            self._owner, self._call = me, name
            try:
                yield
            finally:
                self._owner, self._call = None, ""

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """Around a call the call in progress makes of another API method of its context."""
        self._nesting += 1
        try:
            yield
        finally:
            self._nesting -= 1


def one_at_a_time(method: F) -> F:
    """An API method of a context that holds a :class:`CallGuard` as ``_calls`` (see the module's docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._calls.enter(name):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]
