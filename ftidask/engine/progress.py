"""Progress bars for long checkpoints, recoveries and exports (tqdm.auto: terminal or notebook).

A bar is shown only when it is wanted: ``[advanced] progress = on``, or ``auto`` (the default)
with an interactive session (a terminal on stderr, or a Jupyter kernel) and ``verbosity <= 2``.
It appears only after :data:`DELAY` seconds, so short operations never draw one.
"""

from __future__ import annotations

import sys
from typing import Any

DELAY = 1.5  # seconds before a bar is drawn


class _NoBar:
    """The bar used when none is shown: same methods, no output."""

    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()  # type: ignore[attr-defined]
    except AttributeError:
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def interactive() -> bool:
    """True in a terminal (stderr is a TTY) or a Jupyter kernel."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return tty or _in_notebook()


def enabled(mode: str = "auto", verbosity: int = 2) -> bool:
    """Whether to show bars for a ``progress`` setting and a ``verbosity`` level."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return verbosity <= 2 and interactive()


def _tqdm_class() -> Any:
    """tqdm.auto's class (a widget in notebooks), or the text bar where the widget cannot be drawn:
    in a notebook without ipywidgets, tqdm.auto would warn (TqdmWarning) at every bar."""
    import importlib.util

    if importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


def bar(total: int, desc: str, *, mode: str = "auto", verbosity: int = 2, unit: str = "B") -> Any:
    """A progress bar over ``total`` units (bytes by default), or a silent stand-in."""
    if total <= 0 or not enabled(mode, verbosity):
        return _NoBar()
    try:
        tqdm = _tqdm_class()
    except ImportError:  # tqdm is an extra: no bar without it
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024, delay=DELAY,
                leave=False, file=sys.stderr)


def for_config(config: Any, total: int, desc: str) -> Any:
    """:func:`bar` with the ``progress`` and ``verbosity`` of an ftidask :class:`~ftidask.model.config.Config`."""
    return bar(total, desc, mode=getattr(config, "progress", "auto"), verbosity=getattr(config, "verbosity", 2))


#: Below this many bytes no bar is set up at all (the byte streams keep their zero-copy fast path).
MIN_BYTES = 64 << 20


class Tracked:
    """A byte source/target (:class:`~ftidask.model.arrays.ArrayBytes`) that advances a bar as bytes move.

    It hides the zero-copy ``view`` so that the writer and the reader move bytes piece by piece
    through ``pieces``/``store``, and the bar advances after each piece is written or filled.
    """

    def __init__(self, inner: Any, bar: Any) -> None:
        self._inner = inner
        self.bar = bar
        self.nbytes = inner.nbytes
        self.array = getattr(inner, "array", None)

    def view(self, start: int, stop: int) -> None:
        """Always None: the bytes go through :meth:`pieces` and :meth:`store`, which advance the bar."""
        return None

    def pieces(self, start: int, stop: int) -> Any:
        """The inner source's pieces of ``[start, stop)``; the bar advances after each."""
        for piece in self._inner.pieces(start, stop):
            yield piece
            self.bar.update(len(piece))

    def store(self, start: int, data: Any) -> None:
        """Store ``data`` in the inner target at byte ``start`` and advance the bar."""
        self._inner.store(start, data)
        self.bar.update(len(data))


def tracked(streams: dict[int, Any], config: Any, desc: str) -> tuple[dict[int, Any], Any]:
    """``(streams, bar)``: ``streams`` wrapped in :class:`Tracked` when a bar is shown, else as they are."""
    total = sum(s.nbytes for s in streams.values())
    if total < MIN_BYTES or not enabled(getattr(config, "progress", "auto"), getattr(config, "verbosity", 2)):
        return streams, _NoBar()
    progress_bar = for_config(config, total, desc)
    if isinstance(progress_bar, _NoBar):
        return streams, progress_bar
    return {vid: Tracked(s, progress_bar) for vid, s in streams.items()}, progress_bar
