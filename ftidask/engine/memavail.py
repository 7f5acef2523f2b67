"""How much memory this process can still take without pushing the machine (or its container) into swap or the
OOM killer: the sizing of buffers that trade memory for speed (the asynchronous copy snapshots' pool).

Linux's ``MemAvailable`` is the machine's view; a job in a container or a batch system's cgroup has a tighter
limit, which ``MemAvailable`` does not show: the cgroup's limit less what it holds, its page cache counted as
free (the kernel reclaims it before it kills), is taken when it is lower.
"""

from __future__ import annotations

import os

_CGROUP = "/sys/fs/cgroup"
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat(path: str, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` found in a cgroup's ``memory.stat`` (0 if none)."""
    try:
        with open(path, encoding="ascii") as fh:
            found = dict(line.split()[:2] for line in fh if line.strip())
    except (OSError, ValueError):
        return 0
    return next((int(found[k]) for k in keys if k in found), 0)


def _meminfo_available(meminfo: str) -> int | None:
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _up(base: str, rel: str) -> list[str]:
    """``base/rel`` and each of its ancestors up to ``base``, innermost first."""
    rel, out = rel.strip("/"), []
    while rel:
        out.append(os.path.join(base, rel))
        rel = os.path.dirname(rel)
    return [*out, base]


def _cgroup_dirs(cgroup: str, root: str) -> list[str]:
    """This process's cgroup directories and their ancestors (innermost first): v2's, else v1's memory controller's
    (a process in a cgroup namespace sees its own cgroup as "/", mounted at the root)."""
    try:
        with open(cgroup, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    v2, v1 = [], []
    for line in lines:
        number, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        if number == "0" and not controllers:
            v2 = [d for d in _up(root, path) if os.path.exists(os.path.join(d, "memory.max"))]
        elif "memory" in controllers.split(","):
            v1 = [d for d in _up(os.path.join(root, "memory"), path) if os.path.isdir(d)]
    return v2 or v1 or [os.path.join(root, "memory")]


def _cgroup_headroom(cgroup: str, root: str) -> int | None:
    """The least room left under any memory limit of this process's cgroups (None: no limit found)."""
    rooms = []
    for d in _cgroup_dirs(cgroup, root):
        v2 = os.path.exists(os.path.join(d, "memory.max"))
        limit = _read_int(os.path.join(d, "memory.max" if v2 else "memory.limit_in_bytes"))
        used = _read_int(os.path.join(d, "memory.current" if v2 else "memory.usage_in_bytes"))
        if limit is None or used is None or limit >= _UNLIMITED:
            continue
        cache = _stat(os.path.join(d, "memory.stat"), ("file",) if v2 else ("total_cache", "cache"))
        rooms.append(max(0, limit - used + cache))
    return min(rooms) if rooms else None


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
                    root: str = _CGROUP) -> int | None:
    """Memory this process can take now: ``MemAvailable``, or its cgroup's room when lower (None: unknown).

    The paths are Linux's (a test gives its own)."""
    known = [x for x in (_meminfo_available(meminfo), _cgroup_headroom(cgroup, root)) if x is not None]
    return min(known) if known else None
