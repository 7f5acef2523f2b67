"""How the ``ftidask`` commands print what they read from files and directories: names and paths that hold a
character a terminal would obey (an escape sequence, a newline, a carriage return) are printed escaped, never raw.

A forged variable table, a planted file name or a run directory's name could otherwise clear the screen, retitle the
terminal or fake lines of a listing. The rule is the one ``list`` follows for a run's name (Python's :func:`ascii`):
printable text, accents and all, is printed as it is.
"""

from __future__ import annotations

import os


def shown(text: str | os.PathLike[str]) -> str:
    """A name or path as the CLI prints it: as it is when every character is printable, else :func:`ascii` of it
    (quoted, every non-ASCII or control character escaped), so that an escaped one is told from a real one."""
    value = os.fspath(text)
    return value if value.isprintable() else ascii(value)


def shown_message(message: str) -> str:
    """A message (a verdict, a reason) that quotes names and paths from files, on one line with every character
    that is not printable escaped (as :func:`ascii` escapes it); the rest of the message is left as it is."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
