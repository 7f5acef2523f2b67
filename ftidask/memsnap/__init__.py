"""Memory snapshots: the values arrays had at one moment, read out later while the application
goes on writing them (copy-on-write through Linux's userfaultfd, :mod:`ftidask.memsnap.cow`).

A mechanism only: it knows nothing of checkpoints. An asynchronous checkpoint takes a
:class:`CowSnapshot` of its arrays, returns to the application, and writes each array's
:meth:`CowSnapshot.source` in the background.
"""

from .cow import CowSnapshot, CowSource, CowUnavailable, cow_available

__all__ = ["CowSnapshot", "CowSource", "CowUnavailable", "cow_available"]
