"""The byte stream of a NumPy array, and its description (dtype, shape, order) without pickle.

An array's stream is its elements in C order, or in Fortran order for a Fortran-contiguous
array (so both are stored without a copy). Non-contiguous arrays are read and written in
bounded pieces through their flat iterator.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import CheckpointError, FormatError, FTIError, ProtectError

PIECE = 32 << 20  # bytes per piece when copying is needed; bounds extra memory


def check_protectable(array: Any) -> np.ndarray:
    """``array`` as an ndarray that can be protected, or a clear :class:`ProtectError`."""
    if not isinstance(array, np.ndarray):
        if np.isscalar(array) or isinstance(array, (list, tuple)):
            raise ProtectError(
                f"protect needs an array that ftidask can fill in place, got {type(array).__name__}; "
                "wrap it with numpy.array(...) and protect that array, or protect Python values (JSON: numbers, "
                "strings, lists, dicts) in an ftidask.Value(x) or ftidask.State({...})"
            )
        if hasattr(array, "__dask_graph__") and type(array).__module__.startswith("dask."):
            raise ProtectError("a dask array is protected on the Dask backend only: "
                               "ftidask.init(config, client=distributed.Client(...))")
        # (every xarray object has __dask_graph__, None unless chunked: it was refused as a dask array)
        labelled = type(array).__module__.split(".")[0] in ("xarray", "pandas")
        raise ProtectError(f"protect needs a numpy.ndarray, a CuPy array or a dask array, got {type(array).__name__}; "
                           + (
            "protect the array it holds, its .data (a NumPy array, filled in place; a Dask array when chunked: on the "
            "Dask backend)"
            if labelled else "Python state is protected as JSON in an ftidask.Value or ftidask.State, a random "
            "generator as numpy.random.Generator (ftidask never pickles)"))
    if isinstance(array, np.ma.MaskedArray):  # its mask would be lost, and recovery could not restore it
        raise ProtectError("protect does not take masked arrays (their mask is not checkpointed): protect "
                           "array.data and numpy.ma.getmaskarray(array) as two variables")
    if array.dtype.hasobject:
        raise ProtectError(f"dtype {array.dtype} holds Python objects, which have no fixed bytes; "
                           "use a fixed-size dtype (numeric, bytes 'S', unicode 'U', or structured)")
    check_described(array.dtype)
    return array


def check_described(dtype: np.dtype) -> None:
    """A :class:`ProtectError` unless the variable table describes ``dtype`` exactly (:func:`dtype_to_json`): one
    it would record as another (a NumPy user dtype such as ml_dtypes' bfloat16, recorded as its bytes ``|V2``; a
    field title that is not a str) made checkpoints that no recovery into the same array takes."""
    if dtype.isbuiltin == 1:  # a native-order built-in: its dtype.str is exact (most arrays, checked at once)
        return
    try:
        back = dtype_from_json(dtype_to_json(dtype))
    except FTIError:
        back = None
    if back is not None and back == dtype:
        return
    size = dtype.itemsize
    plain = f"numpy.uint{8 * size}" if size in (1, 2, 4, 8) else f"numpy.dtype('V{size}')"
    advice = ("give its fields str titles or none (a title that is not a str cannot be recorded)"
              if dtype.fields is not None and dtype.subdtype is None else
              f"protect a view of its bytes, array.view({plain}), and view the recovered array back "
              f"(recovered.view(array.dtype))")
    raise ProtectError(f"dtype {dtype} cannot be recorded exactly in a checkpoint (it would be read back as "
                       f"{back if back is not None else 'nothing NumPy takes'}, and no recovery into an array of this "
                       f"dtype would take it): {advice}")


_INT32 = (-(2**31), 2**31 - 1)


def check_id(value: Any, what: str) -> int:
    """``value`` as an FTI id (a 32-bit int), or a clear :class:`ProtectError`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ProtectError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if not _INT32[0] <= value <= _INT32[1]:
        raise ProtectError(f"{what} {value} does not fit FTI's 32-bit ids")
    return value


def check_bool(value: Any, what: str, error: type[FTIError]) -> bool:
    """``value`` if it is a bool (not 1 or "yes": what they mean is unsure), else ``error`` naming ``what``."""
    if not isinstance(value, bool):
        raise error(f"{what} takes a bool, got {value!r}")
    return value


def check_ckpt_id(value: Any) -> int:
    """``value`` as a checkpoint id: an FTI id other than 0, which FTI reserves (else a :class:`CheckpointError`)."""
    try:
        ckpt_id = check_id(value, "checkpoint id")
    except ProtectError as exc:  # the checkpoint's error, not protect()'s
        raise CheckpointError(str(exc)) from None
    if ckpt_id == 0:
        raise CheckpointError("checkpoint id 0 is reserved by FTI; use a non-zero id")
    return ckpt_id


def copy_items(dst: np.ndarray, src: np.ndarray, casting: Any = "same_kind") -> None:
    """``np.copyto(dst, src)``, a structured dtype's items copied whole: NumPy copies its fields one by one and leaves
    the padding bytes between them as they were in ``dst`` (a reused buffer's bytes of another variable, written out
    as this one's; or the bytes an array held before its recovery), where a checkpoint keeps every byte."""
    if dst.dtype.fields is not None and dst.dtype == src.dtype:
        whole = np.dtype((np.void, dst.dtype.itemsize))
        np.copyto(dst.view(whole), src.view(whole))
    else:
        np.copyto(dst, src, casting=casting)


def contiguous_items(array: np.ndarray, copy: bool = False) -> np.ndarray:
    """``np.ascontiguousarray(array)`` (a new array with ``copy``), a structured dtype's items copied whole: NumPy
    copies a structured array of more than a few items field by field, and the bytes no field covers would be lost."""
    if array.dtype.fields is None:
        return np.array(array, order="C", copy=True) if copy else np.ascontiguousarray(array)
    raw = array.view(np.dtype((np.void, array.dtype.itemsize)))
    return (np.array(raw, order="C", copy=True) if copy else np.ascontiguousarray(raw)).view(array.dtype)


def stream_order(array: np.ndarray) -> str:
    """'F' when the array is Fortran- but not C-contiguous, else 'C'."""
    if array.ndim > 1 and array.flags.f_contiguous and not array.flags.c_contiguous:
        return "F"
    return "C"


class ArrayBytes:
    """Byte-range access to one array's stream, for writing it out and filling it back."""

    __slots__ = ("array", "order", "nbytes", "itemsize", "_view", "_flat")

    def __init__(self, array: np.ndarray, order: str | None = None) -> None:
        self.array = array
        self.order = order or stream_order(array)
        self.nbytes = array.nbytes
        self.itemsize = array.dtype.itemsize
        flat = array.T if self.order == "F" else array
        self._view: memoryview | None = None
        if flat.flags.c_contiguous:
            try:  # the array's own buffer as bytes (C order): a fifth of NumPy's reshape and view, per variable
                self._view = memoryview(flat).cast("B")
            except (ValueError, TypeError, NotImplementedError):  # dtypes the buffer protocol cannot describe
                self._view = memoryview(flat.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        # a structured dtype's items copied whole (NumPy copies field by field: the bytes no field covers, padding
        # included, were neither written out nor restored); an item is its itemsize bytes, whatever its fields
        self._flat = flat.view(np.dtype((np.void, self.itemsize))) if (
            self._view is None and array.dtype.fields is not None) else flat

    def view(self, start: int, stop: int) -> memoryview | None:
        """A zero-copy view of bytes ``[start, stop)``, or None for a non-contiguous array."""
        return None if self._view is None else self._view[start:stop]

    def pieces(self, start: int, stop: int, piece: int = PIECE) -> Iterator[memoryview]:
        """Bytes ``[start, stop)`` in pieces of at most ``piece`` bytes."""
        for lo in range(start, stop, piece):
            hi = min(stop, lo + piece)
            if self._view is not None:
                yield self._view[lo:hi]
            else:
                first, last = lo // self.itemsize, -(-hi // self.itemsize)
                elems = np.ascontiguousarray(self._flat.flat[first:last])
                raw = memoryview(elems.reshape(-1).view(np.uint8))
                yield raw[lo - first * self.itemsize: hi - first * self.itemsize]

    def store(self, start: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the stream at byte ``start``."""
        stop = start + len(data)
        if self._view is not None:
            self._view[start:stop] = data
            return
        first, last = start // self.itemsize, -(-stop // self.itemsize)
        elems = np.ascontiguousarray(self._flat.flat[first:last])
        raw = elems.reshape(-1).view(np.uint8)
        raw[start - first * self.itemsize: stop - first * self.itemsize] = np.frombuffer(data, np.uint8)
        self._flat.flat[first:last] = elems


# --- dtype description in JSON, never pickle -------------------------------------------------

def dtype_to_json(dtype: np.dtype) -> Any:
    """A JSON value that describes ``dtype`` exactly, padding and alignment included."""
    if dtype.hasobject:
        raise ProtectError(f"dtype {dtype} holds Python objects")
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"base": dtype_to_json(base), "shape": list(shape)}
    if dtype.names is None:
        return dtype.str
    fields = dtype.fields
    assert fields is not None  # names is not None
    out: dict[str, Any] = {
        "names": list(dtype.names),
        "formats": [dtype_to_json(fields[n][0]) for n in dtype.names],
        "offsets": [int(fields[n][1]) for n in dtype.names],
        "itemsize": dtype.itemsize,
    }
    # field titles (str ones: another kind is not recorded, and protect refuses it), only when there are some
    titles = [fields[n][2] if len(fields[n]) > 2 and isinstance(fields[n][2], str) else None for n in dtype.names]
    if any(t is not None for t in titles):
        out["titles"] = titles
    return out


def dtype_from_json(value: Any) -> np.dtype:
    """The dtype described by :func:`dtype_to_json`; a :class:`FormatError` for anything else."""
    try:
        if isinstance(value, str):
            if "O" in value:
                raise ValueError("object dtype")
            dtype = np.dtype(value)
        elif isinstance(value, dict) and "base" in value:
            shape = tuple(int(n) for n in value["shape"])
            dtype = np.dtype((dtype_from_json(value["base"]), shape))
        elif isinstance(value, dict):
            names = [str(n) for n in value["names"]]
            spec: dict[str, Any] = {
                "names": names,
                "formats": [dtype_from_json(f) for f in value["formats"]],
                "offsets": [int(o) for o in value["offsets"]],
                "itemsize": int(value["itemsize"]),
            }
            titles = value.get("titles")
            if titles is not None:
                if not isinstance(titles, list) or any(t is not None and not isinstance(t, str) for t in titles):
                    raise ValueError("titles must be a list of str or null")
                spec["titles"] = titles
            dtype = np.dtype(spec)
        else:
            raise ValueError(f"unexpected {type(value).__name__}")
    # Warning: a deprecated alias ("a3", never written by ftidask) where warnings are errors (python -W error)
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError, Warning) as exc:
        raise FormatError(f"invalid dtype description {reprlib.repr(value)}: {exc}") from None
    if dtype.hasobject:
        raise FormatError(f"object dtype in file: {value!r}")
    return dtype


def _described(var_id: int, name: str, dtype: np.dtype, shape: tuple[int, ...], order: str, nbytes: int,
               extra: dict[str, Any] | None) -> dict[str, Any]:
    """A variable's description in the table (:meth:`VarInfo.to_json`), ``extra`` only when not empty."""
    out = {"id": var_id, "name": name, "dtype": dtype_to_json(dtype), "shape": list(shape), "order": order,
           "nbytes": nbytes}
    if extra:
        out["extra"] = extra
    return out


#: dtype strings of variable tables already parsed and checked (and with how many dimensions): a table of 10,000
#: arrays of one dtype made 10,000 dtypes and 10,000 empty arrays. Bounded: a forged table cannot grow it for ever.
_CHECKED_DTYPES: dict[str, np.dtype] = {}
_CHECKED_DIMS: set[tuple[str | None, int]] = set()
_CHECKED_MAX = 1024


@dataclasses.dataclass(frozen=True)
class VarInfo:
    """What a file records about one protected variable."""

    id: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    order: str
    nbytes: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, var_id: int, name: str, array: np.ndarray, **extra: Any) -> VarInfo:
        """The description of ``array``, protected as variable ``var_id`` called ``name``."""
        return cls(var_id, name, array.dtype, tuple(array.shape), stream_order(array), array.nbytes, extra)

    def to_json(self) -> dict[str, Any]:
        """The description as a JSON-able dict (``extra`` only when not empty)."""
        return _described(self.id, self.name, self.dtype, self.shape, self.order, self.nbytes, self.extra)

    @staticmethod
    def json_of(var_id: int, name: str, array: np.ndarray, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``VarInfo.of(var_id, name, array, **extra).to_json()``, without the object (a table of thousands of
        variables is made at each checkpoint)."""
        return _described(var_id, name, array.dtype, array.shape, stream_order(array), array.nbytes, extra)

    @classmethod
    def from_json(cls, raw: Any) -> VarInfo:
        """The description ``raw`` holds, checked; :class:`FormatError` if it is not a valid one."""
        try:
            described = raw["dtype"]
            plain = described if type(described) is str else None  # noqa: E721 - JSON's own str, a cache key
            dtype = _CHECKED_DTYPES.get(plain) if plain is not None else None
            if dtype is None:
                dtype = dtype_from_json(described)
            shape = tuple(map(int, raw["shape"]))
            info = cls(int(raw["id"]), str(raw["name"]), dtype, shape, str(raw["order"]), int(raw["nbytes"]),
                       dict(raw["extra"]) if "extra" in raw else {})
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise FormatError(f"invalid variable description {reprlib.repr(raw)}: {exc}") from None
        if info.order not in ("C", "F") or (shape and min(shape) < 0):
            raise FormatError(f"invalid variable description {reprlib.repr(raw)}")
        if (plain, len(shape)) not in _CHECKED_DIMS:
            try:  # NumPy's limit on dimensions (a sub-array dtype adds its own): checked on an empty array
                np.empty((0,) * len(shape), dtype)
            except ValueError as exc:
                raise FormatError(f"variable {info.id}: shape {reprlib.repr(shape)} with dtype {dtype} has more "
                                  f"dimensions than NumPy supports ({exc})") from None
            # a table of thousands checks each once; never one with fields: NumPy renames them in place (a dtype
            # of an array recovered from one file would then be the next file's, other names and all)
            if plain is not None and dtype.names is None and len(_CHECKED_DIMS) < _CHECKED_MAX:
                _CHECKED_DIMS.add((plain, len(shape)))
                _CHECKED_DTYPES[plain] = dtype
        if math.prod(shape) * dtype.itemsize != info.nbytes:
            raise FormatError(f"variable {info.id}: shape {shape} x {dtype} does not make {info.nbytes} bytes")
        return info

    def empty(self) -> np.ndarray:
        """A new uninitialised array of this variable's dtype, shape and order."""
        return np.empty(self.shape, self.dtype, order=self.order)
