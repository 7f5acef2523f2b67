"""Ctrl-C held off for the few bytecodes in which a new descriptor has no owner yet.

In a notebook, Ctrl-C raises KeyboardInterrupt in the main thread between any two of its bytecodes, and the
process lives on. Between ``os.open`` returning a descriptor and the file object (or the ``try`` block) that
closes it, an interrupt would leave the descriptor open for the life of the kernel, and with it the disk space
of the file once deleted. :func:`held_off` replaces SIGINT's Python handler for that moment and delivers a
Ctrl-C received meanwhile right after it. Another thread's SIGINT handler cannot be replaced (only the main
thread's code is interrupted anyway): there it does nothing.
"""

from __future__ import annotations

import _signal  # signal's own functions without its enum conversions (12 of these blocks a checkpoint: 0.1 ms)
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_SIGINT = int(signal.SIGINT)


@contextlib.contextmanager
def held_off() -> Iterator[None]:
    """Defer SIGINT's Python handler (Ctrl-C) in the main thread until the block is left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = _signal.getsignal(_SIGINT)
    except ValueError:  # pragma: no cover - a sub-interpreter
        previous = None
    if not callable(previous):  # ignored, the default action, or not set from Python: nothing to defer
        yield
        return
    received: list[tuple[int, Any]] = []
    _signal.signal(_SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        _signal.signal(_SIGINT, previous)
        if received:
            previous(*received[0])  # the default handler raises KeyboardInterrupt here, the descriptor owned
