"""Dtypes at their edges, found by a review: every byte of a structured item (padding and bytes no field covers) in
an array that is not C-contiguous; dtypes the variable table described as another (field titles, NumPy user dtypes
such as bfloat16); variable names that ``inspect`` printed raw (newlines, terminal escapes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ftidask
from ftidask.model.arrays import ArrayBytes, VarInfo, check_described, dtype_from_json, dtype_to_json
from ftidask.model.errors import FormatError, ProtectError
from ftidask.tools.cli import main

#: structured dtypes whose fields do not cover the whole item
PARTIAL = {
    "partial16": np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [0], "itemsize": 16}),
    "aligned": np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<u2")], align=True),
    "fieldless8": np.dtype({"names": [], "formats": [], "itemsize": 8}),
}


def _layout(dtype: np.dtype, seed: int, kind: str) -> np.ndarray:
    """A 6 x 7 array of ``dtype`` over random bytes: C-contiguous, strided, Fortran-ordered or reversed."""
    raw = np.random.default_rng(seed).integers(0, 256, dtype.itemsize * 6 * 14, np.uint8)
    first = raw[:dtype.itemsize * 42]
    layouts = {"c": lambda: first.view(dtype).reshape(6, 7), "step": lambda: raw.view(dtype).reshape(6, 14)[:, ::2],
               "f": lambda: first.view(dtype).reshape(7, 6).T, "rev": lambda: first.view(dtype).reshape(6, 7)[::-1]}
    return layouts[kind]()


def _items(array: np.ndarray) -> bytes:
    """Every byte of every item (fields or not), in C order of the indices."""
    return np.ascontiguousarray(array.view(np.dtype((np.void, array.dtype.itemsize)))).tobytes()


def _dirs(base: Path, **kw) -> dict:
    return {"ckpt_dir": str(base / "L"), "glbl_dir": str(base / "G"), "meta_dir": str(base / "M"), "verbosity": 1,
            **kw}


# --- 1. bytes no field covers, in arrays that are not C-contiguous ----------------------------------------------

@pytest.mark.parametrize("kind", ["c", "step", "f", "rev"])
@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_array_bytes_read_and_write_every_byte_of_an_item(name, kind):
    """ArrayBytes copied a strided structured array field by field into np.empty (the stream's other bytes were
    uninitialised heap) and stored it back field by field (those bytes never restored)."""
    dtype = PARTIAL[name]
    src, dst = _layout(dtype, 1, kind), _layout(dtype, 2, kind)
    stream = b"".join(bytes(p) for p in ArrayBytes(src).pieces(0, src.nbytes, piece=5))  # pieces cut items
    assert stream == (_items(src.T) if kind == "f" else _items(src))  # F: the stream is Fortran order
    out = ArrayBytes(dst, ArrayBytes(src).order)
    for lo in range(0, len(stream), 7):
        out.store(lo, stream[lo:lo + 7])
    assert _items(dst) == _items(src)


@pytest.mark.parametrize("path", ["l1", "l4", "async"])
@pytest.mark.parametrize("kind", ["step", "f", "rev"])
@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_every_byte_of_a_structured_item_is_checkpointed_and_recovered(tmp_path, name, kind, path):
    """recover() succeeded but 12 of every 16 bytes of a strided ``partial16`` array were never restored, and the
    file held uninitialised bytes there (hashed as the data). Written from each layout, recovered into the same
    layout and into a C-contiguous array (which shows the file's bytes)."""
    dtype = PARTIAL[name]
    level = 4 if path == "l4" else 1
    src = _layout(dtype, 1, kind)
    want = _items(src)
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, src)
    if path == "async":
        ctx.checkpoint(1, level, wait=False).result()
    else:
        ctx.checkpoint(1, level)
    ctx._close()
    again = ftidask.init(**_dirs(tmp_path))
    same = _layout(dtype, 2, kind)
    again.protect(1, same)
    again.recover()
    assert _items(same) == want
    plain = np.frombuffer(bytearray(b"\xee" * len(want)), dtype).reshape(src.shape)
    again.protect(1, plain)
    again.recover()
    assert _items(plain) == want
    again.finalize()


# --- 2. dtypes the variable table describes exactly, or refused -------------------------------------------------

TITLED = np.dtype([(("Temperature in K", "t"), "<f8"), ("p", "<i4")])
NESTED_TITLED = np.dtype([("s", [(("T", "t"), "<f8"), ("u", "<i2")]), (("P", "p"), "<i4", (2,))])


@pytest.mark.parametrize("dtype", [TITLED, NESTED_TITLED], ids=["titled", "nested"])
def test_a_titled_dtype_is_recorded_with_its_titles(dtype):
    assert dtype_from_json(json.loads(json.dumps(dtype_to_json(dtype)))) == dtype
    check_described(dtype)  # accepted
    assert "titles" not in dtype_to_json(np.dtype([("t", "<f8")]))  # a table without titles is as it was


@pytest.mark.parametrize("level", [1, 4])
def test_a_titled_dtype_is_recovered_into_the_same_dtype(tmp_path, level):
    """Its titles were not recorded: recover() into the very same array was always refused ("checkpoint holds
    [('t', '<f8'), ...], the protected array is [(('Temperature in K', 't'), ...)]"), realloc gave another dtype."""
    src = np.frombuffer(np.random.default_rng(3).integers(0, 256, 5 * TITLED.itemsize, np.uint8).tobytes(), TITLED)
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, src.copy())
    ctx.checkpoint(1, level)
    ctx._close()
    again = ftidask.init(**_dirs(tmp_path))
    got = np.zeros(5, TITLED)
    again.protect(1, got)
    again.recover()
    assert got.view(np.uint8).tobytes() == src.view(np.uint8).tobytes()
    assert again.realloc(1).dtype == TITLED
    again.finalize()


def test_forged_titles_are_a_format_error():
    base = {"names": ["a", "b"], "formats": ["<i4", "<i4"], "offsets": [0, 4], "itemsize": 8}
    for titles in (["T"], ["b", None], [3, None], "TT"):
        with pytest.raises(FormatError):
            dtype_from_json(base | {"titles": titles})
    raw = {"id": 1, "name": "x", "dtype": base | {"titles": ["T", None]}, "shape": [2], "order": "C", "nbytes": 16}
    assert VarInfo.from_json(raw).dtype.fields["T"][0] == np.dtype("<i4")


def _user_dtypes() -> list:
    out = []
    try:  # a NumPy user dtype shipped with NumPy's own tests (dtype.str '<V8')
        from numpy._core._rational_tests import rational
        out.append(np.dtype(rational))
    except ImportError:
        pass
    try:
        import ml_dtypes
        out.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("dtype", _user_dtypes(), ids=str)
def test_a_user_dtype_recorded_as_plain_bytes_is_refused_at_protect(tmp_path, dtype):
    """bfloat16 was recorded as '|V2': every checkpoint succeeded, and no recovery into a bfloat16 array took it."""
    ctx = ftidask.init(**_dirs(tmp_path))
    advice = rf"cannot be recorded exactly.*array\.view\(numpy\.uint{8 * dtype.itemsize}\)"
    with pytest.raises(ProtectError, match=advice):
        ctx.protect(1, np.zeros(4, dtype))
    with pytest.raises(ProtectError, match="cannot be recorded exactly"):
        ctx.protect(2, np.zeros(4, [("a", "<f4"), ("b", dtype)]))
    plain = np.zeros(4, dtype).view(f"<u{dtype.itemsize}")  # the advice: its bytes, recovered and viewed back
    ctx.protect(3, plain)
    ctx.checkpoint(1, 1)
    ctx.finalize()


def test_a_title_that_is_not_a_str_is_refused_at_protect(tmp_path):
    ctx = ftidask.init(**_dirs(tmp_path))
    with pytest.raises(ProtectError, match="str titles or none"):
        ctx.protect(1, np.zeros(3, [((1, "a"), "<i4")]))
    ctx.finalize()


@pytest.mark.parametrize("dtype", [">f8", "V6", "S5", ">U2", "M8[10ms]", "m8", "<f16", "?", "V0",
                                   [("a", ">i4"), ("b", [("x", "<f2"), ("y", "S3")])], [("a", "<i2", (2, 3))],
                                   {"names": ["a", "b"], "formats": ["<i4", "<i2"], "offsets": [0, 2], "itemsize": 4},
                                   {"names": [], "formats": [], "itemsize": 8}, [], [("température", "<f4")]],
                         ids=str)
def test_dtypes_the_table_describes_are_still_accepted(dtype):
    dtype = np.dtype(dtype)
    check_described(dtype)
    assert dtype_from_json(dtype_to_json(dtype)) == dtype


# --- 3. inspect prints names escaped when they are not printable ------------------------------------------------

def test_inspect_escapes_a_name_that_is_not_printable(tmp_path, capsys):
    """A name with a newline and terminal escapes was printed raw: a hostile file could fake lines, clear the
    screen. A printable name (accents and all) is shown as it was."""
    ctx = ftidask.init(**_dirs(tmp_path))
    ctx.protect(1, np.zeros(3), name="temp\n\x1b[2J\x1b[31mFAKE: 0 damaged")
    ctx.protect(2, ftidask.State({"a": "x\u202ey"}), name="st\x1b[2J")
    ctx.protect(3, np.zeros(2), name="température d'eau")
    ctx.checkpoint(1, 1)
    ctx._close()  # the files kept, as after a crash
    (path,) = Path(tmp_path / "L").glob("node0/*/l1/*/Ckpt1-Rank0.fti")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out, out
    assert not any(line.startswith("FAKE") for line in out.splitlines()), out  # no line of the name's own
    assert r"id 1 'temp\n\x1b[2J\x1b[31mFAKE: 0 damaged': float64" in out
    assert r"id 2 'st\x1b[2J': Python state json = " in out
    assert "id 3 'température d'eau': float64" in out
