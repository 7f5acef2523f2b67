"""Read and verify one FTI-FF file: structure first (cheap, before any large allocation),
then every container's hash, then the data into the caller's arrays.

Both ftidask's files and FTI's are read: FTI 1.1's (file block first, MD5 everywhere, no variable
table) and those of later FTI versions, which keep all metadata at the end (:mod:`.tailmeta`). What
:func:`parse_ftiff` returns, :class:`FtiffFile`, and the file's identity on disk are :mod:`.parsedfile`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol

from ..model.arrays import VarInfo
from ..model.errors import FormatError
from . import compression, hashing, readahead, tailmeta, verify
from .blockhash import FLAG_DCP, DcpInfo, read_into_dcp, verify_dcp
from .ftiparity import sniff_parity
from .parsedfile import FtiffFile, check_unchanged, identity_of, unchanged  # noqa: F401 - re-exported
from .structs import BMD_SIZE, FB_SIZE, VMD_SIZE, VMD_STRUCT, BlockMeta, ContainerMeta, FileBlock
from .trailer import TAIL_SIZE, parse_trailer, trailer_span

_PIECE = 16 << 20
_COPY_PIECE = 32 << 20  # bytes per piece of the copy into the arrays, spread over _COPY_THREADS
# A copy from the page cache runs at a few GB/s a thread (a page lookup, then a copy, per page): on the 16-core machine
# a cold recovery of 1 GiB into arrays in use took 1.14x the read, about 8 GB/s for the copy on four threads.
_COPY_THREADS = min(8, os.cpu_count() or 1)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16)  # buffers per preadv
SUPPORTED_VERSIONS = (1,)


class ByteTarget(Protocol):
    """Where a reader puts a variable's bytes: a view to read into in place (None: not possible), or a store."""

    def view(self, start: int, stop: int) -> memoryview | None:
        """A writable view of bytes ``[start, stop)`` to read into in place, or None."""

    def store(self, start: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the variable at byte ``start``."""


def _pread(fh: BinaryIO, offset: int, length: int, path: str, what: str) -> bytes:
    data = os.pread(fh.fileno(), length, offset)
    if len(data) != length:
        raise FormatError(f"{what}: file ends at byte {offset + len(data)}, expected {offset + length}", path=path)
    return data


def parse_ftiff(fh: BinaryIO, path: str = "<file>") -> FtiffFile:
    """Parse and check everything but the data bytes: FB hash, offsets, metadata checksum, table."""
    stat = os.fstat(fh.fileno())
    file_size = stat.st_size
    if file_size < FB_SIZE:
        raise FormatError(f"too small for an FTI-FF file ({file_size} bytes)", path=path)
    try:
        fb = FileBlock.unpack(_pread(fh, 0, FB_SIZE, path, "file block"), path=path)
        if fb.compute_hash() != fb.hash:
            raise FormatError("file block hash does not match (damaged file block, or not an FTI-FF file)", path=path)
    except FormatError:
        parity = sniff_parity(fh.fileno(), file_size)
        if parity is not None:  # FTI's own level-3 parity (RSed): no checkpoint, but not damaged either
            raise FormatError(parity.describe(), path=path) from None
        # No file block at the start: a file of FTI 1.2 or later keeps its metadata at the end.
        tail, size = tailmeta.parse_tail(fh, path, file_size), file_size
        if tail is None:
            padded = tailmeta.parse_padded(fh, path, file_size)  # an L3 rank file FTI left padded
            if padded is None:
                raise
            size, tail = padded
        parsed = FtiffFile(path, size, tail[0], tail[1], None, {}, identity_of(stat), tail=True)
        _check_coverage(parsed)
        return parsed
    if not fb.legacy:
        if fb.version not in SUPPORTED_VERSIONS:
            raise FormatError(f"format version {fb.version} is newer than this ftidask reads", path=path)
        hashing.hash_name(fb.hash_id)
    if not FB_SIZE <= fb.fs <= file_size:
        raise FormatError(f"fs={fb.fs} is outside the file ({file_size} bytes)", path=path)
    blocks = []
    checksum = hashing.new_hasher(fb.hash_id)
    offset = FB_SIZE
    while offset < fb.fs:
        blocks.append(_parse_block(fh, offset, fb.fs, path, len(blocks), checksum))
        offset += blocks[-1][0].dbsize
    trailer: dict[str, Any] | None = None
    if not fb.legacy:
        # A dCP file keeps its block-hash section between fs and the table (see blockhash.py).
        start, length = trailer_span(_pread(fh, file_size - TAIL_SIZE, TAIL_SIZE, path, "table"), fb.fs,
                                     file_size, path=path, gap=bool(fb.flags & FLAG_DCP))
        tail = _pread(fh, start, length + TAIL_SIZE, path, "variable table")
        checksum.update(tail)
        if checksum.hexdigest()[:32] != fb.checksum:
            raise FormatError("metadata checksum does not match the file block (damaged metadata)", path=path)
        trailer = parse_trailer(tail[:length], path=path)
    parsed = FtiffFile(path, file_size, fb, tuple(blocks), trailer, _parse_vars(trailer, path), identity_of(stat))
    _check_coverage(parsed)
    if fb.flags & FLAG_DCP:
        # never compressed (patched in place): its readers copy stored bytes as they are, a codec left arrays unwritten
        if any(info.extra.get("codec") is not None for info in parsed.vars.values()):
            raise FormatError("a differential (dCP) file whose table gives a variable a codec", path=path)
        info = DcpInfo(parsed)
        if start != fb.fs + info.section_len:
            raise FormatError(f"block-hash section ends at {fb.fs + info.section_len}, the table starts at {start}",
                              path=path)
    return parsed


def _parse_block(fh: BinaryIO, offset: int, fs: int, path: str, index: int,
                 checksum: hashing.Hasher) -> tuple[BlockMeta, tuple[ContainerMeta, ...]]:
    where = f"block {index} at byte {offset}"
    if offset + BMD_SIZE > fs:
        raise FormatError(f"{where}: block metadata runs past fs={fs}", path=path)
    raw = _pread(fh, offset, BMD_SIZE, path, where)
    bmd = BlockMeta.unpack(raw)
    if bmd.numvars < 0 or offset + BMD_SIZE + VMD_SIZE * bmd.numvars > fs:
        raise FormatError(f"{where}: numvars={bmd.numvars} does not fit in the file", path=path)
    meta_size = BMD_SIZE + VMD_SIZE * bmd.numvars
    if bmd.dbsize < meta_size or offset + bmd.dbsize > fs:
        raise FormatError(f"{where}: dbsize={bmd.dbsize} is inconsistent (fs={fs})", path=path)
    vmd_raw = _pread(fh, offset + BMD_SIZE, VMD_SIZE * bmd.numvars, path, where)
    checksum.update(raw)
    checksum.update(vmd_raw)
    metas = []
    expected = offset + meta_size
    # one unpack of every VMD, each message made only for a container refused (per container: 10,000 a file)
    for i, (vid, idx, cid, has, dptr, fptr, chunk, csize, digest) in enumerate(VMD_STRUCT.iter_unpack(vmd_raw)):
        meta = ContainerMeta(vid, idx, cid, has != 0, dptr, fptr, chunk, csize, digest)
        if fptr != expected or csize < 0 or dptr < 0:
            raise FormatError(f"{_container_at(where, i, meta)}: fptr={fptr} containersize={csize} "
                              f"dptr={dptr} break the block's layout", path=path)
        if not 0 <= chunk <= csize or (chunk and not has):
            raise FormatError(f"{_container_at(where, i, meta)}: chunksize={chunk} invalid for containersize="
                              f"{csize}, hascontent={meta.hascontent}", path=path)
        expected += csize
        metas.append(meta)
    if expected != offset + bmd.dbsize:
        raise FormatError(f"{where}: containers add up to {expected - offset} bytes, dbsize={bmd.dbsize}", path=path)
    return bmd, tuple(metas)


def _container_at(where: str, i: int, meta: ContainerMeta) -> str:
    return f"{where}, container {i} (var id {meta.id}, containerid {meta.containerid})"


def _parse_vars(trailer: dict[str, Any] | None, path: str) -> dict[int, VarInfo]:
    if trailer is None:
        return {}
    out = {}
    for raw in trailer["vars"]:
        try:
            info = VarInfo.from_json(raw)
            if info.extra:  # (none: an array stored raw, nothing to check)
                compression.var_codec(info.extra)  # refuse an unknown codec before any data is read
                compression.plain_ids(info.extra)
        except FormatError as exc:
            raise FormatError(str(exc), path=path) from None
        if info.id in out:  # which of the two would the data be? neither: a writer lists each once
            raise FormatError(f"the variable table lists variable {info.id} twice", path=path)
        out[info.id] = info
    return out


def _check_coverage(parsed: FtiffFile) -> None:
    """Each variable's chunks must tile ``[0, nbytes)`` exactly once."""
    chunks: dict[int, list[tuple[int, int]]] = {}
    stored = 0
    for _bi, _ci, meta in parsed.containers():
        if meta.hascontent and meta.chunksize:
            chunks.setdefault(meta.id, []).append((meta.dptr, _raw_chunk(parsed, meta)))
            stored += meta.chunksize
    sizes = parsed.var_nbytes()
    for vid, spans in chunks.items():
        if parsed.vars and vid not in parsed.vars:
            raise FormatError(f"container holds data of variable {vid}, which the table does not list",
                              path=parsed.path)
        pos = 0
        for dptr, size in sorted(spans):
            if dptr != pos:
                raise FormatError(f"variable {vid}: chunks do not tile its bytes (gap or overlap at {pos})",
                                  path=parsed.path)
            pos += size
        if pos != sizes.get(vid, 0):
            raise FormatError(f"variable {vid}: chunks hold {pos} bytes, the table says {sizes.get(vid)}",
                              path=parsed.path)
    for vid, size in sizes.items():
        if size and vid not in chunks:
            raise FormatError(f"variable {vid}: {size} bytes listed but no container holds them", path=parsed.path)
    # FTI 1.1 writes ckptSize = fs (the whole file, metadata included), where its documentation
    # says the data size: a legacy file may hold either. ftidask's own files hold the data size.
    legacy_ok = parsed.legacy and parsed.fb.ckpt_size == parsed.fb.fs
    if stored != parsed.fb.ckpt_size and not legacy_ok:
        raise FormatError(f"ckptSize={parsed.fb.ckpt_size} does not match the containers ({stored} bytes"
                          + (f") or, for an FTI 1.1 file, fs={parsed.fb.fs}" if parsed.legacy else ")"),
                          path=parsed.path)


def _raw_chunk(parsed: FtiffFile, meta: ContainerMeta) -> int:
    """Raw bytes of the variable a container holds (its stored size unless compressed)."""
    info = parsed.vars.get(meta.id)
    if info is None or "codec" not in info.extra:
        return meta.chunksize
    span = compression.raw_span(info.nbytes, meta.dptr, meta.containersize)
    if meta.containerid in compression.plain_ids(info.extra) and meta.chunksize != span:
        raise FormatError(f"var id {meta.id}, containerid {meta.containerid}: stored uncompressed with "
                          f"{meta.chunksize} bytes, expected {span}", path=parsed.path)
    return span


def _read_compressed(fh: BinaryIO, parsed: FtiffFile, meta: ContainerMeta, target: ByteTarget, what: str) -> None:
    """Read one compressed container, check its hash, then decode it into ``target``.

    A target with a flat view is decoded straight into it, as a raw container is read straight into it: the file
    was verified (hashes and decoding) before, unchanged since (:func:`read_into`), and the stored bytes are hashed
    again, read through a ring of buffers, then decoded a frame at a time from the file (the pages just hashed), as
    the verification decodes them. A span decoded aside and copied held the raw container twice over (its frames,
    then their join) beside the array, and the stored bytes read whole once more: three times the largest array's
    size while the arrays in use were recovered."""
    info = parsed.vars[meta.id]
    span = compression.raw_span(info.nbytes, meta.dptr, meta.containersize)
    view = target.view(meta.dptr, meta.dptr + span)
    # a non-contiguous target: one buffer of the span, decoded into (never the frames and then their join)
    out = _flat_bytes(view) if view is not None else memoryview(bytearray(span))
    # buffers of this call (it may run on the application's thread, which would keep a thread's ring for ever), no
    # more than the container: a whole ring (12 MiB zeroed) per container made 1,000 small ones' recovery 3x slower
    ring = ([memoryview(bytearray(meta.chunksize))] if meta.chunksize <= readahead.PIECE
            else [memoryview(bytearray(readahead.PIECE)) for _ in range(readahead.SLOTS)])
    problem = verify.container_problem(fh.fileno(), parsed, meta, what, False, ring)
    try:
        if problem:
            raise FormatError(problem)
        compression.decode_container(info, meta, compression.StoredSpan(fh.fileno(), meta.fptr, meta.chunksize, what),
                                     what, out=out)
    except FormatError as exc:
        raise FormatError(f"{exc}; it changed while it was read", path=parsed.path) from None
    if view is None:
        target.store(meta.dptr, out)


def verify_data(fh: BinaryIO, parsed: FtiffFile, only: set[int] | None = None, *, decode: bool = True) -> None:
    """Check every container's hash (and, for FTI 1.1 files, the MD5 of the whole VB), and that each
    compressed container decodes to its raw span.

    The file is read, never mapped (:mod:`.verify`: a fault while reading is damage, not a SIGBUS), containers
    on parallel threads. ``decode`` False checks the hashes only: for a reader that decodes every container
    it uses afterwards, and whose failure there touches nothing (a Dask recovery's reads, see
    :func:`ftidask.backends.dask.tasks.check_file`).
    """
    if parsed.fb.flags & FLAG_DCP:
        return verify_dcp(fh, parsed, only)
    if os.fstat(fh.fileno()).st_size != parsed.identity[2]:  # the size parsed (file_size: its first bytes read)
        raise FormatError("file changed size since it was parsed", path=parsed.path)
    jobs = [(bi, ci, meta) for bi, ci, meta in parsed.containers()
            if meta.hascontent and (only is None or meta.id in only)]
    problem = verify.first_problem(fh.fileno(), parsed, jobs, decode) if jobs else ""
    if problem:
        raise FormatError(problem, path=parsed.path)
    if parsed.legacy and not parsed.tail:  # FTI 1.2+: the checksum is over the container hashes
        if verify.md5_hex(fh.fileno(), FB_SIZE, parsed.fb.fs) != parsed.fb.checksum:
            raise FormatError("MD5 checksum of the VB does not match the file block", path=parsed.path)


def read_into(fh: BinaryIO, parsed: FtiffFile, targets: Mapping[int, ByteTarget]) -> None:
    """Copy every chunk of the variables in ``targets`` into them.

    Call :func:`verify_data` first. The data is not hashed a second time: instead the file
    must be the one that was verified (same inode, size and modification time) before the
    first byte is copied, and still unmodified after the last.
    """
    check_unchanged(fh, parsed)
    if parsed.fb.flags & FLAG_DCP:
        _read_into_dcp(fh, parsed, targets)
    else:
        _read_into(fh, parsed, targets, parsed.fb.hash_id)
    check_unchanged(fh, parsed)


def _flat_bytes(view: memoryview) -> memoryview:
    """``view`` as flat bytes (an np.matrix's view, for one, is 2-D)."""
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _read_into_dcp(fh: BinaryIO, parsed: FtiffFile, targets: Mapping[int, ByteTarget]) -> None:
    """A dCP file: arrays with a zero-copy view are copied like any verified file (a second hash of
    every block would cost a third of a cold read, and protect nothing: the bytes are in the array
    before it could fail); the others go through a buffer whose blocks are checked before the store."""
    direct: list[_Piece] = []
    others = {}
    for bi, ci, meta in parsed.containers_of(targets):
        target = targets.get(meta.id)
        if target is None or not meta.hascontent:
            continue
        view = target.view(meta.dptr, meta.dptr + meta.chunksize)
        if view is None:
            others[meta.id] = target
        else:
            direct.append((meta.fptr, _flat_bytes(view), (bi, ci, meta.id)))
    if others:
        read_into_dcp(fh, parsed, others)
    copy_direct(fh, parsed, direct)


def _where(bi: int, ci: int, vid: int) -> str:
    return f"block {bi}, container {ci} (var id {vid})"


def _read_into(fh: BinaryIO, parsed: FtiffFile, targets: Mapping[int, ByteTarget], hid: int) -> None:
    buf: bytearray | None = None
    direct: list[_Piece] = []  # copied below, in parallel
    packed: list[tuple[ContainerMeta, ByteTarget, str]] = []  # compressed containers: decoded below
    infos = parsed.vars
    for bi, ci, meta in parsed.containers_of(targets):
        target = targets.get(meta.id)
        if target is None or not meta.hascontent:
            continue
        if compression.encoded(infos.get(meta.id), meta):
            packed.append((meta, target, _where(bi, ci, meta.id)))
            continue
        view = target.view(meta.dptr, meta.dptr + meta.chunksize)
        if view is not None:  # which container it is: said only if it is refused (a str each cost 10%)
            direct.append((meta.fptr, _flat_bytes(view), (bi, ci, meta.id)))
            continue
        what = _where(bi, ci, meta.id)
        hasher = hashing.new_hasher(hid)
        buf = buf or bytearray(_PIECE)
        got = 0
        while got < meta.chunksize:
            n = os.preadv(fh.fileno(), [memoryview(buf)[:min(len(buf), meta.chunksize - got)]], meta.fptr + got)
            if n <= 0:
                break
            hasher.update(memoryview(buf)[:n])
            target.store(meta.dptr + got, memoryview(buf)[:n])
            got += n
        if got != meta.chunksize or hasher.digest() != meta.hash:
            raise FormatError(f"{what} changed while it was read", path=parsed.path)
    copy_direct(fh, parsed, direct)
    # Decoding is the cost here: containers of targets with a flat view (disjoint byte ranges of memory)
    # are decoded on a few threads (numcodecs releases the GIL); the others store element by element, in turn.
    flat = [job for job in packed if job[1].view(0, 0) is not None]
    for meta, target, what in (job for job in packed if job[1].view(0, 0) is None):
        _read_compressed(fh, parsed, meta, target, what)
    if flat:
        with ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="ftidask-decode") as pool:
            list(pool.map(lambda job: _read_compressed(fh, parsed, *job), flat))


#: a piece to copy from the file: (file offset, target view, (block, container, var id): said by _where if refused)
_Piece = tuple[int, memoryview, tuple[int, int, int]]


def _contiguous(run: list[_Piece]) -> Iterator[list[_Piece]]:
    """``run``'s pieces in groups that follow each other in the file (at most :data:`_IOV_MAX` a group)."""
    group: list[_Piece] = []
    for piece in run:
        if group and (len(group) >= _IOV_MAX or piece[0] != group[-1][0] + len(group[-1][1])):
            yield group
            group = []
        group.append(piece)
    if group:
        yield group


def _read_group(fd: int, group: list[_Piece]) -> tuple[int, int, int] | None:
    """Read ``group`` (pieces that follow each other in the file) with one ``preadv``; None or the piece cut short."""
    if len(group) > 1:
        total = sum(len(view) for _o, view, _w in group)
        if os.preadv(fd, [view for _o, view, _w in group], group[0][0]) == total:
            return None
    # one piece, or a short read (the file cut, or a call interrupted): each piece read in full, in turn
    return next((what for offset, view, what in group if readahead.read_full(fd, offset, view) != len(view)), None)


def copy_direct(fh: BinaryIO, parsed: FtiffFile, spans: list[_Piece]) -> None:
    """Read each span ``(file offset, view, (block, container, var id))`` straight into its view, spread over threads.

    The file was verified just before and its pages are in the page cache: this is a memory copy, which
    one core does at a fraction of the memory bandwidth, so pieces go to several (preadv releases the GIL).
    Small pieces go a run of them per task, and pieces that follow each other in the file in one ``preadv``:
    a task and a call per container cost 50 us each, more than copying a small one (10,000 variables of 1 KiB).
    """
    piece = _COPY_PIECE
    pieces = spans if all(len(view) <= piece for _o, view, _w in spans) else [  # small ones as they are
        (offset + lo, view[lo:lo + piece], what) for offset, view, what in spans for lo in range(0, len(view), piece)]
    runs = readahead.runs(pieces, lambda piece: len(piece[1]), _COPY_PIECE)

    def copy(run: list[_Piece]) -> tuple[int, int, int] | None:
        for group in _contiguous(run):
            if short := _read_group(fh.fileno(), group):
                return short
        return None

    if len(runs) < 2 or _COPY_THREADS < 2:
        problems = [copy(r) for r in runs]
    else:
        with ThreadPoolExecutor(max_workers=min(_COPY_THREADS, len(runs)), thread_name_prefix="ftidask-fill") as pool:
            problems = list(pool.map(copy, runs))
    bad = next((p for p in problems if p), None)
    if bad:
        raise FormatError(f"{_where(*bad)} changed while it was read (the file ends inside it)", path=parsed.path)
