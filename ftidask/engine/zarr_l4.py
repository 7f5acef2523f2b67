"""Level 4 written as Zarr (``[advanced] l4_format = zarr``): the global copy opens in the PyData stack.

Each rank writes ``Ckpt{id}-Rank{r}.zarr`` (a Zarr v3 group, one array per protected variable)
where the FTI-FF file would be, in the same checkpoint directory under ``{glbl_dir}/{exec_id}/l4``.
The store carries a hash manifest (:mod:`ftidask.zarrfmt.store`) whose digest goes into the
commit record in place of the file block hash, so recovery verifies every byte as for FTI-FF.
FTI's ``ckpt_io`` stays 3: the other levels still write FTI-FF files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..ftiff.layout import Layout
from ..model.arrays import VarInfo
from ..model.errors import FormatError
from ..zarrfmt import store as zarr_store

SUFFIX = ".zarr"
FORMAT = "zarr"  # value of CommitRecord.extra["l4_format"]


def store_name(ckpt_id: int, rank: int) -> str:
    """Rank ``rank``'s store in a checkpoint directory (FTI's file name, ``.zarr`` suffix)."""
    return f"Ckpt{ckpt_id}-Rank{rank}{SUFFIX}"


@dataclasses.dataclass(frozen=True)
class _Digest:
    hash: bytes


@dataclasses.dataclass(frozen=True)
class WrittenStore:
    """What was written (the fields the engine reads from an FTI-FF ``WrittenFile``)."""

    fb: _Digest
    file_size: int
    data_bytes: int


def write_rank_store(path: Path, arrays: Mapping[int, np.ndarray], infos: list[VarInfo],
                     meta: Mapping[str, Any], *, progress: Any = None) -> WrittenStore:
    """Write one rank's level-4 checkpoint as a Zarr store at ``path`` (atomically)."""
    attrs = {"ftidask": {k: v for k, v in meta.items()}, "checkpoint_id": meta.get("ckpt_id"),
             "level": meta.get("level"), "time": meta.get("time")}
    digest, size = zarr_store.write_store(path, arrays, infos, attrs, progress=progress, private=True)
    return WrittenStore(_Digest(bytes.fromhex(digest)), size, sum(a.nbytes for a in arrays.values()))


def flush_file(parsed: Any, path: Path, seq: int) -> WrittenStore:
    """Copy a verified FTI-FF rank file (``keep_last_ckpt`` at finalize) into a level-4 Zarr store."""
    from .recovery import load_file

    if not parsed.vars:
        raise FormatError(f"{parsed.path}: no variable table (FTI 1.1 file): cannot write it as Zarr")
    arrays = {vid: info.empty() for vid, info in parsed.vars.items()}
    load_file(parsed, arrays)
    meta = {k: v for k, v in (parsed.trailer or {}).items() if k != "vars"}
    meta.update(level=4, seq=seq)
    return write_rank_store(path, arrays, list(parsed.vars.values()), meta)


@dataclasses.dataclass(frozen=True)
class ZarrRankStore:
    """A verified rank store: what recovery needs from it (as from a parsed FTI-FF file)."""

    path: str
    manifest: dict[str, Any]
    vars: dict[int, VarInfo]
    names: dict[int, str]
    legacy: bool = False  # (as FtiffFile's: staged reads, pagemove.stager, take any store)
    #: var id -> its array as checked (:func:`open_store`), read a region at a time (:func:`read_region`)
    arrays: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def var_nbytes(self) -> dict[int, int]:
        """Bytes held per variable id (as :meth:`FtiffFile.var_nbytes`)."""
        return {vid: info.nbytes for vid, info in self.vars.items()}

    def layout(self) -> Layout | None:
        """No FTI-FF layout: the next FTI-FF checkpoint plans its containers afresh."""
        return None


def check_store(path: Path, record: Any, rank: int, stage: Any = None) -> Any:
    """Verify a rank store against the commit record; a recovery Verdict.

    ``stage``: as :func:`~ftidask.engine.recovery.check_file`'s: the variables read into staged pages while the
    store is verified (each stored byte read once), held by the verdict."""
    from .pagemove import release_all
    from .recovery import Verdict

    expected = None
    if record is not None:
        entry = next((f for f in record.files if f.rank == rank), None)
        if entry is None:
            return Verdict("damaged", f"{path}: rank {rank} is not in checkpoint {record.ckpt_id}")
        expected = entry.fb_hash
    if not path.is_dir():
        return Verdict("damaged", f"{path}: missing")
    from ..zarrfmt.verify import open_checked, verify_arrays

    staged: dict[int, Any] = {}
    try:
        manifest, arrays = open_checked(path, expected)
        parsed = _rank_store(path, manifest, arrays)
        staged = stage(parsed) if stage is not None else {}
        into = {vid: np.frombuffer(s.view, parsed.vars[vid].dtype).reshape(parsed.vars[vid].shape)
                for vid, s in staged.items()}
        verify_arrays(path, manifest, arrays, into)  # every array of the store, not only the variables
    except (FormatError, OSError) as exc:
        release_all(staged)
        return Verdict("damaged", str(exc))
    except BaseException:
        release_all(staged)
        raise
    return Verdict("ok", parsed=parsed, staged=staged)  # type: ignore[arg-type]


def open_store(path: Path, record: Any, rank: int) -> ZarrRankStore:
    """A rank store of ``record`` checked for a read of some regions (:func:`read_region`): its manifest against the
    record, its files' sizes and metadata, its arrays' chunk grids; no chunk is read (:class:`FormatError`)."""
    from ..zarrfmt.verify import open_checked

    entry = next((f for f in record.files if f.rank == rank), None)
    if entry is None:
        raise FormatError(f"{path}: rank {rank} is not in checkpoint {record.ckpt_id}")
    if not path.is_dir():
        raise FormatError(f"{path}: missing")
    return _rank_store(path, *open_checked(path, entry.fb_hash))


def _rank_store(path: Path, manifest: dict[str, Any], arrays: Mapping[str, Any]) -> ZarrRankStore:
    """The rank store :func:`~ftidask.zarrfmt.verify.open_checked` opened (its manifest, its arrays by name)."""
    table = zarr_store.store_vars(manifest, path)
    return ZarrRankStore(str(path), manifest, {vid: info for vid, (info, _n) in table.items()},
                         {vid: name for vid, (_i, name) in table.items()},
                         arrays={vid: arrays[name] for vid, (_i, name) in table.items()})


def read_region(parsed: ZarrRankStore, vid: int, src: tuple[slice, ...], out: np.ndarray) -> None:
    """Read the region ``src`` of variable ``vid`` of a store :func:`open_store` gave into ``out`` (its shape): only
    the chunks that hold part of it, each checked against its digest before it is decoded (:class:`FormatError`)."""
    from ..zarrfmt.verify import fill

    z = parsed.arrays[vid].array
    if np.dtype(z.dtype) == out.dtype:
        fill(Path(parsed.path), parsed.names[vid], z, out, src)
    else:  # the stored byte order or a subclass's: through a buffer of the array's
        buf = np.empty(out.shape, z.dtype)
        fill(Path(parsed.path), parsed.names[vid], z, buf, src)
        out[...] = buf


def check_region(parsed: ZarrRankStore, vid: int, src: tuple[slice, ...]) -> None:
    """Read, check and decode the chunks that hold the region ``src`` of variable ``vid`` (:class:`FormatError` when
    one does not match its digest or does not decode), keeping nothing: before :func:`read_region` reads them into an
    array in use, once every rank agreed."""
    from ..zarrfmt.verify import check_chunks

    check_chunks(Path(parsed.path), parsed.names[vid], parsed.arrays[vid].array, src)


def load_store(parsed: ZarrRankStore, arrays: Mapping[int, np.ndarray]) -> None:
    """Fill ``arrays`` (size-checked) from a verified store; each chunk is checked again as it is read."""
    for vid in arrays:
        if vid not in parsed.vars:
            raise FormatError(f"{parsed.path}: variable {vid} is not in the store")
    zarr_store.read_into(Path(parsed.path), parsed.manifest, arrays)
