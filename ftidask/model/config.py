"""FTI-style configuration: an INI file with [basic], [restart], [advanced], plus overrides.

One frozen dataclass; every key has a default, a parser and a validation, so that a
bad value is reported with its section, key and value before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from .codecspec import parse_compressor
from .errors import ConfigError
from .inifile import iniparser_value, read_sections
from .pathnames import NAME_MAX, path_problem

_TRUE = {"1", "true", "yes", "on", "t", "y"}  # t/y, f/n: as FTI's iniparser_getboolean reads them
_FALSE = {"0", "false", "no", "off", "f", "n"}
#: Every integer key is bounded (FTI reads them as C ints): a huge value is a typo, and would
#: overflow where it is used (a float timeout, a C call).
_INT_MAX = 2**31 - 1
#: MPI guarantees tags up to 32767 only (MPI_TAG_UB may be larger, never smaller).
_MPI_TAG_MAX = 32767


def _parse_int(lo: int | None = None, hi: int = _INT_MAX) -> Callable[[str, Any], int]:
    def parse(key: str, value: Any) -> int:
        text = "" if isinstance(value, int) else str(value).strip()  # (a bool is an int)
        number = int(value) if isinstance(value, int) else _c_integer(text) if len(text) <= 64 else -1 - 2**64
        if number is None:
            raise ConfigError(f"config key {key!r}: expected an integer, got {value!r}")
        if lo is not None and number < lo or number > hi:  # (over 64 characters: no key's, and int() refused them)
            shown = text[:12] + f"... ({len(text)} characters)" if len(text) > 64 else number if abs(
                number) < 10**30 else f"{str(number)[:12]}... ({len(str(number))} digits)"
            raise ConfigError(f"config key {key!r}: {shown} is outside [{lo if lo is not None else -hi - 1}, {hi}]")
        return number

    return parse


_parse_c_int = _parse_int(-_INT_MAX - 1)


def _parse_interval(key: str, value: Any) -> int:
    """A snapshot() interval: any C int, as FTI reads it; FTI checks ``ckptIntv > 0``, so below 0 is 0 (never): its
    own default is -1, which a config file may hold."""
    return max(0, _parse_c_int(key, value))


def _c_integer(text: str) -> int | None:
    """An integer as FTI's iniparser_getint (``strtol(text, NULL, 0)``) reads it: ``010`` is 8, ``0x10`` 16. What strtol
    cuts short or reads as 0 (``5min``, ``08``, ``1_0``, other scripts' digits): None, refused."""
    if (match := _C_INTEGER.fullmatch(text)) is None:
        return None
    sign, hexa, octal, decimal = match.groups()
    number = int(hexa, 16) if hexa else int(octal, 8) if octal else int(decimal, 10)
    return -number if sign == "-" else number


_C_INTEGER = re.compile(r"([+-]?)(?:0[xX]([0-9a-fA-F]+)|0([0-7]+)|([1-9][0-9]*|0))", re.ASCII)


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"config key {key!r}: expected a boolean, 0/1, true/false, yes/no or on/off, got {value!r}")


def _parse_str(key: str, value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise ConfigError(f"config key {key!r}: empty value")
    return text


def _parse_dir(key: str, value: Any) -> str:
    if isinstance(value, (bytes, os.PathLike)):  # str(b"/x") would be the name "b'/x'"
        value = os.fsdecode(value)
    if not isinstance(value, str):  # None or 3 would be the directories "./None" and "./3"
        raise ConfigError(f"config key {key!r}: expected a directory path (str or os.PathLike), got {value!r}")
    text = _parse_str(key, value)
    # what the OS is given (no NUL, encodable, names and length it takes), with room for the run's names under it
    problem = path_problem(text, room=NAME_MAX)
    if problem:
        raise ConfigError(f"config key {key!r}: {text[:80]!r} cannot be a directory name: {problem}")
    return text


def _parse_opt_str(key: str, value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def _parse_choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {', '.join(choices)}")
        return text

    return parse


#: FTI's I/O modes (``ckpt_io``): ftidask writes FTI-FF (3) whatever the config says, and ``init`` warns.
IO_MODES = {1: "POSIX", 2: "MPI-IO", 3: "FTI-FF", 4: "SIONlib", 5: "HDF5", 6: "IME"}


def _parse_ckpt_io(key: str, value: Any) -> int:
    # FTI's own config files say ckpt_io = 1 (its examples, its test matrix cycles through 1-5): they load.
    number = _parse_int()(key, value)
    if number not in IO_MODES:
        raise ConfigError(f"config key {key!r}: {number} is none of FTI's I/O modes "
                          f"({', '.join(f'{k} {v}' for k, v in IO_MODES.items())})")
    return number


def _parse_compressor(key: str, value: Any) -> str | None:
    text = _parse_opt_str(key, value)
    if text is not None:
        try:
            parse_compressor(text)
        except ConfigError as exc:
            raise ConfigError(f"config key {key!r}: {exc}") from None
    return text


# key -> (section, default, parser). FTI's key names; ftidask's additions are marked.
_KEYS: dict[str, tuple[str, Any, Callable[[str, Any], Any]]] = {
    "head": ("basic", 0, _parse_int(0, 1)),
    "node_size": ("basic", 1, _parse_int(1)),
    "ckpt_dir": ("basic", "./Local", _parse_dir),
    "glbl_dir": ("basic", "./Global", _parse_dir),
    "meta_dir": ("basic", "./Meta", _parse_dir),
    "ckpt_l1": ("basic", 0, _parse_interval),
    "ckpt_l2": ("basic", 0, _parse_interval),
    "ckpt_l3": ("basic", 0, _parse_interval),
    "ckpt_l4": ("basic", 0, _parse_interval),
    "dcp_l4": ("basic", 0, _parse_interval),  # FTI's: snapshot() interval of level 8 (differential L4)
    "inline_l2": ("basic", 1, _parse_bool),
    "inline_l3": ("basic", 1, _parse_bool),
    "inline_l4": ("basic", 1, _parse_bool),
    "keep_last_ckpt": ("basic", 0, _parse_bool),
    "keep_l4_ckpt": ("basic", 0, _parse_bool),
    "group_size": ("basic", 4, _parse_int(1, 128)),
    "verbosity": ("basic", 2, _parse_int(1, 4)),
    "ckpt_io": ("basic", 3, _parse_ckpt_io),  # any of FTI's modes is read; FTI-FF is written
    "enable_staging": ("basic", 0, _parse_bool),
    "enable_dcp": ("basic", 0, _parse_bool),
    "dcp_mode": ("basic", 3, _parse_int(0, 5)),  # 1 MD5, 2 CRC32 (FTI's); 3 xxh3_128, 4 BLAKE2b, 5 xxh3_64; 0 MD5
    "dcp_block_size": ("basic", 16384, _parse_int()),  # 512..65535 with enable_dcp (load_config), else kept, unused
    "dcp_page_tracking": ("basic", 1, _parse_bool),  # ftidask: hash only blocks whose pages were written
    "max_sync_intv": ("basic", 0, _parse_interval),  # any C int, < 0 is 0 (FTI's 512, as FTI reads -1)
    "failure": ("restart", 0, _parse_int(0, 3)),
    "exec_id": ("restart", None, lambda k, v: None if _parse_opt_str(k, v) == "NULL" else _parse_opt_str(k, v)),
    "block_size": ("advanced", 1024, _parse_int(1)),  # KiB, FTI's unit
    "transfer_size": ("advanced", 16, _parse_int(1)),  # MiB, FTI's unit
    "mpi_tag": ("advanced", 2612, _parse_int(0, _MPI_TAG_MAX)),
    "local_test": ("advanced", 0, _parse_bool),
    # ftidask's additions.
    "hash": ("advanced", "xxh3_128", _parse_choice("xxh3_128", "md5")),
    "snapshot_unit": ("advanced", "minutes", _parse_choice("minutes", "iterations")),
    "l4_format": ("advanced", "ftiff", _parse_choice("ftiff", "zarr")),
    "compressor": ("advanced", None, _parse_compressor),
    "stage_timeout": ("advanced", 600, _parse_int(0)),
    "stage_allow_outside": ("advanced", 0, _parse_bool),
    "stage_mover": ("advanced", "auto", _parse_choice("auto", "thread", "process")),
    "progress": ("advanced", "auto", _parse_choice("auto", "on", "off")),
    "permissions": ("advanced", "private", _parse_choice("private", "group")),
    "async_ckpt": ("advanced", 0, _parse_bool),  # checkpoint() and snapshot() return once the snapshot is taken
    "max_inflight": ("advanced", 1, _parse_int(1, 64)),  # asynchronous checkpoints queued or being written
    "async_snapshot": ("advanced", "auto", _parse_choice("auto", "cow", "copy", "blocking")),
    "async_buffer_mb": ("advanced", 0, _parse_int(0)),  # copy snapshots' staging buffers; 0: half of MemAvailable
    "direct_io": ("advanced", 0, _parse_bool),  # L1/L4 rank files' data written around the page cache
}

#: The keys every rank of a job must read alike (its layout, levels, collective steps and run): one rank's own value
#: would hang the job in a collective call it makes alone, or write files that the others' records contradict.
#: Directories, verbosity and modes may differ (a node's own local disk, one rank's log).
JOB_WIDE_KEYS = ("head", "node_size", "group_size", "local_test", "ckpt_l1", "ckpt_l2", "ckpt_l3", "ckpt_l4",
                 "dcp_l4", "inline_l2", "inline_l3", "inline_l4", "keep_last_ckpt", "keep_l4_ckpt", "enable_dcp",
                 "dcp_mode",
                 "dcp_block_size", "max_sync_intv", "exec_id", "hash", "l4_format", "async_ckpt", "max_inflight",
                 "snapshot_unit", "mpi_tag", "enable_staging", "block_size", "transfer_size")  # (L2/L3's pieces)

#: FTI keys that are accepted and have no effect in ftidask (they tune FTI's C I/O paths, its
#: POSIX/HDF5 modes, its fault injection), in any section: FTI's own files load as they are.
_IGNORED_KEYS = {"lustre_stiping_unit", "lustre_stiping_factor", "lustre_stiping_offset", "ckpt_net",
                 "gpu_host_bufsize", "enable_hdf5", "h5_single_file_enable", "h5_single_file_dir",
                 # FTI 1.x's examples and conf.c
                 "lustre_striping_unit", "lustre_striping_factor", "lustre_striping_offset",
                 "keep_heads_alive", "dcp_stack_size", "cacheddcp", "h5_single_file_prefix", "h5_single_file_keep",
                 "general_tag", "ckpt_tag", "stage_tag", "final_tag", "profile_dir"}
#: FTI's sections whose keys ftidask never uses ([injection]: FTI's bit-flip injection).
_IGNORED_SECTIONS = {"injection"}


@dataclasses.dataclass(frozen=True)
class Config:
    """A validated ftidask configuration. Build it with :func:`load_config`."""

    head: int = 0
    node_size: int = 1
    ckpt_dir: str = "./Local"
    glbl_dir: str = "./Global"
    meta_dir: str = "./Meta"
    ckpt_l1: int = 0
    ckpt_l2: int = 0
    ckpt_l3: int = 0
    ckpt_l4: int = 0
    dcp_l4: int = 0
    inline_l2: bool = True
    inline_l3: bool = True
    inline_l4: bool = True
    keep_last_ckpt: bool = False
    keep_l4_ckpt: bool = False
    group_size: int = 4
    verbosity: int = 2
    ckpt_io: int = 3
    enable_staging: bool = False
    enable_dcp: bool = False
    dcp_mode: int = 3
    dcp_block_size: int = 16384
    dcp_page_tracking: bool = True
    max_sync_intv: int = 0
    failure: int = 0
    exec_id: str | None = None
    block_size: int = 1024
    transfer_size: int = 16
    mpi_tag: int = 2612
    local_test: bool = False
    hash: str = "xxh3_128"
    snapshot_unit: str = "minutes"
    l4_format: str = "ftiff"
    compressor: str | None = None
    stage_timeout: int = 600
    stage_allow_outside: bool = False
    stage_mover: str = "auto"
    progress: str = "auto"
    permissions: str = "private"
    async_ckpt: bool = False
    max_inflight: int = 1
    async_snapshot: str = "auto"
    async_buffer_mb: int = 0
    direct_io: bool = False

    def interval(self, level: int) -> int:
        """The snapshot interval of ``level`` (minutes or iterations; 0 = never): 1-4, or 8 (``dcp_l4``)."""
        return self.dcp_l4 if level == 8 else (self.ckpt_l1, self.ckpt_l2, self.ckpt_l3, self.ckpt_l4)[level - 1]

    def direct_writes(self, level: int) -> bool:
        """Whether ``level``'s rank files are written around the page cache (``direct_io``; levels 1 and 4: levels 2
        and 3 read the file back at once for the partner copy or the parity, from the page cache)."""
        return self.direct_io and level in (1, 4)

    def with_absolute_dirs(self) -> Config:
        """A copy whose ``ckpt_dir``, ``glbl_dir`` and ``meta_dir`` are absolute, taken from the current
        directory now: a later ``os.chdir`` of the application changes no directory of the run."""
        return dataclasses.replace(self, **{key: os.path.abspath(getattr(self, key))
                                            for key in ("ckpt_dir", "glbl_dir", "meta_dir")})

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` parsed and validated like file values."""
        return load_config(None, base=self, **changes)


def _read_ini(path: str | os.PathLike[str]) -> dict[str, Any]:
    items = read_sections(path)  # (checks ``path`` too)
    shown = repr(os.fsdecode(path))  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for section, key, value in items:
        if section.strip().lower() in _IGNORED_SECTIONS or key in _IGNORED_KEYS:
            continue
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS) + sorted(_IGNORED_KEYS), n=1)
            raise ConfigError(f"config file {shown}: unknown key [{section}] {key} = {value!r}"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        # FTI reads each key from its own section only: one elsewhere would be silently unused there.
        home = _KEYS[key][0]
        if section.strip().lower() != home:
            raise ConfigError(f"config file {shown}: key {key!r} is in [{section}]; it belongs in [{home}]")
        values[key] = iniparser_value(value)
    return values


def load_config(path: str | os.PathLike[str] | Config | None = None, *, base: Config | None = None,
                **overrides: Any) -> Config:
    """Read an FTI-style INI file (or none, or take a :class:`Config`) and apply keyword ``overrides``;
    validate everything. ``base``: a :class:`Config` whose values the file's and the overrides replace."""
    if isinstance(path, Config):  # init(load_config(...)): a config already built
        base, path = path, None
    if base is not None and not isinstance(base, Config):
        raise ConfigError(f"load_config(base=...) takes an ftidask.Config, got {type(base).__name__} {base!r}")
    raw: dict[str, Any] = dataclasses.asdict(base) if base is not None else {}
    if path is not None:
        raw.update(_read_ini(path))
    for key, value in overrides.items():
        if key.lower() in _IGNORED_KEYS:  # FTI's keys a file may hold (ignored there): alike as keywords
            continue
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS), n=1)
            raise ConfigError(f"unknown config key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f"; known keys: {', '.join(sorted(_KEYS))}")
        raw[key] = value
    parsed: dict[str, Any] = {}
    for key, value in raw.items():
        section, _default, parse = _KEYS[key]
        if value is None and key in ("exec_id", "compressor"):
            parsed[key] = None
            continue
        parsed[key] = parse(f"[{section}] {key}", value)
    if parsed.get("exec_id") is not None:
        _check_exec_id(parsed["exec_id"])
    block = parsed.get("dcp_block_size", 16384)
    # FTI checks it with dCP on only (its own test template says -1 with dCP off). The value is kept as written, so
    # that a config that turns dCP on later (replace(), base=, init's keywords) meets it here and is refused.
    if not 512 <= block <= 65535 and parsed.get("enable_dcp"):
        raise ConfigError(f"config key '[basic] dcp_block_size': {block} is outside [512, 65535]")
    if parsed.get("dcp_l4") and not parsed.get("enable_dcp"):  # else snapshot() could never write level 8
        raise ConfigError("[basic] dcp_l4 (snapshot() interval of differential level-4 checkpoints) needs "
                          "enable_dcp = 1")
    return Config(**parsed)


def _check_exec_id(exec_id: str) -> None:
    check_exec_id(exec_id, "config key [restart] exec_id")  # it becomes a directory name


#: An exec_id names a directory: one safe path component.
_EXEC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_exec_id(value: Any, source: str = "exec_id") -> str:
    """``value`` if it is a valid exec_id (a single safe path component), else :class:`ConfigError`."""
    if not isinstance(value, str) or not _EXEC_ID.fullmatch(value):
        raise ConfigError(f"{source}: {value!r} is not a valid exec_id: it must be 1 to 128 ASCII letters, digits, "
                          "'-', '_' or '.', starting with a letter or a digit (it names a directory)")
    return value


def config_keys() -> Mapping[str, tuple[str, Any]]:
    """Every known key with its section and default (for docs and the CLI)."""
    return {key: (section, default) for key, (section, default, _parse) in _KEYS.items()}


def keys_in_file(path: str | os.PathLike[str]) -> set[str]:
    """The keys a config file sets itself (e.g. whether it sets ``verbosity``)."""
    return set(_read_ini(path))
