"""The variable table that makes an FTI-FF file self-describing for NumPy.

It sits after the VB (at offset ``fs``), so no offset of FTI-FF v1.1 moves:
UTF-8 JSON, then its length as uint64 and the 8-byte magic ``FTDKVARS``. JSON, never pickle.
"""

from __future__ import annotations

import json
import reprlib
import struct
from typing import Any

from ..model.errors import CheckpointError, FormatError

TRAILER_MAGIC = b"FTDKVARS"
_TAIL = struct.Struct("<Q8s")
MAX_TRAILER = 64 << 20  # refuse absurd tables before allocating them


def pack_trailer(payload: bytes) -> bytes:
    """The table ``payload`` with its length and magic; :class:`CheckpointError` when the readers would refuse it
    (more than :data:`MAX_TRAILER` bytes): the checkpoint fails, rather than commit a file no recovery reads."""
    if len(payload) > MAX_TRAILER:
        raise CheckpointError(f"the variable table would be {len(payload)} bytes, more than the {MAX_TRAILER} "
                              "bytes ftidask reads back (too many variables, or names too long)")
    return payload + _TAIL.pack(len(payload), TRAILER_MAGIC)


def trailer_span(tail16: bytes, fs: int, file_size: int, *, path: str | None = None,
                 gap: bool = False) -> tuple[int, int]:
    """``(offset, length)`` of the JSON payload, checked against the file's size.

    ``gap``: bytes may sit between ``fs`` and the payload (a dCP file's block-hash section).
    """
    length, magic = _TAIL.unpack(tail16)
    if magic != TRAILER_MAGIC:
        raise FormatError("variable table missing (file truncated or damaged at its end)", path=path)
    if gap and length <= MAX_TRAILER and fs + length + _TAIL.size <= file_size:
        return file_size - _TAIL.size - length, length
    if length > MAX_TRAILER or fs + length + _TAIL.size != file_size:
        raise FormatError(f"variable table of {length} bytes does not fit between fs={fs} and the end "
                          f"of the file ({file_size} bytes)", path=path)
    return fs, length


def parse_trailer(payload: bytes, *, path: str | None = None) -> dict[str, Any]:
    """The JSON variable table after a file's data, checked for shape (an object with a ``vars`` list);
    :class:`FormatError` naming ``path`` when it is not."""
    try:
        value = json.loads(payload.decode("utf-8"))
    # ValueError, not only JSONDecodeError: json refuses integers of more than 4300 digits with a plain one.
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"variable table is not valid JSON: {exc}", path=path) from None
    if not isinstance(value, dict) or not isinstance(value.get("vars"), list):
        raise FormatError("variable table has no 'vars' list", path=path)
    check_header(value, path)
    return value


_INT_KEYS = ("ckpt_id", "level", "seq", "rank", "nranks", "node")
_STR_KEYS = ("format", "exec_id", "backend", "worker")


def check_header(table: dict[str, Any], path: str | None) -> None:
    """Raise :class:`FormatError` unless the table's own fields, when present, have the types ftidask
    writes: ``list``, ``export`` and ``inspect`` format them as they are, so a forged one must fail here
    as damage, not there."""
    for key in _INT_KEYS:
        if key in table and (isinstance(table[key], bool) or not isinstance(table[key], int)):
            raise FormatError(f"variable table: {key!r} is {reprlib.repr(table[key])}, not an integer", path=path)
    for key in _STR_KEYS:
        if key in table and not isinstance(table[key], str):
            raise FormatError(f"variable table: {key!r} is {reprlib.repr(table[key])}, not a string", path=path)
    when = table.get("time", 0)
    # time.localtime() refuses NaN, infinities and years past 9999; no file ftidask writes holds those.
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when < _YEAR_9999:
        raise FormatError(f"variable table: 'time' is {reprlib.repr(when)}, not a time in seconds", path=path)


_YEAR_9999 = 253402300800  # 10000-01-01T00:00:00Z in seconds since the epoch


TAIL_SIZE = _TAIL.size
