"""Variables found by name (FTI_setIDFromString, FTI_getIDFromString).

FTI gives a name an id the first time the name is asked for, one after the ids already known, and
finds the same id again on a restart in the checkpoint's metadata. ftidask does the same with the
names that every checkpoint holds: the variable table of each FTI-FF file, a Dask commit record's
variables. A run whose names are asked for in another order on a restart gets the same ids back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..engine import reshard
from ..engine.runstate import STATUS_FRESH
from ..model.errors import NoCheckpointError, ProtectError, RecoveryError


class VarNames:
    """The ids given to names in this context, and the names of the checkpoint a restart recovers."""

    def __init__(self) -> None:
        # No reference to the context (a cycle would keep a dropped context, and its run lock, alive until
        # the garbage collector runs): the reader of the checkpoint's names is passed to each call.
        self._stored: dict[int, str] | None = None
        self._stored_ids: dict[str, int] = {}  # name -> its lowest id among the stored ones
        self._stored_top = -1
        self._given: dict[str, int] = {}
        self._given_names: dict[int, str] = {}  # id -> the first name given to it (name_of)
        self._given_top = -1
        self._default_like: set[int] = set()  # ids protected under a name of the form var{k}: another's default

    def id_for(self, name: Any, protected: Mapping[int, Any], create: bool,
               stored_names: Callable[[], dict[int, str]]) -> int | None:
        """The id named ``name``: given before, then a protected variable's, then one of the checkpoint's
        (``stored_names`` reads them, once; {} on a fresh start); else a new id (one above every id known)
        when ``create``, else None."""
        # Read first, whatever is found below and whatever the name: on MPI the first read is collective, and
        # every rank must take part (a rank whose name is refused too, or the others would wait for it).
        if self._stored is None:
            stored = stored_names()
            # Indexed once: a scan of the sorted stored names and a max of every id known per call made n names
            # given O(n^2) (10,000: 2 s, 7 s on a restart). Built aside, kept last: a Ctrl-C in the middle left the
            # names marked read but half indexed, and the next call gave stored names new ids (variables swapped).
            ids = {stored[vid]: vid for vid in sorted(stored, reverse=True)}
            self._stored_ids, self._stored_top, self._stored = ids, max(stored, default=-1), stored
        if not isinstance(name, str) or not name:
            raise ProtectError(f"a variable name is a non-empty str, got {name!r}")
        if not isinstance(create, (bool, np.bool_)):  # "no" would be true, and give the name a new id
            raise ProtectError(f"var_id(create=...) takes True or False, got {create!r}")
        found = self._given.get(name)
        if found is None:
            named = getattr(protected, "named", None)  # the context's VarTable: its index of names
            found = named(name) if named is not None else next(
                (vid for vid, p in protected.items() if p.name == name), None)
        if found is None:
            found = self._stored_ids.get(name)
        if found is None and create:
            top = getattr(protected, "top", None)
            found = max(top() if top is not None else max(protected, default=-1), self._given_top,
                        self._stored_top) + 1
        if found is not None:
            self._given[name] = found
            self._given_names.setdefault(found, name)
            self._given_top = max(self._given_top, found)
        return found

    def owner(self, name: Any) -> int | None:
        """The id :meth:`id_for` gave ``name``, if any."""
        return self._given.get(name) if isinstance(name, str) else None

    def check_default(self, vid: int, name: str | None, protected: Mapping[int, Any]) -> None:
        """Before ``protect(vid, ..., name)`` (``name`` after :meth:`name_of`): a new variable without a name is
        called var{vid}, which must not be another variable's name (protected under it, or given it by var_id). Only
        the variables protected under a name of that form are looked at: no scan per protect."""
        if name is not None:
            if name != f"var{vid}" and re.fullmatch(r"var\d+", name):  # its own default is no other's
                self._default_like.add(vid)
            return
        if vid in protected:  # it keeps the name it has
            return
        default = f"var{vid}"
        other = next((v for v in sorted(self._default_like) if v in protected and protected[v].name == default),
                     self.owner(default))
        if other is not None and other != vid:
            raise ProtectError(f"protect({vid}, ...) without a name names it {default}, which is variable {other}'s "
                               "name; a name names one variable (var_id finds it): give this one a name (name=...)")

    def name_of(self, vid: int) -> str | None:
        """The name given to ``vid`` through :meth:`id_for`, if any (what :meth:`Context.protect` records)."""
        return self._given_names.get(vid)


def restart_names(status: int, recovery: Any) -> dict[int, str]:
    """The names (by id) of the checkpoint a restart recovers: {} on a fresh start, or when none verifies
    (the recovery that follows says why). ``recovery``: the context's :class:`~ftidask.engine.recovering.Recovery`."""
    if status == STATUS_FRESH:
        return {}
    try:
        return {vid: info.name for vid, info in recovery.restart_metadata().vars.items()}
    except (NoCheckpointError, RecoveryError) as exc:
        record = getattr(exc, "redistributed", None)  # of another layout (a resharded restart): the old files
        return {} if record is None else reshard.old_names(recovery, record)  # hold the names
