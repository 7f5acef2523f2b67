"""Human and JSON views of a parsed FTI-FF file (the seed's DATASTRUCTURE format)."""

from __future__ import annotations

import time
from typing import Any

from .hashing import hash_name
from .reader import FtiffFile
from .structs import BMD_SIZE, VMD_SIZE


def _readable_ns(ns: int) -> str:
    """`` (2026-11-23 18:20:01 UTC)`` for a file block's timestamp (ns since the epoch), or ``""``."""
    try:
        return " (" + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns / 1e9)) + ")" if ns > 0 else ""
    except (OverflowError, OSError, ValueError):  # a foreign file's field need not be a time
        return ""


def shown_name(name: str) -> str:
    """A variable's name as ``inspect`` prints it: ``'name'``, or escaped as Python's repr escapes a string when it
    holds a character that is not printable (a newline, a terminal escape: a file's name could fake lines, clear the
    screen); printable names, accents and all, are shown as they are."""
    return f"'{name}'" if name.isprintable() else repr(name)


def _kind(parsed: FtiffFile) -> str:
    fb = parsed.fb
    if parsed.tail:
        padded = parsed.identity[2] - parsed.file_size
        return "FTI file, metadata at the end (FTI 1.2 or later, MD5)" + (
            f"; {padded} bytes of padding after its {parsed.file_size} (an interrupted FTI level-3 recovery's), "
            "not read" if padded > 0 else "")
    return "FTI 1.1 file (MD5)" if fb.legacy else f"ftidask FTI-FF v{fb.version}, hash {hash_name(fb.hash_id)}"


def to_text(parsed: FtiffFile) -> str:
    """The structure in the seed's ``DATASTRUCTURE BEGIN/END`` layout."""
    fb = parsed.fb
    lines = [f"# {parsed.path}",
             f"# {_kind(parsed)}"
             f", ckptSize {fb.ckpt_size}, fs {fb.fs}, maxFs {fb.max_fs}, ptFs {fb.pt_fs}, timestamp {fb.timestamp}"
             f"{_readable_ns(fb.timestamp)}",
             "------------------- DATASTRUCTURE BEGIN -------------------", ""]
    for bi, (bmd, metas) in enumerate(parsed.blocks):
        lines += [f"    DataBase-id: {bi}",
                  f"                 numvars: {bmd.numvars}",
                  f"                 dbsize: {bmd.dbsize}",
                  f"                 [size metadata: {_meta_size(parsed, bmd.numvars)}]", ""]
        for ci, m in enumerate(metas):
            lines += [f"         Var-id: {ci}",
                      f"                 id: {m.id}",
                      f"                 idx: {m.idx}",
                      f"                 containerid: {m.containerid}",
                      f"                 hascontent: {'true' if m.hascontent else 'false'}",
                      f"                 dptr: {m.dptr}",
                      f"                 fptr: {m.fptr}",
                      f"                 chunksize: {m.chunksize}",
                      f"                 containersize: {m.containersize}",
                      f"                 hash: {m.hash.hex()}", ""]
    lines += ["", "------------------- DATASTRUCTURE END ---------------------"]
    if parsed.vars:
        lines.append("")
        lines.append("Variables:")
        for info in parsed.vars.values():
            extra = f" {info.extra}" if info.extra else ""
            lines.append(f"    id {info.id} {shown_name(info.name)}: {info.dtype} shape {info.shape} "
                         f"order {info.order} ({info.nbytes} bytes){extra}")
    dcp = (parsed.trailer or {}).get("dcp")
    if isinstance(dcp, dict):  # a differential checkpoint's file (ftidask.ftiff.blockhash)
        lines += ["", f"Differential (dCP): blocks of {dcp.get('block_size')} bytes, block hash "
                      f"{dcp.get('block_hash')}, {dcp.get('section_len')} bytes of block hashes at fs; "
                      "container hashes are over the block hashes"]
    return "\n".join(lines)


def _meta_size(parsed: FtiffFile, numvars: int) -> str:
    if parsed.tail:  # blocks hold data only; their metadata is at the end of the file
        return "0 (in the metadata at the end of the file)"
    return str(BMD_SIZE + VMD_SIZE * numvars)


def to_json(parsed: FtiffFile) -> dict[str, Any]:
    """The same structure as a JSON-able dict."""
    fb = parsed.fb
    return {
        "path": parsed.path,
        "legacy": fb.legacy,
        "layout": "fti-tail" if parsed.tail else "head",
        "hash": hash_name(fb.hash_id),
        "fb": {"checksum": fb.checksum, "hash": fb.hash.hex(), "ckptSize": fb.ckpt_size, "fs": fb.fs,
               "maxFs": fb.max_fs, "ptFs": fb.pt_fs, "timestamp": fb.timestamp},
        "blocks": [
            {"numvars": bmd.numvars, "dbsize": bmd.dbsize,
             "vars": [{"id": m.id, "idx": m.idx, "containerid": m.containerid, "hascontent": m.hascontent,
                       "dptr": m.dptr, "fptr": m.fptr, "chunksize": m.chunksize, "containersize": m.containersize,
                       "hash": m.hash.hex()} for m in metas]}
            for bmd, metas in parsed.blocks],
        "table": parsed.trailer,
    }
