"""Tell a config file from a checkpoint file by its content, not its name.

FTI names its rank files ``Ckpt{id}-Rank{r}.fti`` and its examples name the config ``config.fti``:
the suffix says nothing. A checkpoint (FTI-FF) is binary: ftidask's carry the magic ``FTDK`` at
byte 49 of the file block, FTI 1.1's start with a NUL-terminated hex digest, later FTI's end with
their file metadata (which may follow a text variable's bytes: it is checked by its hash). A config is an INI
text file: no NUL byte, valid UTF-8.
"""

from __future__ import annotations

import os
import re

from ..storage.files import open_read
from .structs import MAGIC
from .tailmeta import TAIL_FB_SIZE, sniff

#: The names of FTI-FF files (own, partner copy, parity, spares): never a config, whatever is left
#: in them (a file truncated to nothing is a damaged checkpoint, not an empty config).
_CHECKPOINT_NAME = re.compile(r"(Ckpt-?\d+-(Rank|Pcof|RSed)\d+|Ckpt\d+-mpiio|Spare\w*-Rank\d+|dcp-id\d+-rank\d+"
                              r"|dCPFile-Rank\d+)\.fti")
_SNIFF = 4096  # enough to see a NUL in any FTI-FF file block (96 bytes) and an INI's first lines


def is_config_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that reads as a text (INI) file rather than an FTI-FF file."""
    if _CHECKPOINT_NAME.fullmatch(os.path.basename(os.fspath(path))):
        return False
    try:
        with open_read(path) as fh:
            head = fh.read(_SNIFF)
            size = os.fstat(fh.fileno()).st_size
            tail = os.pread(fh.fileno(), TAIL_FB_SIZE, size - TAIL_FB_SIZE) if size >= TAIL_FB_SIZE else b""
    except OSError:  # a directory, missing, unreadable: not a config file
        return False
    if sniff(tail):
        return False
    if not head or head[49:49 + len(MAGIC)] == MAGIC or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut by the 4 KiB window is still text.
        return exc.start >= len(head) - 3 and len(head) == _SNIFF
    return True
