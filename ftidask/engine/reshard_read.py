"""Step 3 of a redistribution (:mod:`.reshard`): every rank reads and checks the pieces of its new arrays, and the
ranks agree that each has all its data before any protected array is written.

A split that cuts old containers (2 ranks onto 3: the middle rank takes the end of old file 0 and the start of old
file 1) has two or more new ranks each need part of one container, whose hash covers all of it. Each of them used to
read and hash it whole: the middle rank read three times what it loads. Now the ranks first share which containers
they need (one allgather of short lists) and one of them, its *verifier*, hashes each shared container whole (a rank
that needs all of it, else the one that needs most, the work spread over ranks); the others read only their part.
Their bytes are checked no less:

* a failed hash on the verifier fails the recovery on every rank at the agreement, as damage seen by any rank did;
* every rank parses each old file itself and checks, at the start and end of its reads, that it is still the file
  parsed (:func:`~ftidask.ftiff.parsedfile.check_unchanged`); at the agreement the ranks compare the identities
  (device, inode, size, modification and change times) of the files they shared, so that what a rank read is what
  its verifier hashed. Where they differ (a file replaced in between; a shared file system that two nodes number
  otherwise) that rank hashes the containers it trusted itself, in a second agreement, as before the work was
  shared;
* until the agreement a rank's bytes sit in private buffers or staged pages (arrays in use are read after it).

Compressed containers are decoded whole by each reader, hashed as they are read: they are not shared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..model.errors import FTIError, RecoveryError
from . import pagemove
from .prefault import Prefault
from .reshard_files import cut_needs, read_in_place, read_pieces, verified_first, verify_containers, verify_pieces

#: (old rank, block, container) of an old file's container.
Key = tuple[int, int, int]


def verifiers(needs: Sequence[Sequence[Sequence[int]]]) -> dict[Key, int]:
    """The rank that hashes each container that two or more ranks need, from every rank's :func:`cut_needs` (by
    rank: ``[old, block, container, size, bytes needed]`` lists). The same on every rank: a pure function of them.

    A rank that needs the whole container reads it all anyway; else the one that needs most (the fewest bytes read
    only to hash). Ties go to the rank with the least hashing given so far, then the lowest rank."""
    wanted: dict[Key, list[tuple[int, int, int]]] = {}
    for rank, mine in enumerate(needs):
        for old, bi, ci, size, nbytes in mine:
            wanted.setdefault((int(old), int(bi), int(ci)), []).append((rank, int(size), int(nbytes)))
    load = [0] * len(needs)
    out: dict[Key, int] = {}
    for key in sorted(wanted, key=lambda k: (-wanted[k][0][1], k)):  # the biggest first: the balance is on them
        readers = wanted[key]
        if len(readers) < 2:
            continue
        rank, size, _n = min(readers, key=lambda c: (c[2] < c[1], -c[2], load[c[0]], c[0]))
        out[key] = rank
        load[rank] += size
    return out


def trusted(rank: int, owners: dict[Key, int], mine: Sequence[Sequence[int]]) -> dict[int, frozenset[tuple[int, int]]]:
    """By old rank, the (block, container) that ``rank`` needs and another rank verifies."""
    out: dict[int, set[tuple[int, int]]] = {}
    for old, bi, ci, _size, _n in mine:
        owner = owners.get((int(old), int(bi), int(ci)))
        if owner is not None and owner != rank:
            out.setdefault(int(old), set()).add((int(bi), int(ci)))
    return {old: frozenset(keys) for old, keys in out.items()}


def verdict(reports: Sequence[Sequence[Any]], owners: dict[Key, int],
            needs: Sequence[Sequence[Sequence[int]]]) -> tuple[str, dict[int, list[Key]]]:
    """Why the ranks' staging fails (the first rank's problem; ``reports``: each rank's ``[problem, identities]``),
    or ''; and, by rank, the containers it must hash itself after all: those it read in part from another version of
    the file than its verifier hashed (identities: ``[old rank, device, inode, size, mtime_ns, ctime_ns]`` of each
    plain FTI-FF old file it parsed). Those differ for a file replaced between the two ranks' reads, and for one file
    seen from two nodes whose kernels number a shared file system otherwise: the rank then checks its own reads'
    file, as every rank did before the work was shared (:func:`check_own`)."""
    first = first_said([p for p, _ids in reports])
    if first:
        return first, {}
    files = [{int(i[0]): [int(x) for x in i[1:]] for i in ids} for _p, ids in reports]
    redo: dict[int, list[Key]] = {}
    for r, mine in enumerate(needs):
        for old, bi, ci, _size, _n in mine:
            key = (int(old), int(bi), int(ci))
            owner = owners.get(key)
            if owner is not None and owner != r and files[r].get(key[0]) != files[owner].get(key[0]):
                redo.setdefault(r, []).append(key)
    return "", redo


def first_said(problems: Sequence[str]) -> str:
    """The first rank's problem of ``problems`` (each rank's, '' for none), said with its rank; '' when none has one."""
    ranks = [(r, p) for r, p in enumerate(problems) if p]
    if not ranks:
        return ""
    r, p = ranks[0]
    more = f" (and {len(ranks) - 1} other rank(s))" if len(ranks) > 1 else ""
    return f"rank {r}{more}: {p}"


def check_own(files: dict[int, Any], keys: Sequence[Key]) -> None:
    """Hash the containers ``keys`` of this rank's old files ``files`` itself (:func:`verdict`'s second pass): each
    file still the one parsed, before and after (the bytes read from it earlier, under the same check, are then the
    ones hashed now, as a load into arrays in use relies on); :class:`FormatError` naming the file otherwise."""
    for old in sorted({k[0] for k in keys}):
        parsed = files[old]
        wanted = {(bi, ci) for o, bi, ci in keys if o == old}
        verify_containers(parsed, [(bi, ci, meta) for bi, ci, meta in parsed.containers() if (bi, ci) in wanted],
                          False, after=True)


def stage(t: Any, plan: dict[int, list[Any]], parsed_of: Callable[[], dict[int, Any]], arrays: dict[int, np.ndarray],
          states: set[int]) -> tuple[dict[int, Any], list[tuple[Any, list[Any]]]]:
    """Read and check this rank's pieces (collective): fresh arrays' into staged pages, states' and others' into
    private buffers, arrays in use only verified (their pieces returned, by old file, to be read after the agreement:
    :func:`~ftidask.engine.reshard._load_later`). ``parsed_of()``: the parsed old files of ``plan``. Returns each
    array's :class:`~ftidask.engine.pagemove.Staged` pages where it has them, else its buffer; the same
    :class:`RecoveryError` on every rank when any rank failed (its pages given back)."""
    pages: dict[int, pagemove.Staged] = {}
    staged: dict[int, np.ndarray] = {}
    later: list[tuple[Any, list[Any]]] = []
    files: dict[int, Any] = {}
    in_place: set[int] = set()
    problem, mine = "", []
    try:  # the buffers too: a rank that cannot allocate its own (MemoryError) must not raise alone
        files = parsed_of()
        pages = stage_pages({vid: a for vid, a in arrays.items() if vid not in states})
        by_var: dict[int, set[int]] = {}
        for old, wanted in plan.items():
            for vid, _piece in wanted:
                by_var.setdefault(vid, set()).add(old)
        in_place = {vid for vid in arrays if vid not in states and vid not in pages
                    and all(verified_first(files[old]) for old in by_var.get(vid, ()))}
        staged = {vid: array_over(pages[vid]) if vid in pages else np.empty(a.shape, a.dtype)
                  for vid, a in arrays.items() if vid not in in_place}
        mine = cut_needs(files, plan)
    except Exception as exc:  # noqa: BLE001 - shared at the agreement below
        problem = why(exc)
    try:
        needs = t.allgather(mine)  # a rank that failed above needs nothing: it verifies nothing for the others
        owners = verifiers(needs)
        trust = trusted(t.rank, owners, mine)
        if not problem:
            try:
                with Prefault([staged[vid] for vid in staged if vid not in pages],
                              [(s.view, s.addr) for s in pages.values()]):
                    for old, wanted in sorted(plan.items()):
                        others = trust.get(old, frozenset())
                        read_pieces(files[old], [w for w in wanted if w[0] not in in_place], staged, trusted=others)
                        if checked := [w for w in wanted if w[0] in in_place]:
                            verify_pieces(files[old], checked, trusted=others)
                            later.append((files[old], checked))
            except Exception as exc:  # noqa: BLE001 - shared, as above
                problem = why(exc)
        ids = [[old, *p.identity] for old, p in sorted(files.items()) if read_in_place(p)]
        failed, redo = verdict(t.allgather([problem, ids]), owners, needs)
        if not failed and redo:  # known alike on every rank: a second agreement, only then
            problem = ""
            try:
                check_own(files, redo.get(t.rank, []))
            except Exception as exc:  # noqa: BLE001 - shared, as above
                problem = why(exc)
            failed = first_said(t.allgather(problem))
        if failed:
            raise RecoveryError(failed)
    except BaseException:
        staged.clear()  # the views over the pages first: an unmapped page must never be reachable
        pagemove.release_all(pages)
        raise
    return {**staged, **pages}, later


def stage_pages(arrays: dict[int, np.ndarray]) -> dict[int, pagemove.Staged]:
    """Private pages mirroring those of ``arrays`` that :func:`pagemove.movable` accepts, by var id."""
    pages = {}
    for vid, array in pagemove.movable_arrays(arrays).items():
        try:
            pages[vid] = pagemove.Staged(array)
        except (OSError, ValueError, MemoryError):  # no pages to be had: a buffer, then the copy, as for the others
            continue
    return pages


def array_over(pages: pagemove.Staged) -> np.ndarray:
    """The staged pages as an array of their array's dtype and shape (C order: :func:`pagemove.movable`)."""
    return np.frombuffer(pages.view, pages.array.dtype).reshape(pages.array.shape)


def why(exc: Exception) -> str:
    """What a rank reports of ``exc`` to the others."""
    return str(exc) if isinstance(exc, (FTIError, OSError)) else f"{type(exc).__name__}: {exc}"
