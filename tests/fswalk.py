"""Finding files under a checkpoint directory while ftidask may be deleting others there.

``Path.rglob`` raises ``FileNotFoundError`` when a directory disappears during the walk, and
retired checkpoints are deleted in the background (renamed to ``.trash-*`` first): tests that
look for files while a context is live use :func:`find` instead, which skips what vanished.
"""

from __future__ import annotations

import os
from pathlib import Path


def find(root: str | os.PathLike[str], pattern: str) -> list[Path]:
    """Every file or directory under ``root`` whose path matches ``pattern`` (right-anchored,
    as :meth:`pathlib.PurePath.match`), sorted; directories deleted meanwhile are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk ignores errors by default
        found += [Path(dirpath, name) for name in dirnames + filenames if Path(dirpath, name).match(pattern)]
    return sorted(found)
