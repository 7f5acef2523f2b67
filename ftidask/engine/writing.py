"""How a rank's file of a checkpoint is written: whole (compressed, or as Zarr at L4, if so
configured), differentially (the rank's :class:`~ftidask.engine.dcpstore.DcpStore`), or incrementally
(FTI's InitICP / AddVarICP / FinalizeICP, in :mod:`ftidask.engine.icp`).

:class:`Writer` is owned by :class:`ftidask.Context`; it reads the context's protected variables
(the same dict, so that ``protect`` is seen at once) and owns the hashing thread.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..ftiff import blockhash, compression
from ..ftiff.layout import Layout
from ..model.arrays import ArrayBytes, VarInfo
from ..model.config import Config
from ..storage.files import RunPaths
from ..transport.base import Transport
from .checkpointing import write_rank_file
from .dcpstore import DcpStore
from .progress import Tracked, tracked
from .variables import Protected, var_extras


class Writer:
    """Writers of a rank's checkpoint file."""

    def __init__(self, config: Config, transport: Transport, paths: RunPaths, variables: Mapping[int, Protected],
                 hash_id: int) -> None:
        self.config = config
        self.transport = transport
        self.paths = paths
        self.variables = variables
        self.hash_id = hash_id
        self.pool: ThreadPoolExecutor | None = None
        self._sync: ThreadPoolExecutor | None = None  # see sync_pool
        #: byte sources to read some variables through instead of their arrays (a copy-on-write snapshot's)
        self.sources: Mapping[int, Any] = {}

    def new_dcp_store(self) -> DcpStore:
        """This rank's differential-checkpoint files (the context keeps the one it makes)."""
        t = self.transport
        return DcpStore(self.paths, t.rank, t.node, block_size=self.config.dcp_block_size,
                        bid=blockhash.block_hash_id(self.config.dcp_mode), hash_id=self.hash_id,
                        track_pages=self.config.dcp_page_tracking)

    def write_zarr_l4(self, path: Path, layout: Layout, arrays: Mapping[int, ArrayBytes], infos: list[VarInfo],
                      *, meta: Mapping[str, Any], **_ignored: Any) -> Any:
        """Level 4 as a Zarr store (``l4_format = zarr``), in place of the FTI-FF file."""
        from . import zarr_l4

        bar = next((a.bar for a in arrays.values() if isinstance(a, Tracked)), None)
        return zarr_l4.write_rank_store(path.with_suffix(zarr_l4.SUFFIX), {vid: a.array for vid, a in arrays.items()},
                                        infos, meta, progress=bar)

    def codecs(self) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Per variable to compress: ``(numcodecs codec, its JSON config)``."""
        default = compression.parse_compressor(self.config.compressor)
        out = {}
        for vid, p in self.variables.items():
            config = p.compressor if p.compressor is not None else default
            if config is not None and config.get("id") != "none" and p.array.nbytes:
                out[vid] = (compression.get_codec(config), config)
        return out

    def write_full(self, ckpt_id: int, level: int, path: Path, layout: Layout, *, meta: Mapping[str, Any],
                   pt_fs: int | None, max_fs: int | None, durable: bool = True) -> Any:
        """Write this rank's whole file of a level 1-4 checkpoint (compressed, or as Zarr at L4, if so configured);
        ``durable=False``: an FTI-FF file is renamed before the disk has it all (the caller makes it durable)."""
        zarr_l4 = level == 4 and self.config.l4_format == "zarr"
        codecs = self.codecs()
        extras = var_extras(self.variables)
        variables = self.variables
        if zarr_l4:
            infos: list[Any] = [VarInfo.of(vid, p.name, p.array, **({"codec": codecs[vid][1]} if vid in codecs else {}),
                                           **extras.get(vid, {})) for vid, p in variables.items()]
        else:  # the table's JSON straight away, no VarInfo per variable (thousands at each checkpoint)
            json_of = VarInfo.json_of
            infos = [json_of(vid, p.name, p.array, {"codec": codecs[vid][1], **extras.get(vid, {})} if vid in codecs
                             else extras.get(vid)) for vid, p in variables.items()]
        # A checkpoint's file, which its commit record names once written: renamed first, then synced at once.
        direct = durable and self.config.direct_writes(level)
        write = self.write_zarr_l4 if zarr_l4 else functools.partial(write_rank_file, durable=durable,
                                                                     sync_pool=self.sync_pool(), direct=direct)
        sources = self.sources
        streams, bar = tracked({vid: ArrayBytes(p.array) if (s := sources.get(vid)) is None else s
                                for vid, p in variables.items()}, self.config, f"checkpoint {ckpt_id} (L{level})")
        with bar:
            return write(
                path, layout, streams, infos,
                codecs={vid: (codec, variables[vid].array.dtype.itemsize) for vid, (codec, _c) in codecs.items()},
                hash_id=self.hash_id, pool=self.hash_pool(), pt_fs=pt_fs, max_fs=max_fs, meta=meta)

    def hash_pool(self) -> ThreadPoolExecutor:
        """One long-lived thread that hashes a container while the caller writes it."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")
        return self.pool

    def sync_pool(self) -> ThreadPoolExecutor:
        """Two long-lived threads that fsync a rank file's directories while the caller fsyncs the file."""
        if self._sync is None:
            self._sync = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ftidask-fsync")
        return self._sync

    def close(self) -> None:
        """Wait for the hashing and fsync threads and stop them."""
        for pool in (self.pool, self._sync):
            if pool is not None:
                pool.shutdown(wait=True)
        self.pool = self._sync = None
