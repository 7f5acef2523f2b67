"""One rank's failure becomes every rank's error: local steps of the collective paths, then agreement.

A collective path (checkpoint, recovery, init, finalize) alternates local work and collectives
(allgather, barrier, a level's exchanges). A rank that raises between two collectives leaves the
others waiting in the next one until the job's walltime. So every local step runs through
:func:`attempt`, which turns any exception into a message, and the ranks meet in :func:`agree`
(one allgather), which raises the same ftidask error on every rank if any of them failed.

Transport-neutral: ``t`` is anything with ``rank`` and ``allgather`` (a
:class:`~ftidask.transport.base.Transport`); with one process the same code runs and raises the
same errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ..model import errors as _errors
from ..model.errors import FTIError

log = logging.getLogger("ftidask")
T = TypeVar("T")
#: ftidask's error classes by name: a refused argument keeps its class on every rank (:func:`agree_call`).
FTI_ERRORS = {name: cls for name, cls in vars(_errors).items() if isinstance(cls, type) and issubclass(cls, FTIError)}

#: What ranks in different collective calls (or steps) are told, whichever collective found it.
DIFFERENT_CALLS = ("the ranks made different collective calls (checkpoint, recover and the like are collective: every "
                   "rank makes the same call with the same arguments, in the same order)")


def reason(exc: BaseException) -> str:
    """What went wrong, in one line: the message of an ftidask or OS error, else the exception's type too."""
    if isinstance(exc, (FTIError, OSError)):
        return str(exc) or type(exc).__name__
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def guarded(errors: list[str], step: Callable[[], T], default: Any = None, what: str = "") -> T | Any:
    """Run a local ``step``: its result, or ``default`` with why it failed appended to ``errors``.

    Catches every :class:`Exception` (MemoryError and unexpected ones included: the peers must
    hear of it); an unexpected one is logged with its traceback on this process. The L2/L3 levels
    use it between a group's collectives, where raising would leave the group waiting.
    """
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - reported to every rank (agree(), or a level's error)
        if not isinstance(exc, (FTIError, OSError)):
            log.error("unexpected %s%s", type(exc).__name__, f" ({what})" if what else "", exc_info=True)
        errors.append(f"{what}: {reason(exc)}" if what else reason(exc))
        return default


def attempt(rank: int, step: Callable[[], T], default: Any = None, who: str = "") -> tuple[T | Any, str]:
    """Run a local ``step``: ``(its result, "")``, or ``(default, "rank R: why")`` if it raised (:func:`guarded`;
    ``who`` instead of "rank R" where the ranks are not the application's: the heads')."""
    errors: list[str] = []
    result = guarded(errors, step, default, who or f"rank {rank}")
    return result, "; ".join(errors)


def agree(t: Any, error: str, error_type: type[FTIError], what: str, value: Any = None) -> list[Any]:
    """Collective: every rank's JSON-able ``value``, by rank; or, when any rank has an ``error``,
    the same ``error_type("{what}: {every rank's error}")`` raised on every rank."""
    results = t.allgather([error, value])
    if not all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) for r in results):
        # A rank in another collective step (an API call's agree_call, another collective) sent something else
        raise error_type(f"{what}: {DIFFERENT_CALLS}")
    errors = [e for e, _v in results if e]
    if errors:
        raise error_type(f"{what}: " + "; ".join(errors))
    return [v for _e, v in results]


def gather_tagged(t: Any, tag: str, value: Any, error_type: type[FTIError]) -> list[Any]:
    """Collective: every rank's JSON-able ``value``, by rank, from ranks all at the step named ``tag``; a rank
    elsewhere (another call's collective) makes every rank that meets it raise ``error_type``, never a raw error."""
    results = t.allgather([tag, value])
    if not all(isinstance(r, list) and len(r) == 2 and r[0] == tag for r in results):
        raise error_type(f"{tag}: {DIFFERENT_CALLS}")
    return [v for _tag, v in results]


def everywhere(t: Any, step: Callable[[], T], error_type: type[FTIError], what: str) -> T:
    """Run a local ``step`` on every rank, then :func:`agree`: its result, or the same error everywhere."""
    result, error = attempt(t.rank, step)
    agree(t, error, error_type, what)
    return result


def on_root(t: Any, step: Callable[[], Any], error_type: type[FTIError], what: str, root: int = 0,
            who: str = "") -> Any:
    """Run ``step`` on rank ``root`` only; its (JSON-able) result on every rank, or the same error everywhere
    (naming ``who`` ran it, default "rank {root}").

    Replaces ``bcast(step() if rank == root else None)`` and ``if rank == root: step(); barrier()``.
    """
    result, error = attempt(t.rank, step, who=who) if t.rank == root else (None, "")
    return agree(t, error, error_type, what, result if t.rank == root else None)[root]


def agree_call(t: Any, call: str, step: Callable[[], tuple[Any, T]], error_type: type[FTIError],
               shown: str | None = None) -> T:
    """Collective, the first step of a collective API call (``checkpoint``, ``recover``...): every rank checks its
    own arguments (``step``), then the ranks compare their calls in one allgather.

    ``step`` returns ``(shared, mine)``: ``shared`` (JSON: the call's parsed arguments) must be the same on
    every rank, ``mine`` is this rank's own result. A rank whose arguments are refused, ranks that disagree on
    them, or ranks in different collective calls (one ``checkpoint``, another ``recover``) would otherwise run
    unrelated collectives: wrong data paired silently (a checkpoint committed with another id on each rank),
    raw errors, or a hang. Instead every rank raises the same error here (the refused arguments' own ftidask
    error class when every failing rank raised that one, else ``error_type``), naming each rank's call (``shown``:
    its arguments as the application wrote them, else ``shared``). One rank: ``step`` alone.
    """
    if t.size == 1:
        return step()[1]
    try:
        shared, mine = step()
        error, kind = "", ""
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        shared, mine = None, None
        error, kind = reason(exc), type(exc).__name__ if isinstance(exc, FTIError) else ""
    calls = t.allgather([call, shared, error, kind, call + (_args(shared) if shown is None else shown)])
    # A rank in another collective step altogether (not an API call's) sent something else: a different call too.
    calls = [c if isinstance(c, list) and len(c) == 5 and isinstance(c[4], str) else
             ["", None, "", "", "another collective step"] for c in calls]
    if any(c[0] != call for c in calls) or (not any(c[2] for c in calls) and any(c[1] != shared for c in calls)):
        # One class on every rank: the call's own where they all made it (with other arguments), else FTIError (a
        # rank's call's class would differ from rank to rank, and an application's handlers with it).
        cls = error_type if all(c[0] == call for c in calls) else FTIError
        raise cls(f"{DIFFERENT_CALLS}: "
                         + "; ".join(f"{_ranks(r)}: {text}" for text, r in _grouped(c[4] for c in calls).items()))
    errors = _grouped(c[2] for c in calls)  # each reason once, with its ranks (a level every rank refuses)
    errors.pop("", None)
    if errors:
        kinds = {c[3] for c in calls if c[2]}
        cls = FTI_ERRORS.get(kinds.pop(), error_type) if len(kinds) == 1 else error_type
        raise cls(f"{call}: " + "; ".join(f"{_ranks(ranks)}: {why}" for why, ranks in errors.items()))
    return mine


def _grouped(texts: Any) -> dict[str, list[int]]:
    """Each distinct text once, with the ranks that gave it: a job of 4096 ranks is named in a few lines."""
    groups: dict[str, list[int]] = {}
    for r, text in enumerate(texts):
        groups.setdefault(text, []).append(r)
    return groups


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 4, 8-4095``: runs of ranks as ranges, at most 8 of them named."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:8])
    more = sum(b - a + 1 for a, b in runs[8:])
    return f"ranks {shown}" + (f" and {more} more" if more else "")


def _args(shared: Any) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in shared.items()) + ")" if isinstance(shared, dict) else "(?)"
