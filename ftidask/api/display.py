"""How a :class:`~ftidask.Context` shows itself: one line in a terminal, a table in a notebook."""

from __future__ import annotations

import html
from typing import Any


def context_repr(ctx: Any) -> str:
    """``<ftidask.Context exec_id=... backend=... vars=[...] last_checkpoint=...>``."""
    vars_ = ", ".join(f"{p.id}:{p.name} {p.array.dtype}{list(p.array.shape)}" for p in ctx.variables.values())
    last = ctx.last_checkpoint
    t = ctx.transport
    return (f"<ftidask.Context exec_id={ctx.exec_id!r} backend={t.name} rank={t.rank}/{t.size} "
            f"status={ctx.status()} vars=[{vars_}] last_checkpoint={None if last is None else (last.id, last.level)}"
            f"{' finalized' if ctx.finalized else ''}>")


def context_html(ctx: Any) -> str:
    """The context's run, backend, status, last checkpoint and protected variables as an HTML table."""
    rows = "".join(
        f"<tr><td>{p.id}</td><td>{html.escape(p.name)}</td><td>{p.array.dtype}</td>"
        f"<td>{tuple(p.array.shape)}</td><td>{p.array.nbytes:,}</td></tr>" for p in ctx.variables.values())
    last = ctx.last_checkpoint
    return (f"<div><b>ftidask.Context</b> run <code>{html.escape(ctx.exec_id)}</code>, "
            f"{ctx.transport.name} backend, status {ctx.status()}, "
            f"last checkpoint: {'none' if last is None else f'id {last.id}, level {last.level}'}"
            f"<table><tr><th>id</th><th>name</th><th>dtype</th><th>shape</th><th>bytes</th></tr>{rows}"
            "</table></div>")
