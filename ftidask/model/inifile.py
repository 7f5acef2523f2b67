"""FTI's config files read as FTI's iniparser reads them: sections and ``key = value`` lines, a line's leading
blanks dropped, a value continued on the next line by a trailing backslash, a key or section given twice (the last
value wins, the sections merge), inline comments cut. Only the text: :mod:`.config` checks the keys and values."""

from __future__ import annotations

import configparser
import os
import re
import stat
from collections.abc import Mapping

from .errors import ConfigError

_MAX_CONFIG_BYTES = 1 << 20  # an FTI config is a few KiB: more is not a config file


def read_text(path: str | bytes | os.PathLike[str]) -> str:
    """The text of a config file, or a :class:`ConfigError` saying why it cannot be read."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        hint = ("; give settings as keywords instead, e.g. init(**settings) or init(ckpt_dir=...)"
                if isinstance(path, Mapping) else "")
        raise ConfigError(f"the config must be the path of an INI file, got {type(path).__name__} {path!r}{hint}")
    shown = repr(os.fsdecode(path))
    try:
        # O_NONBLOCK: a FIFO given as the config must not wait for a writer (refused below).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file {shown} does not exist") from None
    except (OSError, ValueError) as exc:  # permissions, a NUL in the path...
        raise ConfigError(f"cannot open config file {shown}: {exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"config file {shown} is a directory; give the path of an INI file")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"config file {shown} is not a regular file")
        with open(fd, "rb", closefd=False) as handle:
            raw = handle.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {shown}: {exc}") from None
    finally:
        os.close(fd)
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {shown} is larger than {_MAX_CONFIG_BYTES >> 20} MiB: not an INI file")
    try:
        return raw.decode("utf-8-sig")  # an editor's byte-order mark is no error
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {shown} is not a text (UTF-8) INI file: byte {exc.start} is "
                          f"{raw[exc.start:exc.start + 1]!r}") from None


def read_sections(path: str | os.PathLike[str]) -> list[tuple[str, str, str]]:
    """``(section, key lowercased, value)`` of every key of the config file ``path``, as FTI's iniparser reads them."""
    text = read_text(path)
    shown = repr(os.fsdecode(path))  # type: ignore[arg-type]  # checked by read_text
    # No [DEFAULT] section with INI's meaning: FTI (iniparser) has none, and its keys would
    # appear in every section. Not strict: iniparser takes a key set twice (the last value) and a section
    # given twice (merged).
    # Inline comments are cut by iniparser_value, as FTI's iniparser cuts them (no space needed before them).
    parser = configparser.ConfigParser(interpolation=None, default_section="\0no default section", strict=False)
    # Each line stripped of its leading blanks, as iniparser reads it: an indented line is a key of its own, where
    # configparser would append it to the value before (a directory named "./Local\nckpt_l1 = 5", ckpt_l1 unset);
    # a line ending in a backslash is continued by the next one (iniparser's multi-line values).
    lines: list[str] = []
    continued = False
    for line in text.splitlines():
        line = line if continued else line.lstrip()  # (a continuation's own blanks are kept, as iniparser keeps them)
        if continued:
            lines[-1] += line
        else:
            lines.append(line)
        continued = lines[-1].rstrip().endswith("\\")
        if continued:
            lines[-1] = lines[-1].rstrip()[:-1]
    try:
        parser.read_string("\n".join(lines), source=os.fsdecode(path))  # type: ignore[arg-type]
    except configparser.Error as exc:
        # configparser's message spans lines (file, line number, the line itself): an error is one line.
        detail = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        raise ConfigError(f"config file {shown} is not a valid INI file: {detail}") from None
    return [(section, key.lower(), value) for section in parser.sections() for key, value in parser.items(section)]


def iniparser_value(raw: str) -> str:
    """``raw`` as FTI's iniparser reads a value (parse_line): a quoted one between its quotes (spaces, ``;`` and ``#``
    kept, what follows the closing quote dropped; ``""`` is empty), an unquoted one up to its first ``;`` or ``#``."""
    text = raw.strip()
    if text[:1] in ("'", '"') and text.find(text[0], 1) > 0:
        return text[1:text.find(text[0], 1)]
    return re.split(r"[;#]", text, maxsplit=1)[0].strip()
