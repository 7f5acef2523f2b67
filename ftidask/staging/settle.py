"""What became of a transfer whose mover died before it reported: published, or not at all.

A mover process (or a Dask worker) killed after it published a copy, but before its answer reached the owner, leaves
the copy at its destination and perhaps the local file removed. Reported ``SI_FAIL`` ("the destination holds nothing
of it; the local file is kept"), that would be false twice over, and a resend would fail as the source is gone. So
the owner reads what the steps of :func:`ftidask.staging.copy.transfer` leave behind, once the mover is dead (no step
can run any more). Those steps are: the temporary file written and verified, hard-linked to the destination (never
replacing a file), its temporary name unlinked, the directory fsynced, and only then the source removed. Hence:

* the temporary file is there: published only if the destination is the same inode (killed between the link and the
  unlink); else the copy never published, and its temporary file is removed;
* no temporary file and no destination: nothing was published;
* a destination of another size: not this copy (a file that appeared meanwhile: the copy refused to replace it);
* a destination of the request's size and no source: published (a transfer removes the source only after that);
* a destination of the request's size and the source still there: published if the two hold the same bytes (their
  hashes compared; the mover verified the copy before publishing it), not if they differ.

A copy found published is finished by the owner: the directory fsynced and the source removed, as the mover would
have. Then it is ``SI_SCES`` truthfully; everything else is ``SI_FAIL`` with its temporary file removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

from ..ftiff import hashing
from ..model.constants import SI_FAIL, SI_SCES
from .copy import PIECE, StageRequest, _hash_file, _open_dir, _Swapped, open_regular

log = logging.getLogger("ftidask")


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _digest(name: str, dir_fd: int, hid: int, buf: bytearray) -> tuple[int, bytes] | None:
    """Size and hash of the regular file ``name`` in ``dir_fd`` (never a link's target); None if it is no such file."""
    try:
        fd = open_regular(name, dir_fd)
    except OSError:
        return None
    try:
        return _hash_file(fd, hid, buf) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def _open_or_none(path: str) -> int:
    """The directory ``path`` opened without following links, or -1 if it is not there (or not to be trusted)."""
    try:
        return _open_dir(path)
    except (OSError, _Swapped):
        return -1


def settle(req: StageRequest) -> int:
    """Whether ``req``, whose mover is dead, was published: ``SI_SCES`` (the destination holds the verified copy and
    the local file is removed here if the mover had not) or ``SI_FAIL`` (its temporary file removed). Never raises."""
    try:
        return _settle(req)
    except Exception as exc:  # noqa: BLE001 - a dead mover's requests must be reported whatever happens here
        log.warning("could not tell whether staging request %d (%s) was published; reported failed: %r",
                    req.id, req.dst, exc)
        with contextlib.suppress(OSError):
            os.unlink(req.tmp)
        return SI_FAIL


def _settle(req: StageRequest) -> int:
    dst_dir, dst_name = os.path.split(req.dst)
    tmp_name = os.path.basename(req.tmp)
    dfd = _open_or_none(dst_dir)
    if dfd < 0:  # its directory is not there: nothing was published (nor a temporary file created)
        return SI_FAIL
    sfd = -1
    try:
        tmp, dst = _lstat(tmp_name, dfd), _lstat(dst_name, dfd)
        if tmp is not None:
            linked = dst is not None and (tmp.st_dev, tmp.st_ino) == (dst.st_dev, dst.st_ino)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dfd)  # the first the owner undoes: never a partial file kept
            if not linked:
                return SI_FAIL
        elif dst is None or not stat.S_ISREG(dst.st_mode) or dst.st_size != req.size:
            return SI_FAIL
        os.fsync(dfd)  # the mover may have died before it made the publication durable
        src_dir, src_name = os.path.split(req.src)
        sfd = _open_or_none(src_dir)
        src = None if sfd < 0 else _lstat(src_name, sfd)
        if src is None:  # the source is removed only after the publication: published (or on a disk not seen here)
            return _published(req, "")
        if tmp is None:  # only the bytes tell this copy from a file that appeared at the destination meanwhile
            hid, buf = hashing.hash_id(req.hash), bytearray(PIECE)
            mine = _digest(src_name, sfd, hid, buf)
            if mine is None or mine != _digest(dst_name, dfd, hid, buf):
                return SI_FAIL
        again = _lstat(src_name, sfd)
        if again is not None and (again.st_dev, again.st_ino) == (src.st_dev, src.st_ino):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(src_name, dir_fd=sfd)
        return _published(req, "; its local file removed by the owner")
    finally:
        for fd in (sfd, dfd):
            if fd >= 0:
                os.close(fd)


def _published(req: StageRequest, what: str) -> int:
    log.info("staging request %d (%s -> %s) was published before its mover died%s", req.id, req.src, req.dst, what)
    return SI_SCES
