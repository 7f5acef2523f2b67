"""What a Dask checkpoint reports: a :class:`CheckpointInfo` with workers, files and variables,
readable as text and as HTML in Jupyter."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from ...engine.checkpointing import CheckpointInfo

_LEVEL_NAMES = {1: "L1 local", 2: "L2 partner copy", 3: "L3 Reed-Solomon", 4: "L4 global"}


def human(nbytes: float) -> str:
    """``nbytes`` as B/KiB/MiB/GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


@dataclasses.dataclass(frozen=True, repr=False)
class DaskCheckpointInfo(CheckpointInfo):
    """A committed checkpoint of a Dask cluster: per-worker files and the arrays they hold."""

    workers: tuple[str, ...] = ()
    file_sizes: tuple[int, ...] = ()
    variables: tuple[dict[str, Any], ...] = ()
    state: str = "committed"
    partner_bytes: int | None = None  # differential L2: bytes sent to the partners (deltas or whole files)
    #: var id -> weak reference to the Dask array as this checkpoint cut it (see :attr:`arrays`)
    array_refs: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def arrays(self) -> dict[int, Any]:
        """var id -> the Dask array as this checkpoint cut it (its lost chunks are read back from it), while
        it is alive: ``ctx.protected`` holds it until the variable is protected anew. Weak, because a live
        array keeps its checkpoint from being retired, and a held report must not keep its files on disk."""
        return {vid: a for vid, ref in self.array_refs.items() if (a := ref()) is not None}

    def __repr__(self) -> str:
        rate = self.bytes_written / self.seconds / 2**20 if self.seconds > 0 else 0.0
        vars_ = ", ".join(f"{v['id']}:{v['name']} {v['dtype']}{tuple(v['shape'])} in {v['nchunks']} chunks"
                          for v in self.variables)
        return (f"<ftidask checkpoint id={self.id} {_LEVEL_NAMES.get(self.level, self.level)} {self.state}: "
                f"{human(self.bytes_written)} of data in {len(self.workers)} worker files "
                f"({human(self.file_bytes)}) in {self.seconds:.2f} s ({rate:.0f} MiB/s); vars=[{vars_}]>")

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{v['id']}</td><td>{html.escape(v['name'])}</td><td>{html.escape(v['dtype'])}</td>"
            f"<td>{tuple(v['shape'])}</td><td>{v['nchunks']}</td><td>{human(v['nbytes'])}</td></tr>"
            for v in self.variables)
        files = "".join(f"<tr><td>{r}</td><td><code>{html.escape(w)}</code></td><td>{human(s)}</td></tr>"
                        for r, (w, s) in enumerate(zip(self.workers, self.file_sizes, strict=False)))
        return (f"<div><b>ftidask checkpoint {self.id}</b> &mdash; {_LEVEL_NAMES.get(self.level, self.level)}, "
                f"<b>{html.escape(self.state)}</b>, {human(self.bytes_written)} in {self.seconds:.2f} s"
                "<table><tr><th>id</th><th>name</th><th>dtype</th><th>shape</th><th>chunks</th><th>size</th></tr>"
                f"{rows}</table><details><summary>{len(self.workers)} worker files</summary>"
                f"<table><tr><th>rank</th><th>worker</th><th>file</th></tr>{files}</table></details></div>")


def _var_rows(ctx: Any) -> list[tuple[int, str, str, tuple[int, ...], str, int]]:
    """id, name, dtype, shape, chunk shape ("numpy" for a NumPy variable), bytes of each protected variable."""
    rows = []
    for p in ctx.variables.values():
        a = p.array
        dask_array = hasattr(a, "__dask_graph__") and hasattr(a, "chunks")
        chunks = "x".join(str(max(c) if c else 0) for c in a.chunks) if dask_array else "numpy"
        rows.append((p.id, p.name, str(a.dtype), tuple(a.shape), chunks, int(a.nbytes)))
    return rows


def _cluster_text(ctx: Any) -> tuple[str, str]:
    """The number of workers and the levels, or "?" when the cluster cannot be asked (a closed client): shown
    after every notebook cell, a repr never raises."""
    try:
        return str(len(ctx.cluster.workers())), str(list(ctx.transport.levels()))
    except Exception:  # the client closed, the scheduler gone
        return "? (client closed)", "?"


def context_repr(ctx: Any) -> str:
    """A Dask context in one line: run, workers, levels, status, variables with their chunks, last checkpoint."""
    vars_ = ", ".join(f"{i}:{n} {d}{list(s)} chunks {c} ({human(b)})" for i, n, d, s, c, b in _var_rows(ctx))
    last, (workers, levels) = ctx.last_checkpoint, _cluster_text(ctx)
    return (f"<ftidask.Context exec_id={ctx.exec_id!r} backend=dask workers={workers} "
            f"levels={levels} status={ctx.status()} vars=[{vars_}] "
            f"last_checkpoint={None if last is None else (last.id, last.level)}"
            f"{' finalized' if ctx.finalized else ''}>")


def context_html(ctx: Any) -> str:
    """A Dask context as an HTML table for Jupyter."""
    rows = "".join(f"<tr><td>{i}</td><td>{html.escape(n)}</td><td>{d}</td><td>{s}</td><td>{c}</td>"
                   f"<td>{human(b)}</td></tr>" for i, n, d, s, c, b in _var_rows(ctx))
    last, (workers, levels) = ctx.last_checkpoint, _cluster_text(ctx)
    state = "finalized" if ctx.finalized else "open"
    return (f"<div><b>ftidask.Context</b> run <code>{html.escape(ctx.exec_id)}</code>, Dask backend, "
            f"{html.escape(workers)} workers, levels {levels}, status "
            f"{ctx.status()}, {state}; last checkpoint: "
            f"{'none' if last is None else f'id {last.id}, level {last.level}, {human(last.bytes_written)}'}"
            "<table><tr><th>id</th><th>name</th><th>dtype</th><th>shape</th><th>chunk</th><th>size</th></tr>"
            f"{rows}</table></div>")
