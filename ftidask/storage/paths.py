"""The names of a run's directories and files, as FTI names them, and the check that a path lies inside another.

Node-local files live under ``{ckpt_dir}/node{N}/{exec_id}/l1|l2|l3``, global ones under
``{glbl_dir}/{exec_id}/l4``, run state under ``{meta_dir}/{exec_id}``. Each checkpoint has its own
directory ``ckpt{id}.s{seq}`` (``seq`` grows with every checkpoint), so that reusing a checkpoint id
never overwrites the checkpoint that is still the newest committed one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The directories of one run (``exec_id``) as seen from one node."""

    ckpt_dir: Path
    glbl_dir: Path
    meta_dir: Path
    exec_id: str

    def node_dir(self, node: int) -> Path:
        """Node ``node``'s directory of this run, ``{ckpt_dir}/node{N}/{exec_id}``."""
        return self._dir(("node", node), lambda: self.ckpt_dir / f"node{node}" / self.exec_id)

    def level_dir(self, level: int, node: int) -> Path:
        """Where a level-``level`` checkpoint's files live (global for L4)."""
        if level == 4:
            return self._dir(("l4",), lambda: self.glbl_dir / self.exec_id / "l4")
        return self.local_dir(level, node)

    def local_dir(self, level: int, node: int) -> Path:
        """Node-local directory of a level (L4 keeps its local copy under ``l4``)."""
        return self._dir(("local", level, node), lambda: self.node_dir(node) / f"l{level}")

    def _dir(self, key: tuple[Any, ...], make: Callable[[], Path]) -> Path:
        # Made once each: a checkpoint asks for these paths dozens of times, and a pathlib join costs microseconds.
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = make()
        return made

    @functools.cached_property
    def _made(self) -> dict[tuple[Any, ...], Path]:
        return {}

    @property
    def l4_archive(self) -> Path:
        """Where ``keep_l4_ckpt`` leaves the level-4 checkpoints at finalize (FTI's ``l4_archive``)."""
        return self.glbl_dir / self.exec_id / "l4_archive"

    @property
    def run_meta(self) -> Path:
        """The run's state directory, ``{meta_dir}/{exec_id}``."""
        return self.meta_dir / self.exec_id

    @property
    def stage_root(self) -> Path:
        """The run's stage directories' root, ``{ckpt_dir}/stage/{exec_id}``."""
        return self.ckpt_dir / "stage" / self.exec_id

    def contains(self, path: Path) -> bool:
        """Whether ``path`` lies inside this run's directories (lexically: node directories may be links
        to local disks); what a run deletes is checked with it."""
        roots = self._roots
        if roots is None:  # relative: each call resolves them against the working directory of the moment
            return any(is_inside(path, root, resolve=False) for root in (self.ckpt_dir, self.glbl_dir, self.meta_dir))
        return os.path.normpath(os.path.abspath(path)).startswith(roots)

    @functools.cached_property
    def _roots(self) -> tuple[str, ...] | None:
        # Normalised once (a checkpoint checks a dozen paths); only absolute ones, which no chdir changes.
        roots = (self.ckpt_dir, self.glbl_dir, self.meta_dir)
        if not all(os.path.isabs(root) for root in roots):
            return None
        return tuple(_prefix(root) for root in roots)


def ckpt_dirname(ckpt_id: int, seq: int) -> str:
    """A checkpoint's directory: its id and its sequence number, so that reusing an id never overwrites one."""
    return f"ckpt{ckpt_id}.s{seq}"


def rank_file(ckpt_id: int, rank: int) -> str:
    """Rank ``rank``'s own file (FTI's name)."""
    return f"Ckpt{ckpt_id}-Rank{rank}.fti"


#: Where a level keeps the spares of differential checkpoints, beside its checkpoint directories.
SPARE_DIR = "dcp"


def spare_file(rank: int, kind: str = "") -> str:
    """A spare of differential checkpointing: rank ``rank``'s own file (``kind`` ""), the partner
    copy it holds ("Pcof", L2), its parity ("RSed", L3), or the file written in full beside the spare
    after a recovery from it ("Next")."""
    return f"Spare{kind}-Rank{rank}.fti"


def partner_file(ckpt_id: int, rank: int) -> str:
    """Kept on rank ``rank``'s node: the copy of its partner's file (FTI's ``Pcof``)."""
    return f"Ckpt{ckpt_id}-Pcof{rank}.fti"


def parity_file(ckpt_id: int, rank: int) -> str:
    """Rank ``rank``'s Reed-Solomon parity (FTI's ``RSed``)."""
    return f"Ckpt{ckpt_id}-RSed{rank}.fti"


def is_inside(path: str | os.PathLike[str], parent: str | os.PathLike[str], *, resolve: bool = True) -> bool:
    """Whether ``path`` lies strictly inside ``parent``: after making both absolute and removing ``..``
    and, with ``resolve``, also once every symbolic link is resolved (a link to elsewhere is outside)."""
    inside = os.path.normpath(os.path.abspath(path)).startswith(_prefix(parent))
    return inside and (not resolve or os.path.realpath(path).startswith(_prefix(os.path.realpath(parent))))


def _prefix(root: str | os.PathLike[str]) -> str:
    """What every path strictly inside directory ``root`` starts with: its normalised absolute form and a separator
    (a sibling sharing the name's prefix, ``/a/bc`` for ``/a/b``, is outside)."""
    return os.path.normpath(os.path.abspath(root)).rstrip(os.sep) + os.sep


def find_paths(root: str | os.PathLike[str], pattern: str) -> list[Path]:
    """Files and directories under ``root`` whose path matches ``pattern`` (right-anchored, as
    :meth:`pathlib.PurePath.match`), sorted. Unlike ``Path.rglob``, a directory that disappears
    during the walk (a retired checkpoint deleted in the background) is skipped, not an error."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk ignores errors by default
        found += [Path(dirpath, name) for name in dirnames + filenames if Path(dirpath, name).match(pattern)]
    return sorted(found)
