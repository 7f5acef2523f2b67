"""Python state checkpointed beside the arrays, without pickle.

``protect`` takes, besides arrays:

* :class:`State` (or any ``dict``): a mapping of str keys to JSON values (numbers, strings,
  bools, None, lists and dicts of them with str keys), recovered in place (cleared and refilled);
* :class:`Value`: a box whose ``.value`` is one JSON value, recovered in place (``.value`` rebound);
* a NumPy ``numpy.random.Generator`` or ``BitGenerator``: its ``bit_generator.state``, recovered
  in place (``bit_generator.state = ...``), so the generator continues the exact same stream.

Each is stored as a container of bytes, a ``uint8`` variable holding UTF-8 JSON, with its kind in
the variable table (``extra["pystate"]``): hash-covered like any container, written at every level
(L1-L4, differential, compressed, on MPI and Dask). Reading it back is ``json.loads`` of verified
bytes, never pickle. Anything else is refused at ``protect`` with a :class:`ProtectError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from typing import Any

import numpy as np

from ..model.errors import ProtectError, RecoveryError

EXTRA_KEY = "pystate"  # VarInfo.extra key naming the kind of a Python-state variable
KIND_JSON = "json"  # a State/dict or a Value: the JSON of its value
KIND_RNG = "numpy.random"  # a Generator/BitGenerator: the JSON of bit_generator.state
_MAX_DEPTH = 64  # nesting refused beyond this (also catches a list that contains itself)
_SCALARS = (str, int, float, bool, type(None))
_NDARRAY_TAG = "__ndarray__"  # how an array inside a bit generator's state is written in JSON


class Value:
    """A mutable box for one JSON value; ``ctx.protect(id, v)`` then recovery sets ``v.value``."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"ftidask.Value({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and self.value == other.value

    __hash__ = None  # type: ignore[assignment]  # mutable


class State(dict):  # type: ignore[type-arg]
    """A dict of JSON values (str keys) to protect; recovery clears and refills this very object."""

    def __repr__(self) -> str:
        return f"ftidask.State({dict.__repr__(self)})"


def _check_writable(value: str | int, where: str) -> None:
    """JSON types that json.dumps or UTF-8 still refuse: a str with lone surrogates (``'\\udcff'``, from
    ``os.fsdecode`` of undecodable bytes) and an int of more digits than Python converts to text."""
    try:
        if type(value) is str:
            value.encode("utf-8")
        elif value.bit_length() > 14_000:  # about 4,200 digits: only such ints can pass the limit
            str(value)
    except UnicodeEncodeError as exc:
        raise ProtectError(f"{where} is a str {reprlib.repr(value)} that UTF-8 cannot encode ({exc}); JSON "
                           "strings are text: store bytes as a NumPy uint8 array") from None
    except ValueError as exc:  # reprlib.repr() of such an int fails the same way: say its size instead
        raise ProtectError(f"{where} is an int of {value.bit_length()} bits, which Python does not convert to "
                           f"text ({exc}); store it in a NumPy array of its bytes") from None


def check_json(value: Any, where: str = "value", depth: int = 0) -> None:
    """Raise :class:`ProtectError` unless ``value`` is made of exact JSON types (str keys).

    Exact types only (no tuples, subclasses, NumPy scalars, sets, bytes): what is recovered
    must be what was protected. NaN and infinities are accepted (Python's JSON writes them).
    """
    if depth > _MAX_DEPTH:
        raise ProtectError(f"{where}: nested more than {_MAX_DEPTH} levels deep (or contains itself)")
    kind = type(value)
    if kind is str or kind is int:
        _check_writable(value, where)
        return
    if kind in _SCALARS:
        return
    if kind is list:
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]", depth + 1)
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise ProtectError(f"{where}: key {key!r} is a {type(key).__name__}; JSON keys are str "
                                   "(convert it, e.g. str(key))")
            _check_writable(key, f"{where}: key")
            check_json(item, f"{where}[{key!r}]", depth + 1)
        return
    hint = ""
    if isinstance(value, (np.generic, np.ndarray)):
        hint = " (a NumPy value: convert it with int(x), float(x) or x.tolist(), or protect an array on its own)"
    elif isinstance(value, tuple):
        hint = " (use a list: a tuple would come back as a list)"
    raise ProtectError(f"{where} is a {kind.__name__} {reprlib.repr(value)}, which is not a JSON value{hint}. "
                       "ftidask checkpoints Python state as JSON (numbers, strings, bools, None, lists and "
                       "dicts with str keys) and never pickles; protect arrays as NumPy arrays")


def _dumps(value: Any) -> bytes:
    # Fixed separators, UTF-8, insertion order: the same value always gives the same bytes.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode("utf-8")


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecoveryError(f"{what}: the stored bytes are not valid JSON ({exc})") from None


def _state_to_json(value: Any) -> Any:
    """A bit generator's state (dicts, ints, NumPy arrays and scalars) as JSON values."""
    if isinstance(value, dict):
        return {str(k): _state_to_json(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {_NDARRAY_TAG: value.dtype.str, "shape": list(value.shape), "values": value.ravel().tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_state_to_json(v) for v in value]
    return value


def _array_from_json(value: dict[str, Any]) -> np.ndarray:
    """An array of a bit generator's state, as :func:`_state_to_json` writes it: integers or booleans of at most 8
    bytes, a flat list of as many values as its shape holds. Checked before NumPy sees it (a ValueError): a forged
    dtype of 2**31 bytes an element or a shape that is not the values' made a few values gigabytes."""
    dtype = np.dtype(str(value[_NDARRAY_TAG]))
    shape, values = value["shape"], value["values"]
    if dtype.kind not in "biu" or dtype.itemsize > 8:
        raise ValueError(f"array dtype {dtype} (a bit generator's state holds integers)")
    if not isinstance(shape, list) or len(shape) > 32 or not all(type(n) is int and n >= 0 for n in shape) \
            or not isinstance(values, list) or math.prod(shape) != len(values):
        raise ValueError(f"array of shape {reprlib.repr(shape)} with {reprlib.repr(values)}")
    return np.array(values, dtype=dtype).reshape(shape)


def _state_from_json(value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict):
        if depth > _MAX_DEPTH:  # a bit generator's state is a few levels deep: a forged one 600 deep hit the stack
            raise ValueError(f"a state nested more than {_MAX_DEPTH} levels deep")
        if _NDARRAY_TAG in value:
            return _array_from_json(value)
        return {k: _state_from_json(v, depth + 1) for k, v in value.items()}
    return value


def _int_where_int(own: Any, stored: Any, at: str = "state") -> None:
    """TypeError where ``stored`` (a state read back) has an array where a bit generator's ``own`` state has an int.

    NumPy 2 refuses such a state; NumPy 1.26 takes a one-element array for an int as the int, so a forged state
    would be set rather than refused."""
    if isinstance(own, dict) and isinstance(stored, dict):
        for key, value in own.items():
            if key in stored:
                _int_where_int(value, stored[key], f"{at}[{key!r}]")
    elif isinstance(own, int) and isinstance(stored, np.ndarray):
        raise TypeError(f"{at} is an array, the generator keeps an int there")


@dataclasses.dataclass(frozen=True)
class Holder:
    """A protected Python state: ``obj`` is what the user protected (updated in place on recovery)."""

    kind: str
    obj: Any

    def encode(self) -> np.ndarray:
        """The bytes to store now (a new ``uint8`` array); :class:`ProtectError` if not storable."""
        if self.kind == KIND_RNG:
            state = self._bit_generator().state
            return np.frombuffer(_dumps(_state_to_json(state)), np.uint8).copy()
        value = dict(self.obj) if isinstance(self.obj, dict) else self.obj.value
        check_json(value, "the dict" if isinstance(self.obj, dict) else "Value.value")
        return np.frombuffer(_dumps(value), np.uint8).copy()

    def _bit_generator(self) -> Any:
        return self.obj.bit_generator if isinstance(self.obj, np.random.Generator) else self.obj

    def decode(self, data: bytes | np.ndarray, what: str) -> Any:
        """The content that :meth:`apply` will set, checked now (nothing is touched); :class:`RecoveryError`."""
        raw = _loads(data.tobytes() if isinstance(data, np.ndarray) else data, what)
        if self.kind == KIND_RNG:
            bg = self._bit_generator()
            name = type(bg).__name__
            if not isinstance(raw, dict) or raw.get("bit_generator") != name:
                stored = raw.get("bit_generator") if isinstance(raw, dict) else type(raw).__name__
                raise RecoveryError(f"{what}: the checkpoint holds the state of a {stored} bit generator, the "
                                    f"protected one is a {name}; protect a generator of the same kind")
            try:
                state = _state_from_json(raw)
                fresh = type(bg)()
                _int_where_int(fresh.state, state)
                fresh.state = state  # tried on a fresh one first: a bad state leaves the user's untouched
            # IndexError: a bit generator's setter indexes what it is given (an array where it wants a dict)
            except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
                raise RecoveryError(f"{what}: the stored {name} state is not valid: {exc}") from None
            return state
        try:
            check_json(raw)
        except ProtectError as exc:
            raise RecoveryError(f"{what}: {exc}") from None
        if isinstance(self.obj, dict) and not isinstance(raw, dict):
            raise RecoveryError(f"{what}: the checkpoint holds a {type(raw).__name__}, the protected object is a "
                                "dict; protect an ftidask.Value to hold other values")
        return raw

    def apply(self, content: Any) -> None:
        """Set the recovered content into the protected object itself."""
        if self.kind == KIND_RNG:
            self._bit_generator().state = content
        elif isinstance(self.obj, dict):
            self.obj.clear()
            self.obj.update(content)
        else:
            self.obj.value = content

    def describe(self) -> str:
        """What the protected object is, for messages (``dict``, ``Value``, ``numpy.random PCG64``...)."""
        return "numpy.random " + type(self._bit_generator()).__name__ if self.kind == KIND_RNG else \
            type(self.obj).__name__


def holder_of(obj: Any) -> Holder | None:
    """The :class:`Holder` of a protectable Python state, or None (``obj`` is then checked as an array).

    The value is checked now: a :class:`ProtectError` says what cannot be stored.
    """
    if isinstance(obj, (np.random.Generator, np.random.BitGenerator)):
        holder = Holder(KIND_RNG, obj)
    elif isinstance(obj, (dict, Value)):
        holder = Holder(KIND_JSON, obj)
    elif isinstance(obj, np.random.RandomState):
        raise ProtectError("numpy.random.RandomState is not supported; use numpy.random.default_rng() (a "
                           "Generator), whose state ftidask checkpoints")
    else:
        return None
    holder.encode()  # refuse now what could not be stored
    return holder


def from_stored(kind: str, data: bytes | np.ndarray, what: str) -> Any:
    """A protectable object holding a stored Python state (a :class:`Value`, or a NumPy bit generator
    of the stored kind), e.g. to import an exported checkpoint; :class:`RecoveryError` if unreadable."""
    raw = loads(data, what)
    if kind == KIND_RNG:
        name = raw.get("bit_generator") if isinstance(raw, dict) else None
        cls = getattr(np.random, name, None) if isinstance(name, str) else None
        # (the base class itself cannot be made: a forged "BitGenerator" raised a raw NotImplementedError)
        if not (isinstance(cls, type) and issubclass(cls, np.random.BitGenerator)) or cls is np.random.BitGenerator:
            raise RecoveryError(f"{what}: not the state of a NumPy bit generator ({name!r})")
        holder = Holder(KIND_RNG, cls())
    elif kind == KIND_JSON:
        holder = Holder(KIND_JSON, Value())
    else:
        raise RecoveryError(f"{what}: unknown kind of Python state {kind!r}")
    holder.apply(holder.decode(data, what))
    return holder.obj


def loads(data: bytes | np.ndarray, what: str) -> Any:
    """The JSON value of a stored Python state (for one not protected now); :class:`RecoveryError`."""
    return _loads(data.tobytes() if isinstance(data, np.ndarray) else data, what)


def kind_of(info: Any) -> str:
    """The Python-state kind a file's variable table gives a variable ('' for an array)."""
    extra = getattr(info, "extra", None) or {}
    kind = extra.get(EXTRA_KEY, "")
    return kind if isinstance(kind, str) else ""


def show(kind: str, data: bytes) -> str:
    """A readable line for ``inspect``: the stored value (or why it cannot be read)."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"not valid JSON ({exc})"
    if kind == KIND_RNG and isinstance(value, dict):
        return f"{value.get('bit_generator')} state {reprlib.repr(value.get('state'))}"
    text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    return text if len(text) <= 400 else text[:400] + "..."


def read_states(fh: Any, parsed: Any) -> dict[int, tuple[str, str]]:
    """For ``inspect``: var id -> (kind, readable value) of every Python state in a parsed FTI-FF file,
    read only after its containers' hashes are checked (a damaged one says so instead)."""
    from ..ftiff.reader import read_into, verify_data
    from ..model.arrays import ArrayBytes
    from ..model.errors import FormatError

    kinds = {vid: kind_of(info) for vid, info in parsed.vars.items() if kind_of(info)}
    if not kinds:
        return {}
    buffers = {vid: np.empty(parsed.vars[vid].nbytes, np.uint8) for vid in kinds}
    try:
        verify_data(fh, parsed, set(kinds))
        read_into(fh, parsed, {vid: ArrayBytes(buf) for vid, buf in buffers.items()})
    except (FormatError, OSError) as exc:
        return {vid: (kind, f"cannot be shown: {exc}") for vid, kind in kinds.items()}
    return {vid: (kind, show(kind, buffers[vid].tobytes())) for vid, kind in kinds.items()}
