"""The slow run's share of a fault campaign: the first few parameters of a matrix run with ``-m slow`` (CI's
budget), the rest are marked ``campaign`` and run only when ``-m`` names it (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def kept(values: Iterable, keep: int | Iterable) -> list:
    """``values``, each past the first ``keep`` (or not in ``keep``, a collection) marked ``campaign``; a tuple
    is the values of several argument names, as parametrize takes them."""
    values = list(values)
    keep_set = set(values[:keep]) if isinstance(keep, int) else set(keep)
    return [v if v in keep_set else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.campaign)
            for v in values]
