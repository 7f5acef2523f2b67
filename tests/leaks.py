"""What a test's own ftidask code holds open (descriptors, threads), told apart from what the rest of the session does.

The tests run in one process, in file order (CI: ``pytest -q``, then ``pytest -q -m slow``): what earlier tests left
(a Dask cluster and its event loop, a client closing, another run's background remover, psutil's /proc reads) opens
and closes descriptors and starts threads at any moment. A count of ``/proc/self/fd`` or ``threading.active_count``
taken before and after a test's work therefore changes by itself now and then (CI saw 55 descriptors for 54). A leak
check compares what only the test's own work can have made:

* descriptors by target: files under the test's own directory, the kernel objects ftidask makes (userfaultfd,
  eventfd, memfd, a ``pagemap``); not sockets, pipes, epoll instances or other files, which a cluster's threads open;
* threads that run ftidask code: named ``ftidask-*`` (every pool and thread of the package is), or started on a
  function of the package; and the threads that are not Python threads (the native extension's), which a cluster's
  Python threads do not change.

Work that ends in the background by design (a remover thread deleting a retired checkpoint, a pool shut down without
waiting) is waited for with :func:`settled`: a real leak stays, so a check that still fails after its deadline is one.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: Kernel objects ftidask opens (csrc/cow_uffd.c: userfaultfd, cow.c: eventfd; dcp/pagetrack.py: userfaultfd, pagemap).
_KERNEL = ("anon_inode:[userfaultfd]", "anon_inode:[eventfd]", "/memfd:")


def descriptors(*roots: Path | str) -> Counter[str]:
    """This process's descriptors, by target, that are files under one of ``roots`` or kernel objects of ftidask's
    kind (a multiset: the same file open twice counts twice)."""
    prefixes = tuple(str(Path(r)) for r in roots)
    out: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor of the listing itself, or one closed meanwhile
            continue
        if (any(target == p or target.startswith(p + os.sep) for p in prefixes) or target.startswith(_KERNEL)
                or target.endswith("/pagemap")):
            out[target] += 1
    return out


def all_descriptors() -> int:
    """How many descriptors this process has open, whatever they are (a bound for a check with slack)."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own


def _runs_ftidask(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)  # Thread(target=...): cleared once the thread has run
    return thread.name.startswith("ftidask") or getattr(target, "__module__", "").startswith("ftidask")


def ftidask_threads() -> Counter[str]:
    """The live threads that run ftidask code, by name (a multiset)."""
    return Counter(t.name for t in threading.enumerate() if t.is_alive() and _runs_ftidask(t))


def native_threads() -> int:
    """How many of this process's threads are no Python thread (/proc/self/task less ``threading``'s): the native
    extension's (a copy-on-write snapshot's fault handler) and C libraries' pools, not a Dask client's Python threads.
    (A Python thread that is ending shows here for a moment: compare with :func:`settled`.)"""
    python = {t.native_id for t in threading.enumerate()}
    return len(set(map(int, os.listdir("/proc/self/task"))) - python)


def grown(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """What ``after`` holds more of than ``before``."""
    return after - before


def settled(measure: Callable[[], T], ok: Callable[[T], bool], timeout: float = 30.0, interval: float = 0.02) -> T:
    """``measure()`` once ``ok`` holds for it, or its last value after ``timeout`` seconds (for the caller's assert):
    background work that ends by design is given time to end (a loaded 2-core machine is slow), a leak never does."""
    deadline = time.monotonic() + timeout
    while True:
        value = measure()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(interval)
