"""Which memory pages were written since they were last looked at: Linux's userfaultfd
write-protection in asynchronous mode, read back with the ``PAGEMAP_SCAN`` ioctl (Linux 6.9+;
the ioctl came in 6.7, see :func:`_check_kernel`).

Why: a differential checkpoint must find the blocks that changed. Hashing every block reads the
whole state once (about 0.08 s per GiB here, the memory bandwidth), which is most of the cost of a
checkpoint that changed 1% of it. The kernel can tell instead: once a range is write-protected
with ``UFFD_FEATURE_WP_ASYNC``, the first write to each page (by any thread, or by the kernel
itself, as ``read(2)`` into the buffer) clears that page's protection bit without ever stopping the
program in user space, and ``PAGEMAP_SCAN`` lists the pages whose bit is clear and sets it again,
atomically. Only those pages' blocks are hashed.

This module is the mechanism only (ioctls through :mod:`fcntl` and :mod:`ctypes`, no compiled
code); :mod:`ftidask.dcp.track` decides when its answers can be trusted. Every failure means
"unknown", and unknown means "hash everything".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import struct

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282, "s390x": 355, "riscv64": 282}
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_PAGE_IS_WRITTEN = 1 << 1
_SCAN_WP_MATCHING = 1 << 0
_SCAN_CHECK_WPASYNC = 1 << 1
_REGIONS = 4096  # page_region entries per PAGEMAP_SCAN call


def _ioc(direction: int, kind: int, number: int, size: int) -> int:
    # The generic Linux encoding (x86, arm64, riscv, s390); powerpc's differs, and is not listed above.
    return (direction << 30) | (size << 16) | (kind << 8) | number


_IOWR, _IOR = 3, 2
_UFFDIO_API = _ioc(_IOWR, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(_IOWR, 0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(_IOR, 0xAA, 0x01, 16)
_UFFDIO_WRITEPROTECT = _ioc(_IOWR, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(_IOWR, ord("f"), 16, 96)


class TrackingUnavailable(OSError):
    """The kernel, the permissions or the memory do not allow write tracking here."""


def _open_userfaultfd() -> int:
    number = _SYS_USERFAULTFD.get(platform.machine())
    if number is None:
        raise TrackingUnavailable(errno.ENOSYS, f"no write tracking on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY, os.O_CLOEXEC | os.O_NONBLOCK):
        fd = libc.syscall(number, flags)
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: a kernel older than 5.11 without UFFD_USER_MODE_ONLY
            break
    raise TrackingUnavailable(err, f"userfaultfd: {os.strerror(err)}")


class WriteTracker:
    """One userfaultfd context of this process, with which page ranges are registered.

    Ranges are page-aligned and must lie in private anonymous memory (the caller checks, see
    :func:`anonymous_private`): a page shared with another process can be written through that
    process's page tables, which no protection here would see.
    """

    def __init__(self) -> None:
        _check_kernel()
        self._pid = os.getpid()  # the ioctls act on the memory of the process that made the context
        self._uffd = -1
        try:
            for features in (_FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, _FEATURE_WP_ASYNC):
                self._uffd = _open_userfaultfd()
                try:
                    fcntl.ioctl(self._uffd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, features, 0)))
                    break
                except OSError as exc:
                    # UFFDIO_API may be called only once per context: the next try needs a new one.
                    os.close(self._uffd)
                    self._uffd = -1
                    if exc.errno != errno.EINVAL or features == _FEATURE_WP_ASYNC:
                        raise TrackingUnavailable(exc.errno, f"userfaultfd without WP_ASYNC: {exc}") from None
            try:
                self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise TrackingUnavailable(exc.errno, f"/proc/self/pagemap: {exc}") from None
        except BaseException:
            if self._uffd >= 0:
                os.close(self._uffd)
                self._uffd = -1
            raise
        self._regions = np.zeros((_REGIONS, 3), np.uint64)

    def _own(self) -> None:
        if self._uffd < 0:
            raise TrackingUnavailable(errno.EBADF, "write tracker closed")
        if os.getpid() != self._pid:  # a forked child: its ioctls would act on its parent's pages
            raise TrackingUnavailable(errno.ECHILD, "write tracking was set up by the parent process")

    def register(self, start: int, stop: int) -> None:
        """Write-protect ``[start, stop)`` (page-aligned) and start tracking writes to it."""
        self._own()
        try:
            fcntl.ioctl(self._uffd, _UFFDIO_REGISTER,
                        bytearray(struct.pack("QQQQ", start, stop - start, _REGISTER_MODE_WP, 0)))
        except OSError as exc:
            raise TrackingUnavailable(exc.errno, f"cannot track writes to {start:#x}: {exc}") from None
        try:
            self.protect(start, stop)
        except OSError:
            self.unregister(start, stop)
            raise

    def protect(self, start: int, stop: int, on: bool = True) -> None:
        """Write-protect every page of ``[start, stop)`` again (forgetting which were written), or
        with ``on=False`` lift the protection (writes no longer fault, and all count as written)."""
        self._own()
        try:
            fcntl.ioctl(self._uffd, _UFFDIO_WRITEPROTECT,
                        bytearray(struct.pack("QQQ", start, stop - start, _WRITEPROTECT_MODE_WP if on else 0)))
        except OSError as exc:
            raise TrackingUnavailable(exc.errno, f"cannot write-protect {start:#x}: {exc}") from None

    def written(self, start: int, stop: int, *, protect: bool) -> np.ndarray:
        """``(n, 2)`` uint64 page ranges of ``[start, stop)`` written since the last protection;
        with ``protect`` they are write-protected again in the same, atomic, step."""
        self._own()
        flags = _SCAN_CHECK_WPASYNC | (_SCAN_WP_MATCHING if protect else 0)
        found = []
        cursor = start
        while cursor < stop:
            arg = bytearray(struct.pack("12Q", 96, flags, cursor, stop, 0, self._regions.ctypes.data, _REGIONS, 0,
                                        0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN))
            try:
                count = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            except OSError as exc:
                raise TrackingUnavailable(exc.errno, f"PAGEMAP_SCAN failed: {exc}") from None
            found.append(self._regions[:count, :2].copy())
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end <= cursor:
                raise TrackingUnavailable(errno.EIO, "PAGEMAP_SCAN made no progress")
            cursor = walk_end
        return np.concatenate(found) if found else np.zeros((0, 2), np.uint64)

    def unregister(self, start: int, stop: int) -> None:
        """Stop tracking ``[start, stop)`` (its pages lose their protection)."""
        if self._uffd < 0 or os.getpid() != self._pid:
            return  # in a forked child, the ranges are the parent's: leave them alone
        with contextlib.suppress(OSError):  # unmapped meanwhile: nothing is registered any more
            fcntl.ioctl(self._uffd, _UFFDIO_UNREGISTER, bytearray(struct.pack("QQ", start, stop - start)))

    def close(self) -> None:
        """Unregister everything: closing the context drops its registrations and protections
        (in a forked child, closing its copy of the descriptors leaves the parent's intact)."""
        if self._uffd >= 0:
            os.close(self._pagemap)
            os.close(self._uffd)
            self._uffd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _check_kernel() -> None:
    """Linux 6.9 or later: before it, PAGEMAP_SCAN could read a swapped-out or migrating page's
    entry as write-protected and report a written page as not written (fixed in 6.9 and 6.8.y
    stable by "fs/proc/task_mmu: fix uffd-wp confusion in pagemap_scan_pmd_entry()"; 6.7 has
    the ioctl without the fix). Vendor kernels that number themselves older are not trusted."""
    release = platform.release()
    parts = release.split(".")
    try:
        version = (int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0))
    except (IndexError, ValueError):
        raise TrackingUnavailable(errno.ENOSYS, f"unknown kernel release {release!r}") from None
    if platform.system() != "Linux" or version < (6, 9):
        raise TrackingUnavailable(errno.ENOSYS, f"write tracking needs Linux 6.9 or later, not {release}")


def available() -> bool:
    """Can this process track writes (kernel, features and permissions)?"""
    try:
        WriteTracker().close()
    except TrackingUnavailable:
        return False
    return True


def anonymous_private(start: int, stop: int) -> bool:
    """True when ``[start, stop)`` lies entirely in private anonymous mappings of this process."""
    covered = start
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo_text, _sep, hi_text = fields[0].partition("-")
                lo, hi = int(lo_text, 16), int(hi_text, 16)
                if hi <= covered or lo >= stop:
                    continue
                path = fields[5].strip() if len(fields) > 5 else ""
                private_rw = fields[1].startswith("rw") and fields[1][3] == "p"
                anonymous = fields[4] == "0" and (not path or path == "[heap]" or path.startswith("[anon:"))
                if lo > covered or not (private_rw and anonymous):
                    return False
                covered = hi
                if covered >= stop:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def pinned_bytes() -> int:
    """Bytes of this process's memory pinned for devices (``VmPin``: RDMA registrations,
    io_uring buffers). A device writing through a long-lived pin bypasses the page tables, so
    while anything is pinned, write tracking is not trusted. -1 when unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmPin:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return -1
