"""Export a checkpoint to a Zarr v3 store, and import a Zarr store back as a checkpoint.

``ftidask export CKPT --to-zarr PATH`` (and :func:`export_checkpoint`) reads a committed
checkpoint from disk (any level, any backend: one FTI-FF file per rank or per Dask worker, or
level 4 written as Zarr), verifies every hash, and writes one Zarr array per protected variable
(name, dtype, shape kept; attributes: checkpoint id, level, time). How the rank files map to arrays:

* a Dask array (worker files whose variable records its chunks in ``VarInfo.extra["dask"]``:
  global ``shape``, ``chunks`` grid, and ``[grid index, chunk shape, dptr]`` per held chunk):
  one global array, chunked as the Dask array was;
* one rank file: one array per variable, at the root, named after the variable;
* several rank files whose variable records a block of a global array (``VarInfo.extra`` with
  ``global_shape`` and ``offset``, and optionally ``chunks``; ``protect(..., global_shape=, offset=)``
  on the MPI backend) that tile it exactly, in one dtype: one global array (blocks that overlap, halos, or that
  hold part of it are kept per rank, below; a malformed record or a block outside its array is a FormatError);
* several rank files whose variable is ``replicated`` (``protect(..., replicated=True)``): one array,
  from the first rank's file;
* otherwise: one group per rank, ``rank{r}/{name}``.

:func:`import_zarr` does the reverse: it starts a new run whose first checkpoint holds the
arrays of a Zarr store (an exported one, verified through its manifest, or any Zarr group).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import math
import os
import re
import reprlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.progress import for_config
from ..engine.recovery import check_file, load_file
from ..model import decomposition
from ..model.arrays import VarInfo
from ..model.config import Config
from ..model.errors import FormatError, FTIError
from ..zarrfmt import store as zarr_store
from .export_sources import Source, config_of, locate, rebuilt
from .shown import shown
from .zarr_import import import_zarr, read_zarr, run_import, store_path

__all__ = ["ExportResult", "add_export_command", "export_checkpoint", "import_zarr", "locate", "read_zarr",
           "run_export", "run_import"]

log = logging.getLogger("ftidask.zarr")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the store's ``path``, the checkpoint (``ckpt_id``, ``level``, ``nranks`` rank files), the
    ``arrays`` written (their paths in the store), ``nbytes`` of data and ``seconds``."""

    path: Path
    ckpt_id: int
    level: int
    nranks: int
    arrays: tuple[str, ...]
    nbytes: int
    seconds: float


# --- reading and assembling ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Rank:
    """One rank's verified file (or store): its variables are read one at a time, when written out."""

    rank: int
    parsed: Any
    infos: dict[int, VarInfo]
    meta: dict[str, Any]

    def read(self, vid: int) -> np.ndarray:
        """Variable ``vid`` as a new array (each container's hash is checked again as it is read)."""
        arr = self.infos[vid].empty()
        load_file(self.parsed, {vid: arr})
        return arr


def _verify_source(source: Source) -> _Rank:
    """Verify one rank's file (every hash; against its commit record when known)."""
    verdict = check_file(source.path, source.record, source.rank)
    if verdict.kind != "ok" or verdict.parsed is None:
        raise FormatError(verdict.message)
    parsed: Any = verdict.parsed
    infos = dict(parsed.vars)
    for vid, nbytes in parsed.var_nbytes().items():  # FTI 1.1 files have no table: raw bytes
        if vid not in infos:
            infos[vid] = VarInfo(vid, f"var{vid}", np.dtype(np.uint8), (nbytes,), "C", nbytes)
    meta = dict(getattr(parsed, "trailer", None) or getattr(parsed, "manifest", {}).get("attrs", {}).get("ftidask", {}))
    meta.pop("vars", None)
    return _Rank(source.rank, parsed, infos, meta)


def _keep_extra(info: VarInfo, **extra: Any) -> dict[str, Any]:
    return {**({"codec": info.extra["codec"]} if "codec" in info.extra else {}), **extra}


def _dask_global(vid: int, parts: list[tuple[_Rank, VarInfo]]) -> tuple[VarInfo, Any]:
    """A Dask array stitched from the worker files that hold its chunks: ``(info, fill)``.

    The Dask backend stores, per worker, the chunks it holds concatenated (each in C order) and
    records in ``extra["dask"]`` the global ``shape``, the ``chunks`` grid and, per held chunk,
    ``[grid index, chunk shape, dptr]``. Checked before any data is read.
    """
    first = parts[0][1]
    try:
        shape = tuple(int(n) for n in first.extra["dask"]["shape"])
        grid = [[int(c) for c in dim] for dim in first.extra["dask"]["chunks"]]
        placed = [(rank, [(tuple(int(i) for i in index), tuple(int(n) for n in cshape), int(dptr))
                          for index, cshape, dptr in info.extra["dask"].get("blocks", [])]) for rank, info in parts]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of JSON's Infinity
        raise FormatError(f"variable {vid}: bad Dask chunk record: {exc}") from None
    # The grid must tile the shape: the chunks' slices and the store's shape come from them.
    if len(grid) != len(shape) or any(n < 0 for dim in grid for n in dim) or [sum(d) for d in grid] != list(shape):
        raise FormatError(f"variable {vid}: Dask chunk grid {reprlib.repr(grid)} does not tile shape {shape}")
    starts = [[0, *itertools.accumulate(dim[:-1])] for dim in grid]  # linear: a forged grid has millions of chunks
    seen = set()
    for rank, blocks in placed:
        for index, cshape, dptr in blocks:
            nbytes = math.prod(cshape) * first.dtype.itemsize  # Python ints: a forged shape cannot wrap around
            if (len(index) != len(shape) or len(cshape) != len(shape) or index in seen or dptr < 0
                    or dptr + nbytes > rank.infos[vid].nbytes
                    or any(not 0 <= i < len(dim) or dim[i] != n for i, n, dim in zip(index, cshape, grid))):
                raise FormatError(f"variable {vid}: chunk {index} does not fit its grid or its worker's file")
            seen.add(index)
    expected = int(np.prod([len(dim) for dim in grid], dtype=np.int64))
    if len(seen) != expected:
        raise FormatError(f"variable {vid}: the worker files hold {len(seen)} of its {expected} chunks")

    def fill(z: Any) -> None:
        for rank, blocks in placed:
            raw = rank.read(vid).reshape(-1).view(np.uint8)
            for index, cshape, dptr in blocks:
                nbytes = int(np.prod(cshape, dtype=np.int64)) * first.dtype.itemsize
                chunk = raw[dptr:dptr + nbytes].view(first.dtype).reshape(cshape)
                z[tuple(slice(starts[d][i], starts[d][i] + cshape[d]) for d, i in enumerate(index))] = chunk

    nbytes = math.prod(shape) * first.dtype.itemsize
    return VarInfo(vid, first.name, first.dtype, shape, "C", nbytes, _keep_extra(first, chunks=grid)), fill


def _blocks_global(vid: int, parts: list[tuple[_Rank, VarInfo]]) -> tuple[VarInfo, Any] | None:
    """A global array from rank blocks that record ``global_shape`` and ``offset`` and tile it exactly, or None (then
    one array per rank): a rank's entry records no block, or the blocks overlap (halos), leave a hole (a rank set
    that holds part of the array) or differ in dtype. A malformed record or a block outside its array is a
    :class:`FormatError` (:func:`~ftidask.model.decomposition.placement`, as a recovery checks it): never a traceback,
    nor a store with another rank's values or zeros in it."""
    if any("global_shape" not in info.extra and "offset" not in info.extra for _r, info in parts):
        return None
    placed = {}
    for rank, info in parts:
        try:
            placed[rank.rank] = (decomposition.placement(info.extra, info.shape), info.shape)
        except FormatError as exc:
            raise FormatError(f"variable {vid}, rank {rank.rank}: {exc}") from None
    if any(p.kind != "block" for p, _s in placed.values()) or len({info.dtype for _r, info in parts}) != 1:
        return None
    try:
        decomposition.check_tiling(vid, placed)
    except FormatError:  # overlapping (halos: a restart on this layout recovers them) or partial: kept per rank
        return None
    shape = next(iter(placed.values()))[0].global_shape
    first = parts[0][1]

    def fill(z: Any) -> None:
        for rank, info in parts:
            offset = placed[rank.rank][0].offset
            z[tuple(slice(o, o + n) for o, n in zip(offset, info.shape))] = rank.read(vid)

    nbytes = math.prod(shape) * first.dtype.itemsize
    extra = _keep_extra(first, **({"chunks": first.extra["chunks"]} if "chunks" in first.extra else {}))
    return VarInfo(vid, first.name, first.dtype, shape, "C", nbytes, extra), fill


def _whole(rank: _Rank, vid: int) -> Any:
    def fill(z: Any) -> None:
        z[...] = rank.read(vid)

    return fill


def _assemble(ranks: list[_Rank]) -> list[tuple[str, VarInfo, Any]]:
    """``(array path, VarInfo, fill)`` to write: one per variable, global arrays, or a group per rank."""
    by_id: dict[int, list[tuple[_Rank, VarInfo]]] = {}
    for rank in ranks:
        for vid, info in rank.infos.items():
            by_id.setdefault(vid, []).append((rank, info))
    # Each variable's kind first: a root array may not take the name of a rank's group ("rank0": Zarr refused it)
    kinds: dict[int, tuple[str, Any]] = {}
    for vid, parts in by_id.items():
        if all(isinstance(info.extra.get("dask"), dict) for _r, info in parts):
            kinds[vid] = ("root", _dask_global(vid, parts))
        elif len(ranks) == 1 or all(info.extra.get("replicated") is True for _r, info in parts):
            rank, info = parts[0]  # one rank, or a replicated variable: every rank holds all of it
            kinds[vid] = ("root", (info, _whole(rank, vid)))
        elif (stitched := _blocks_global(vid, parts)) is not None:
            kinds[vid] = ("root", stitched)
        else:
            kinds[vid] = ("ranks", parts)
    out: list[tuple[str, VarInfo, Any]] = []
    groups = {f"rank{rank.rank}" for rank in ranks} if any(k == "ranks" for k, _v in kinds.values()) else set()
    taken: set[str] = set(groups)
    for vid, (kind, value) in kinds.items():
        if kind == "root":
            info, fill = value
            out.append((zarr_store.array_name(info, taken), info, fill))
            continue
        for rank, info in value:
            group_taken = {n.rpartition("/")[2] for n, _i, _a in out if n.startswith(f"rank{rank.rank}/")}
            out.append((f"rank{rank.rank}/{zarr_store.array_name(info, group_taken)}", info, _whole(rank, vid)))
    return out


def _newest_sound(candidates: list[list[Source]], config: Config | None = None) -> tuple[list[Source], list[_Rank]]:
    """The first of ``candidates`` (newest first) whose every rank file verifies, verified; as a recovery does,
    lost L2/L3 files rebuilt from their group first, an older one when the newest is damaged (a warning names
    what was passed over), never a mix of two."""
    reasons = []
    for sources in candidates:
        try:
            try:
                return sources, [_verify_source(source) for source in sources]
            except FormatError:
                if not rebuilt(config, sources):
                    raise
            return sources, [_verify_source(source) for source in sources]
        except FormatError as exc:
            record = sources[0].record
            what = f"checkpoint {record.ckpt_id} (level {record.level})" if record else str(sources[0].path)
            reasons.append(f"{what}: {exc}")
            if len(candidates) > 1:
                log.warning("not exporting %s", reasons[-1])
    listed = (f" {reasons[0]}" if len(reasons) == 1
              else ": no checkpoint verifies" + "".join(f"\n  - {r}" for r in reasons))
    raise FormatError(f"cannot export{listed}")


def _is_store(path: Path) -> bool:
    """Whether ``path`` is a Zarr store (a group's or an array's metadata, or an export's manifest)."""
    return path.is_dir() and any((path / name).is_file() for name in ("zarr.json", ".zgroup", ".zarray",
                                                                    zarr_store.MANIFEST))


def _one_checkpoint(sources: list[Source], ranks: list[_Rank]) -> None:
    """Refuse rank files of different runs or checkpoints, or two files of one rank, found in one directory: the
    store would join them as one checkpoint's."""
    kinds: dict[tuple[Any, ...], list[str]] = {}
    for source, rank in zip(sources, ranks, strict=True):
        key = tuple(rank.meta.get(k) for k in ("exec_id", "ckpt_id", "seq", "nranks"))
        kinds.setdefault(key, []).append(source.path.name)
    if len(kinds) > 1:
        listed = "; ".join(f"{', '.join(names)}: run {k[0]}, checkpoint {k[1]} (seq {k[2]}, {k[3]} ranks)"
                           for k, names in kinds.items())
        raise FormatError(f"the files are of different checkpoints ({listed}): export one checkpoint's directory, "
                          "or the run's config")
    seen = [s.rank for s in sources]
    if doubled := sorted({r for r in seen if seen.count(r) > 1}):
        raise FormatError(f"rank(s) {doubled} have more than one file ({', '.join(s.path.name for s in sources)}): "
                          "export one checkpoint's directory, or the run's config")


_CKPT_DIR, _LEVEL_DIR = re.compile(r"ckpt-?\d+\.s\d+"), re.compile(r"l\d|l4_archive")


def _not_over_sources(dest: Path, sources: list[Source]) -> None:
    """Refuse a destination that is, holds or lies in a file of the checkpoint exported, or lies in its run's level
    directory (``{exec_id}/l4/...``: another committed checkpoint's store, replaced by ``overwrite``)."""
    try:  # a symbolic link loop: RuntimeError on Python 3.11, OSError (ELOOP) later
        target = dest.resolve()
    except (OSError, RuntimeError) as exc:
        raise FTIError(f"export_checkpoint(dest={str(dest)!r}): the path cannot be resolved: {exc}") from None
    for source in sources:
        path = source.path.resolve()
        # a run's: .../{exec_id}/l{N}/ckpt{i}.s{q}/file (named or found from a commit record)
        in_run = source.record is not None or (_CKPT_DIR.fullmatch(path.parent.name) is not None
                                               and _LEVEL_DIR.fullmatch(path.parent.parent.name) is not None)
        level_dir = path.parent.parent if in_run else path
        if target == path or path.is_relative_to(target) or target.is_relative_to(level_dir):
            raise FTIError(f"export_checkpoint(dest={str(dest)!r}) would write over the checkpoint it exports, or "
                           f"another of its run ({source.path}): give a path outside the run's directories")


def export_checkpoint(checkpoint: str | os.PathLike[str] | Config | None, dest: str | os.PathLike[str], *,
                      exec_id: str | None = None, ckpt_id: int | None = None, level: int | None = None,
                      overwrite: bool = False, **overrides: Any) -> ExportResult:
    """Write a checkpoint as a Zarr v3 store at ``dest``; every hash is checked first.

    ``checkpoint`` is an ftidask/FTI config file (or :class:`Config`, or None with ``overrides``
    such as ``meta_dir=...``), a checkpoint directory (``.../ckpt{id}.s{seq}``) or one rank file.
    Every file is verified before the store is created (from a config, the newest checkpoint whose every
    file verifies is exported, as a recovery would load it, with a warning for those passed over);
    variables are then copied one at a time (memory: one rank's copy of one variable). The store also
    holds ``ftidask-manifest.json`` (a digest per file), so that :func:`import_zarr` and
    :func:`read_zarr` detect damage.
    """
    start = time.perf_counter()
    dest = store_path(dest, "export_checkpoint(dest=...)")
    if dest.name in ("", ".", ".."):  # the working directory, a parent: a store is a directory of its own
        raise FTIError(f"export_checkpoint(dest={str(dest)!r}) names no store: give the store's own path (x.zarr)")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True (--overwrite) to replace it")
    if overwrite and not dest.is_symlink() and dest.exists() and not _is_store(dest):
        raise FileExistsError(f"{dest} exists and is not a Zarr store: overwrite replaces a store only")
    config_for_bar = checkpoint if isinstance(checkpoint, Config) else None
    config = config_of(checkpoint, overrides)
    where = config if config is not None else checkpoint
    sources, ranks = _newest_sound(locate(where, exec_id=exec_id, ckpt_id=ckpt_id, level=level), config)
    _not_over_sources(dest, sources)
    record = sources[0].record
    if record is None:  # files named, not a commit record's: they must be one checkpoint's
        _one_checkpoint(sources, ranks)
    items = _assemble(ranks)
    first = ranks[0].meta
    ckpt = int(record.ckpt_id if record else first.get("ckpt_id", 0))
    lvl = int(record.level if record else first.get("level", 0))
    attrs = {"checkpoint_id": ckpt, "level": lvl,
             "time": record.timestamp if record else first.get("time"),
             "exec_id": first.get("exec_id"), "nranks": len(sources), "backend": first.get("backend"),
             "source": str(sources[0].path.parent), "ftidask_export": 1}
    total = sum(info.nbytes for _n, info, _f in items)
    try:
        with for_config(config_for_bar or Config(), total, "export to zarr") as bar:
            zarr_store.write_items(dest, items, attrs, progress=bar, overwrite=overwrite)
    except FileExistsError:
        raise
    except OSError as exc:  # a full disk, a lost permission: said with the store, the old one (if any) kept
        why = exc.strerror if exc.strerror and exc.filename == str(dest) else str(exc)  # the store named once
        raise FTIError(f"cannot export checkpoint {ckpt} (level {lvl}) to {dest}: {why}") from None
    result = ExportResult(dest, ckpt, lvl, len(sources), tuple(n for n, _i, _f in items), total,
                          time.perf_counter() - start)
    log.info("exported checkpoint %d (level %d, %d rank files) to %s: %d arrays, %d bytes", ckpt, lvl,
             len(sources), dest, len(items), total)
    return result


# --- command line ------------------------------------------------------------------------------------

def add_export_command(subparsers: Any) -> None:
    """Add ``export`` and ``import`` to an argparse subparsers object (the ``ftidask`` CLI)."""
    exp = subparsers.add_parser("export", help="write a checkpoint as a Zarr v3 store",
                                description="Verify a checkpoint and write it as a Zarr v3 store.")
    exp.add_argument("checkpoint", help="config file (newest checkpoint, or --id/--level), checkpoint "
                                        "directory (ckpt{id}.s{seq}) or rank file")
    exp.add_argument("--to-zarr", dest="to_zarr", required=True, metavar="PATH", help="the store to write")
    exp.add_argument("--id", dest="ckpt_id", type=int, default=None, help="checkpoint id (with a config)")
    exp.add_argument("--level", type=int, default=None, help="checkpoint level (with a config)")
    exp.add_argument("--exec-id", dest="exec_id", default=None, help="run to export (with a config)")
    exp.add_argument("--overwrite", action="store_true", help="replace PATH if it exists")
    exp.set_defaults(func=run_export)
    imp = subparsers.add_parser("import", help="start a run from a Zarr store",
                                description="Write a Zarr group's arrays as the first checkpoint of a new run.")
    imp.add_argument("store", help="the Zarr store to read")
    imp.add_argument("config", nargs="?", default=None, help="config file of the new run")
    imp.add_argument("--id", dest="ckpt_id", type=int, default=None, help="checkpoint id (default: the store's)")
    imp.add_argument("--level", type=int, default=4, help="checkpoint level (default 4)")
    imp.add_argument("--group", default="", help="group of the store to import (rank{r} of a per-rank export)")
    imp.set_defaults(func=run_import)


def run_export(args: argparse.Namespace) -> int:
    """Run ``ftidask export``; the exit code (2 on an error, as the other commands)."""
    try:
        result = export_checkpoint(args.checkpoint, args.to_zarr, exec_id=args.exec_id, ckpt_id=args.ckpt_id,
                                   level=args.level, overwrite=args.overwrite)
    except (FileExistsError, FTIError) as exc:
        print(f"ftidask: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported checkpoint {result.ckpt_id} (level {result.level}, {result.nranks} rank file(s)) to "
          f"{shown(result.path)}: {len(result.arrays)} array(s), {result.nbytes:,} bytes in {result.seconds:.2f} s")
    for name in result.arrays:  # a variable's name from the file's table: escaped, never a terminal's control
        print(f"  {shown(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ftidask.tools.zarr_export export|import ...`` (the same commands as ``ftidask``)."""
    parser = argparse.ArgumentParser(prog="python -m ftidask.tools.zarr_export")
    add_export_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (FTIError, FileExistsError, OSError) as exc:
        print(f"ftidask: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
