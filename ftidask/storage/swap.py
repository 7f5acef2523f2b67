"""Replace a directory tree by another in one step: a kill at any moment leaves the old tree or the new one
(:func:`replace_tree`, used by an export that overwrites a store and by :func:`link_tree_atomic`).

``os.replace`` cannot put a directory where a non-empty one stands, and removing the old tree first
leaves, killed in between, nothing at the destination. Linux's ``renameat2(RENAME_EXCHANGE)`` swaps the
two names atomically (ext4, xfs, btrfs, tmpfs since 3.15; glibc 2.28 has the wrapper); the old tree,
now at the temporary name, is removed after. Where the exchange is refused, the old tree is first
renamed aside to a hidden name (killed then, it is still there, under that name), the new one renamed
in, and the old one removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from .files import fsync_dir, makedirs, remove_tree

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2() -> object | None:
    with contextlib.suppress(OSError, AttributeError, TypeError):
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    return None


_renameat2 = _libc_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False (nothing changed) where the system cannot."""
    if _renameat2 is None:
        return False
    done = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_tree(src: Path, dst: Path) -> None:
    """Put the complete, fsynced tree ``src`` at ``dst``, replacing what is there (a file or a tree)."""
    try:
        old_is_dir = stat.S_ISDIR(os.lstat(dst).st_mode)
    except FileNotFoundError:
        os.replace(src, dst)
        fsync_dir(dst.parent)
        return
    if old_is_dir and exchange(src, dst):
        fsync_dir(dst.parent)
        remove_tree(src)  # the old tree, under the temporary name
        return
    aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    remove_tree(aside)
    os.replace(dst, aside)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    remove_tree(aside)


def _host() -> str:
    """This host's name, as a file name part (a shared file system sees the temporaries of several hosts)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def temp_beside(dst: Path) -> Path:
    """The hidden name beside ``dst`` where this process builds a tree that then replaces it (:func:`replace_tree`):
    ``.NAME.tmp-HOST-PID``, so that :func:`sweep_temps_beside` tells whose it is."""
    return dst.with_name(f".{dst.name}.tmp-{_host()}-{os.getpid()}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return pid == os.getpid()  # this process's own leftover (an earlier attempt) is not in use either


def sweep_temps_beside(dst: Path) -> None:
    """Remove the trees a killed process left beside ``dst`` (:func:`temp_beside`: one being built, or the old tree
    that :func:`replace_tree` swapped out): only this host's, of processes that are gone. Call it once a new tree is
    in place at ``dst``: whatever they held is superseded (the old tree a fallback set aside has another name)."""
    prefix = f".{dst.name}.tmp-{_host()}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(dst.parent):
            pid = entry.name[len(prefix):]
            if entry.name.startswith(prefix) and pid.isdigit() and _gone(int(pid)):
                remove_tree(Path(entry.path))


def link_tree_atomic(src: Path, dst: Path) -> None:
    """Publish at ``dst`` a copy of the directory ``src`` whose files are hard links to ``src``'s (copied where a
    link cannot be made), built at a hidden temporary name and renamed: ``src`` stays whole, and ``dst`` is never
    seen half-built. A ``dst`` (or temporary) left by an earlier, killed attempt is replaced."""
    makedirs(dst.parent)
    for stale in dst.parent.glob(f".{dst.name}.tmp-*"):
        remove_tree(stale)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d, follow_symlinks=False)
        except OSError:  # another file system, or none of links: a copy
            shutil.copy2(s, d, follow_symlinks=False)

    try:
        # built inside a directory of this user's alone: copytree makes each directory with the umask's mode and
        # gives it the source's only once filled (0775 meanwhile with a umask of 002, names could be planted there)
        os.mkdir(tmp, 0o700)
        built = tmp / "tree"
        shutil.copytree(src, built, symlinks=True, copy_function=link)
        for dirpath, _dirs, _files in os.walk(built):
            fsync_dir(Path(dirpath))
        replace_tree(built, dst)
        with contextlib.suppress(OSError):  # published; a leftover wrapper is removed by the next attempt's glob
            os.rmdir(tmp)
    except BaseException:
        remove_tree(tmp)
        raise
