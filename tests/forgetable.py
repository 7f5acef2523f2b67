"""Forged ftidask files for the hostile-input tests: a well-formed file (metadata checksum and file-block hash
recomputed, commit record re-sealed) around a table that says something else, so that only the reader's own
checks of what the table says stand between it and the user's arrays."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from ftidask.engine.runstate import seal_json
from ftidask.ftiff import hashing
from ftidask.ftiff.structs import FB_SIZE, BlockMeta, FileBlock
from ftidask.ftiff.trailer import pack_trailer


def rewrite_table(path: Path, change: Callable[[dict], None]) -> tuple[FileBlock, FileBlock]:
    """``change(table)`` applied to the table (the trailer's JSON) of the ftidask file at ``path``; its
    metadata checksum and file-block hash recomputed. Returns the file blocks before and after."""
    raw = path.read_bytes()
    fb = FileBlock.unpack(raw[:FB_SIZE])
    length = struct.unpack("<Q", raw[-16:-8])[0]
    table = json.loads(raw[-16 - length:-16])
    change(table)
    tail = pack_trailer(json.dumps(table).encode())
    checksum, offset = hashing.new_hasher(fb.hash_id), FB_SIZE
    while offset < fb.fs:
        bmd = BlockMeta.unpack(raw[offset:offset + 12])
        checksum.update(raw[offset:offset + 12 + 64 * bmd.numvars])
        offset += bmd.dbsize
    checksum.update(tail)
    forged = FileBlock(**(fb.__dict__ | {"checksum": checksum.hexdigest()[:32]})).sealed()
    path.write_bytes(forged.pack() + raw[FB_SIZE:len(raw) - 16 - length] + tail)  # a dCP file's digests kept
    return fb, forged


def reseal_record(record: Path, old: FileBlock, new: FileBlock, size: int | None = None) -> None:
    """The commit record at ``record`` made to name the file whose block was ``old`` by ``new`` (and its ``size``
    when given), sealed again."""
    sealed = json.loads(record.read_text())
    for f in sealed["files"]:
        if f["fb_hash"] == old.hash.hex():
            f["fb_hash"] = new.hash.hex()
            if size is not None:
                f["size"] = size
    record.write_text(json.dumps(seal_json(sealed)))
