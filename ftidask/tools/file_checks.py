"""How the ``ftidask`` commands find and check checkpoint files: FTI-FF files, L3 parity files and Zarr stores
under a directory, each one's verdict, and a run's config file checked before it is read.

Separate from :mod:`ftidask.tools.cli` (the parser and the commands) because ``verify`` and ``list`` share it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..ftiff.filekind import is_config_file
from ..ftiff.reader import parse_ftiff, verify_data
from ..model.config import Config, load_config
from ..model.errors import ConfigError, FormatError, FTIError
from ..storage.files import find_paths, open_read
from ..storage.removal import TRASH_PREFIX
from .fti_files_cli import fti_parity_problem

#: The manifest of an ftidask Zarr store (``ftidask.zarrfmt.store.MANIFEST``; named here, where Zarr is not imported).
MANIFEST = "ftidask-manifest.json"
#: The name ftidask gives a rank's store of a level-4 checkpoint written as Zarr (``l4_format = zarr``).
_L4_STORE = re.compile(r"Ckpt\d+-Rank\d+\.zarr")


def check_config_file(path: str | os.PathLike[str]) -> None:
    """Raise :class:`ConfigError` unless ``path`` is an existing text (INI) file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {os.fspath(path)!r} does not exist")
    if p.is_dir():
        raise ConfigError(f"config file {os.fspath(path)!r} is a directory; pass the INI file (e.g. config.fti)")
    if not is_config_file(p):
        raise ConfigError(f"config file {os.fspath(path)!r} is not a text (INI) file: it is binary "
                          "(a checkpoint file?); pass the run's config")


def verdict_of(path: Path) -> tuple[str, object]:
    """``("ok", parsed)`` or ``("damaged", message)`` for one FTI-FF file (or ftidask Zarr store)."""
    if path.suffix == ".zarr" or is_store(path):  # a store is told by its content: export writes to any PATH
        from ..zarrfmt.store import verify_store

        if not os.path.lexists(path / MANIFEST):  # nothing to check its files against: never taken as sound
            return "damaged", (f"{path}: no {MANIFEST}: a checkpoint's or an export's store that lost it, or a Zarr "
                               "group ftidask did not write; its files cannot be checked")
        try:
            return "ok", verify_store(path)
        except (FormatError, OSError) as exc:
            return "damaged", str(exc)
    try:
        with open_read(path) as fh:
            parsed = parse_ftiff(fh, str(path))
            verify_data(fh, parsed)
        return "ok", parsed
    except (FormatError, OSError) as exc:
        if "not an FTI-FF file" in str(exc):  # no metadata of its own: maybe FTI's POSIX I/O, checked with its meta
            what = ("FTI's POSIX dCP file (ckpt_io = 1)" if path.name.startswith("dcp-id") else "FTI's MPI-IO file "
                    "(ckpt_io = 2)" if path.name.endswith("-mpiio.fti") else "a file of FTI's POSIX I/O (ckpt_io = 1)")
            return "damaged", f"{exc}; {what} is checked with its meta file: verify PATH --meta META_DIR"
        return "damaged", str(exc)


def ftiff_files(root: Path) -> list[Path]:
    # Parity files (Ckpt*-RSed*, dCP's SpareRSed-*) are not FTI-FF: `verify` checks them against their .hash record.
    # A config named config.fti (FTI's examples) is told apart by its content.
    return [p for p in find_paths(root, "*.fti")  # FTI's POSIX dCP files are not FTI-FF: list_dcp_files shows them
            if "RSed" not in p.name and not p.name.startswith((".", "dcp-id")) and not _in_trash(root, p)
            and not is_config_file(p)]


def parity_files(root: Path) -> list[Path]:
    return [p for p in find_paths(root, "*RSed*.fti") if not p.name.startswith(".") and not _in_trash(root, p)]


def _in_trash(root: Path, path: Path) -> bool:
    """Whether ``path`` lies in a retired checkpoint's directory (``.trash-*``, being deleted): it was listed as a
    checkpoint "not committed", or DAMAGED when deleted while it was checked."""
    return any(part.startswith(TRASH_PREFIX) for part in path.relative_to(root).parts[:-1])


def parity_verdict(path: Path) -> tuple[str, object]:
    from ..levels.rs import check_parity, hash_path

    problem = check_parity(path) if hash_path(path).exists() else fti_parity_problem(path)
    return ("damaged", problem) if problem else ("ok", None)


def whole_file_problem(path: Path) -> str:
    """A rank file of an L3 checkpoint against the whole-file hash its group's parity records keep ('' if none)."""
    from ..levels.rs import file_hash, recorded

    for parity in sorted(path.parent.glob(f"{path.name.split('-Rank')[0]}-RSed*.fti")):
        info = recorded(parity)
        want = info["file_hashes"].get(path.name) if info else None
        if want:
            try:
                same = file_hash(path, int(info["hash_id"])) == want  # type: ignore[index]
            except (OSError, FTIError) as exc:
                return f"{path}: {exc}"
            return "" if same else (f"{path}: does not match the whole-file hash its L3 parity records keep (a byte "
                                    "changed where its own hashes do not look: a container's slack); its variables "
                                    "read back, but L3 rebuilds no other file from it")
    return ""


def load_checked_config(path: str | os.PathLike[str]) -> Config:
    check_config_file(path)
    return load_config(path)


def table_of(detail: object) -> dict:
    """The checkpoint's description: an FTI-FF file's variable table, or a Zarr store's attributes."""
    if isinstance(detail, dict):  # a verified Zarr store's manifest
        return dict(detail.get("attrs", {}).get("ftidask", {}))
    return dict(getattr(detail, "trailer", None) or {})


def is_store(path: Path) -> bool:
    """Whether ``path`` is a Zarr store, by its content (any name: ``export`` writes to any PATH): a directory
    holding ftidask's manifest, or a Zarr group's or array's metadata."""
    return path.is_dir() and any(os.path.lexists(path / name) for name in (MANIFEST, "zarr.json", ".zgroup", ".zarray"))


def _checkpoint_store(path: Path) -> bool:
    """Whether a directory found under a directory being checked is a store that must verify: one holding ftidask's
    manifest (any name), or one that lost it but is a checkpoint's by its look: named as ftidask names a rank's
    level-4 store, or a ``*.zarr`` Zarr store. (A Zarr group of another name without the manifest is not ftidask's.)"""
    if not path.is_dir():
        return False
    if os.path.lexists(path / MANIFEST) or _L4_STORE.fullmatch(path.name):
        return True
    return path.suffix == ".zarr" and is_store(path)


def zarr_stores(root: Path) -> list[Path]:
    """The Zarr stores under directory ``root`` that ``verify`` and ``list`` check (see :func:`_checkpoint_store`),
    sorted; a store's own groups and arrays are not stores of their own, and hidden directories (a retired
    checkpoint's ``.trash-*``, an export's temporary ``.NAME.tmp-*``) are passed over, as for FTI-FF files."""
    found = []
    for dirpath, dirnames, _files in os.walk(root):  # os.walk ignores errors: a directory deleted meanwhile
        inner = []
        for name in dirnames:
            path = Path(dirpath, name)
            if name.startswith("."):
                continue
            if _checkpoint_store(path):
                found.append(path)  # not walked into: its groups hold Zarr metadata too
            else:
                inner.append(name)
        dirnames[:] = inner
    return sorted(found)

