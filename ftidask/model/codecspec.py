"""A user's compressor spec (``zstd:3``, ``blosc-lz4``, ...) checked and turned into a numcodecs config.

Pure: the codec itself is instantiated (and numcodecs imported) only by :mod:`ftidask.ftiff.compression`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError

#: Codec ids that may be named in a file; anything else is refused.
ALLOWED_IDS = ("blosc", "zstd", "lz4")
_BLOSC_CNAMES = ("lz4", "lz4hc", "zstd", "zlib", "blosclz")


def parse_compressor(spec: Any) -> dict[str, Any] | None:
    """The numcodecs config for a user's compressor spec, or None for no compression.

    Accepted: ``None``/``"none"``; ``"zstd"`` or ``"zstd:LEVEL"``; ``"lz4"`` or ``"lz4:ACCEL"``;
    ``"blosc"`` (LZ4 with byte shuffle), ``"blosc-CNAME"`` or ``"blosc-CNAME:CLEVEL"``; a numcodecs
    codec object or its config dict with one of the ids above.
    """
    if spec is None:
        return None
    if hasattr(spec, "get_config"):
        spec = spec.get_config()
    if isinstance(spec, Mapping):
        return check_config(dict(spec), ConfigError)
    text = str(spec).strip().lower()
    if text in ("", "none", "off", "0"):
        return None
    name, _, arg = text.partition(":")
    try:
        level = int(arg) if arg else None
    except ValueError:
        raise ConfigError(f"compressor {spec!r}: {arg!r} is not an integer level") from None
    if name == "zstd":
        return check_config({"id": "zstd", "level": 3 if level is None else level, "checksum": False},
                             ConfigError)
    if name == "lz4":
        return check_config({"id": "lz4", "acceleration": 1 if level is None else level}, ConfigError)
    if name == "blosc" or name.startswith("blosc-"):
        cname = name.partition("-")[2] or "lz4"
        if cname not in _BLOSC_CNAMES:
            raise ConfigError(f"compressor {spec!r}: Blosc compressor {cname!r} is not one of "
                              f"{', '.join(_BLOSC_CNAMES)}")
        return check_config({"id": "blosc", "cname": cname, "clevel": 5 if level is None else level,
                              "shuffle": 1, "blocksize": 0}, ConfigError)
    raise ConfigError(f"compressor {spec!r} is unknown; use none, zstd[:LEVEL], lz4[:ACCEL], "
                      "blosc or blosc-CNAME[:CLEVEL]")


#: The integer parameters a user may set, with their valid range: numcodecs passes them to C as
#: they are, where an out-of-range value fails only at the first checkpoint (or overflows).
_INT_PARAMS = {"zstd": {"level": (-(1 << 17), 22)}, "lz4": {"acceleration": (-(2**31), 2**31 - 1)},
               "blosc": {"clevel": (0, 9), "shuffle": (-1, 2), "blocksize": (0, 2**31 - 1), "typesize": (1, 255)}}
_OPTIONAL = {"typesize"}  # None: numcodecs takes the buffer's item size


def check_config(config: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
    """``config`` when its id is allowed and its integer parameters are in range, else ``error``
    (a user's config: ConfigError; a file's: FormatError)."""
    if config.get("id") not in ALLOWED_IDS:
        raise error(f"codec {config.get('id')!r} is not allowed; ftidask uses {', '.join(ALLOWED_IDS)}")
    for name, (lo, hi) in _INT_PARAMS[config["id"]].items():
        value = config.get(name, lo)
        if value is None and name in _OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise error(f"compressor {config['id']}: {name} must be an integer in [{lo}, {hi}], got {value!r}")
    if config["id"] == "blosc" and config.get("cname", "lz4") not in _BLOSC_CNAMES:
        raise error(f"compressor blosc: cname must be one of {', '.join(_BLOSC_CNAMES)}, got {config['cname']!r}")
    return config
