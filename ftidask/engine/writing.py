"""How a rank's file of a checkpoint is written: whole (compressed, or as Zarr at L4, if so
configured), differentially (the rank's :class:`~ftidask.engine.dcpstore.DcpStore`), or incrementally
(FTI's InitICP / AddVarICP / FinalizeICP, in :mod:`ftidask.engine.icp`).

A mixin of :class:`ftidask.Context` (it provides ``config``, ``transport``, ``paths``, ``_vars``).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..ftiff import blockhash, compression
from ..ftiff.layout import Layout
from ..model.arrays import ArrayBytes, VarInfo
from .checkpointing import CheckpointInfo, write_rank_file
from .dcpstore import DcpStore
from .progress import Tracked, tracked


class WritingMixin:
    """Writers of a rank's checkpoint file, and the incremental-checkpoint API."""

    config: Any
    transport: Any
    paths: Any
    _vars: dict[int, Any]
    _dcp: Any
    _pool: ThreadPoolExecutor | None
    _hash_id: int
    _var_extras: Any

    def _dcp_store(self) -> DcpStore:
        """This rank's differential-checkpoint files (created on first use)."""
        if self._dcp is None:
            t = self.transport
            self._dcp = DcpStore(self.paths, t.rank, t.node, block_size=self.config.dcp_block_size,
                                 bid=blockhash.block_hash_id(self.config.dcp_mode), hash_id=self._hash_id,
                                 track_pages=self.config.dcp_page_tracking)
        return self._dcp

    # --- incremental checkpointing (FTI_InitICP / AddVarICP / FinalizeICP) -------------------------

    def init_icp(self, id: int, level: int) -> None:
        """FTI_InitICP: open checkpoint ``id``; add each protected variable with :meth:`add_var_icp`."""
        from .icp import init_icp

        init_icp(self, id, level)

    def add_var_icp(self, var_id: int) -> None:
        """FTI_AddVarICP: write protected variable ``var_id`` into the open checkpoint now."""
        from .icp import add_var_icp

        add_var_icp(self, var_id)

    def finalize_icp(self) -> CheckpointInfo:
        """FTI_FinalizeICP: commit the open checkpoint (refused if a protected variable is missing)."""
        from .icp import finalize_icp

        return finalize_icp(self)

    def _abort_icp(self) -> None:
        """Drop the open incremental checkpoint without committing it (the previous one stays)."""
        from .icp import abort_icp

        abort_icp(self)

    def incremental(self, id: int, level: int) -> Any:
        """``with ctx.incremental(id, level) as icp: icp.add(var_id)``: iCP as a context manager."""
        from .icp import Incremental

        return Incremental(self, id, level)

    def _write_zarr_l4(self, path: Path, layout: Layout, arrays: Mapping[int, ArrayBytes], infos: list[VarInfo],
                       *, meta: Mapping[str, Any], **_ignored: Any) -> Any:
        """Level 4 as a Zarr store (``l4_format = zarr``), in place of the FTI-FF file."""
        from . import zarr_l4

        bar = next((a.bar for a in arrays.values() if isinstance(a, Tracked)), None)
        return zarr_l4.write_rank_store(path.with_suffix(zarr_l4.SUFFIX), {vid: a.array for vid, a in arrays.items()},
                                        infos, meta, progress=bar)

    def _codecs(self) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Per variable to compress: ``(numcodecs codec, its JSON config)``."""
        default = compression.parse_compressor(self.config.compressor)
        out = {}
        for vid, p in self._vars.items():
            config = p.compressor if p.compressor is not None else default
            if config is not None and config.get("id") != "none" and p.array.nbytes:
                out[vid] = (compression.get_codec(config), config)
        return out

    def _write_full(self, ckpt_id: int, level: int, path: Path, layout: Layout, *, meta: Mapping[str, Any],
                    pt_fs: int | None, max_fs: int | None) -> Any:
        """Write this rank's whole file of a level 1-4 checkpoint (compressed, or as Zarr at L4, if so configured)."""
        zarr_l4 = level == 4 and self.config.l4_format == "zarr"
        codecs = self._codecs()
        extras = self._var_extras()
        infos = [VarInfo.of(vid, p.name, p.array, **({"codec": codecs[vid][1]} if vid in codecs else {}),
                            **extras.get(vid, {})) for vid, p in self._vars.items()]
        write = self._write_zarr_l4 if zarr_l4 else write_rank_file
        streams, bar = tracked({vid: ArrayBytes(p.array) for vid, p in self._vars.items()}, self.config,
                               f"checkpoint {ckpt_id} (L{level})")
        with bar:
            return write(
                path, layout, streams, infos,
                codecs={vid: (codec, self._vars[vid].array.dtype.itemsize) for vid, (codec, _c) in codecs.items()},
                hash_id=self._hash_id, pool=self._hash_pool(), pt_fs=pt_fs, max_fs=max_fs, meta=meta)

    def _hash_pool(self) -> ThreadPoolExecutor:
        # One long-lived thread hashes a container while the caller writes it.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftidask-hash")
        return self._pool
