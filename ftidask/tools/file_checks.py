"""How the ``ftidask`` commands find and check checkpoint files: FTI-FF files, L3 parity files and Zarr stores
under a directory, each one's verdict, and a run's config file checked before it is read.

Separate from :mod:`ftidask.tools.cli` (the parser and the commands) because ``verify`` and ``list`` share it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..ftiff.filekind import is_config_file
from ..ftiff.reader import parse_ftiff, verify_data
from ..model.config import Config, load_config
from ..model.errors import ConfigError, FormatError, FTIError
from ..storage.files import find_paths, open_read
from ..storage.removal import TRASH_PREFIX
from .fti_files_cli import fti_parity_problem


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
    if path.suffix == ".zarr":
        from ..zarrfmt.store import verify_store

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


def zarr_stores(root: Path) -> list[Path]:
    return [p for p in find_paths(root, "*.zarr") if (p / "ftidask-manifest.json").is_file()]

