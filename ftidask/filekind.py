"""Tell a config file from a checkpoint file by its content, not its name.

FTI names its rank files ``Ckpt{id}-Rank{r}.fti`` and its examples name the config ``config.fti``:
the suffix says nothing. A checkpoint (FTI-FF) is binary: ftidask's carry the magic ``FTDK`` at
byte 49 of the file block, FTI 1.1's start with a NUL-terminated hex digest. A config is an INI
text file: no NUL byte, valid UTF-8.
"""

from __future__ import annotations

import os

from .ftiff.structs import MAGIC

_SNIFF = 4096  # enough to see a NUL in any FTI-FF file block (96 bytes) and an INI's first lines


def is_config_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that reads as a text (INI) file rather than an FTI-FF file."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF)
    except OSError:  # a directory, missing, unreadable: not a config file
        return False
    if head[49:49 + len(MAGIC)] == MAGIC or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut by the 4 KiB window is still text.
        return exc.start >= len(head) - 3 and len(head) == _SNIFF
    return True
