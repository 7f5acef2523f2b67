"""A checkpoint level, parsed once: FTI's numbers 1-4, and 5-8 for their differential versions.

Levels 5-8 (FTI's ``L1_DCP``..``L4_DCP``) keep their files where levels 1-4 keep them and get the same
redundancy; only the way the rank file is written differs. Code below the API asks a :class:`Level`
for ``base`` (where the files live, which redundancy) and ``differential``, never does arithmetic on
the number.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .constants import DCP_LEVELS, LEVELS
from .errors import LevelError


@dataclasses.dataclass(frozen=True)
class Level:
    """One checkpoint level: ``base`` 1-4 and whether the checkpoint is differential."""

    base: int
    differential: bool = False

    @property
    def number(self) -> int:
        """FTI's number for the level: 1-4, or 5-8 when differential."""
        return self.base + 4 if self.differential else self.base

    def __int__(self) -> int:
        return self.number

    def __str__(self) -> str:
        return str(self.number)

    @classmethod
    def of(cls, number: int) -> Level:
        """The level FTI numbers ``number`` (1-8), as recorded by ftidask itself (no configuration check)."""
        return cls(number - 4, True) if number in DCP_LEVELS else cls(number)

    @classmethod
    def parse(cls, value: Any, *, dcp: bool = False, enable_dcp: bool = False) -> Level:
        """The level a user asked for: ``value`` 1-8 (5-8 only with ``enable_dcp``), or 1-4 with ``dcp=True``.

        Anything else (a bool, a float, 9, "2") is a :class:`LevelError` saying what is accepted.
        """
        if not isinstance(dcp, (bool, np.bool_)):  # "no" would be true, and ask for a differential checkpoint
            raise LevelError(f"checkpoint(dcp=...) takes True or False, got {dcp!r}")
        number = int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None
        if number in LEVELS:
            if dcp and not enable_dcp:
                raise LevelError(f"level {number} with dcp=True (differential checkpointing) needs enable_dcp = 1")
            return cls(number, bool(dcp))
        if number in DCP_LEVELS:
            if not enable_dcp:
                raise LevelError(f"level {number} (differential checkpointing) needs enable_dcp = 1")
            return cls(number - 4, True)
        raise LevelError(f"unknown checkpoint level {value!r}; FTI's levels are 1, 2, 3 and 4 "
                         "(5-8 for differential checkpoints, with enable_dcp = 1)")
