"""FTI's differential checkpoints of POSIX I/O (``ckpt_io = 1``, ``enable_dcp = 1``), read with FTI's meta file.

FTI (src/IO/posix-dcp.c: ``FTI_InitDCPPosix``, ``FTI_WritePosixDCPData``, ``FTI_PosixDCPClose``; earlier
src/diff-checkpoint-posix.c ``FTI_WritePosixDcp``) appends one layer per dCP checkpoint to
``dcp-id{counter // dcp_stack_size}-rank{rank}.fti``, in the L4 dCP directory ``{glbl_dir}/{exec_id}/dCP`` when L4
is inline, else in L1's ``{ckpt_dir}/{exec_id}/dCP``; layer ``counter % dcp_stack_size`` 0 starts a new file.
Native byte order (little endian), no padding between fields::

    file header  block_size  u32 (u64 before FTI's uint32_t rewrite)   stack_size  u32
    every layer  ckpt_id     i32    nb_var      i32
    layer 0      per variable, in protection order: id i32, size u32 (u64 before), then its bytes padded with
                 zeros to whole blocks
    layer k > 0  per block that changed (its MD5 differs from the previous checkpoint's, or lies past the
                 variable's previous size): 6 bytes = the low 48 bits of ``varId : 18, blockId : 30`` (a
                 little-endian bit field), then the whole block (the last one of a variable zero padded)

The meta file (:mod:`ftidask.ftiff.posix`; ``[ckpt_info] ckpt_type = dcp``) section of the rank records, for
each layer ``k`` of the file up to the checkpoint it describes, ``dcp_layer{k}_size`` (bytes of the layer, the
file header counted in layer 0) and ``dcp_layer{k}_hash``: the MD5 (hex) of the concatenated MD5s of the
layer's blocks as stored, padding included (``FTI_VerifyChecksumDcpPosix``); ``var{j}_id`` / ``var{j}_size``
are the variables as of that checkpoint. ``ckpt_file_size`` is the sum of the layer sizes; ``ckpt_checksum`` is
not a hash of this file (FTI only requires it to be non-empty, as here). Block and variable headers are not
hashed: they are checked against each other and the recorded sizes instead.

A variable is its layer-0 bytes (padding included), then each later layer's blocks put at ``blockId *
block_size`` in order, cut to its size as of the meta file's checkpoint (blocks past it: written when the
variable was larger, ignored). Every layer is checked before anything is returned; bytes after the recorded
layers (a layer whose meta file was not written) are not read. Only ``dcp_mode`` MD5 is verifiable: FTI's
CRC32 mode records a layer hash FTI's own check cannot match, and is refused.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct

from ..model.errors import FormatError
from ..storage.files import open_read
from .posix import PosixFile, find_section, read_whole

DCP_NAME = re.compile(r"dcp-id(\d{1,9})-rank(\d{1,9})\.fti")
MAX_STACK_SIZE = 10  # FTI's MAX_STACK_SIZE: LayerSize[] and the meta file's layers stop there
MAX_BLOCK_SIZE = 1 << 30
_HEX32 = re.compile(r"[0-9a-f]{32}")
_BLOCK_META = 6
_VAR_BITS, _BLOCK_BITS = 18, 30


def is_dcp_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is named as FTI names its POSIX dCP files, ``dcp-id{f}-rank{r}.fti``."""
    return DCP_NAME.fullmatch(os.path.basename(os.fspath(path))) is not None


def _count(values: dict[str, str], key: str, where: str, signed: bool = False) -> int:
    text = values.get(key)
    if text is None or not re.fullmatch(r"-?\d{1,19}" if signed else r"\d{1,19}", text):
        raise FormatError(f"{key} = {text!r} is not {'an integer' if signed else 'a byte count'}", path=where)
    return int(text)


def _meta_layers(values: dict[str, str], where: str) -> list[tuple[int, str]]:
    """``(size, md5 hex)`` of the layers the section records, ``dcp_layer0`` on, consecutive."""
    layers = []
    while f"dcp_layer{len(layers)}_size" in values:
        k = len(layers)
        if k == MAX_STACK_SIZE:
            raise FormatError(f"more than {MAX_STACK_SIZE} dCP layers (FTI's MAX_STACK_SIZE)", path=where)
        digest = values.get(f"dcp_layer{k}_hash", "").lower()
        if not _HEX32.fullmatch(digest):
            raise FormatError(f"dcp_layer{k}_hash = {digest!r} is not an MD5 to check the layer against (FTI's "
                              "dcp_mode CRC32 layer hashes cannot be checked, by FTI either)", path=where)
        layers.append((_count(values, f"dcp_layer{k}_size", where), digest))
    stray = sorted(k for k in values if re.fullmatch(r"dcp_layer\d+_(size|hash)", k)
                   and int(re.findall(r"\d+", k)[0]) >= len(layers))
    if not layers or stray:
        raise FormatError("the section records no dCP layer (dcp_layer0_size, dcp_layer0_hash)" if not layers else
                          f"dCP layers not numbered from 0 without gaps: {stray}", path=where)
    return layers


def _variables(values: dict[str, str], where: str) -> dict[int, int]:
    """Each variable's size as of the meta file's checkpoint, by id (``var{j}_id``, ``var{j}_size``)."""
    sizes: dict[int, int] = {}
    j = 0
    while f"var{j}_id" in values:
        vid = _count(values, f"var{j}_id", where, signed=True)
        if not 0 <= vid < 1 << _VAR_BITS or vid in sizes:
            raise FormatError(f"var{j}_id = {vid}: not a dCP variable id (0 to {(1 << _VAR_BITS) - 1}, each "
                              "once)", path=where)
        sizes[vid] = _count(values, f"var{j}_size", where)
        j += 1
    if not sizes:
        raise FormatError("the section lists no variable (var0_id, var0_size)", path=where)
    return sizes


class _Cursor:
    """Reads fixed-size fields of ``raw[start:end]``, every read bounds-checked (FormatError past ``end``)."""

    def __init__(self, raw: memoryview, start: int, end: int, where: str) -> None:
        self.raw, self.pos, self.end, self.where = raw, start, end, where

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise FormatError(f"{what} at byte {self.pos} ({n} bytes) runs past the end of its layer (byte "
                              f"{self.end})", path=self.where)
        self.pos += n
        return self.raw[self.pos - n:self.pos]

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def _file_header(raw: memoryview, where: str) -> tuple[int, int, str]:
    """``(block_size, stack_size, size format)``: FTI's uint32_t header, else the earlier unsigned long one."""
    if len(raw) < 12:
        raise FormatError(f"{len(raw)} bytes: shorter than a dCP file header", path=where)
    for fmt, size_fmt in (("<II", "<I"), ("<QI", "<Q")):
        block, stack = struct.unpack_from(fmt, raw)
        if 0 < block <= MAX_BLOCK_SIZE and 0 < stack <= MAX_STACK_SIZE:
            return block, stack, size_fmt
    raise FormatError("no dCP file header: the block size (1 to 2**30) and stack size (1 to "
                      f"{MAX_STACK_SIZE}) are not at its start, in either of FTI's layouts", path=where)


def _blocks_md5(blocks: list[memoryview]) -> str:
    outer = hashlib.md5(usedforsecurity=False)
    for block in blocks:
        outer.update(hashlib.md5(block, usedforsecurity=False).digest())
    return outer.hexdigest()


def _parse_layers(raw: memoryview, layers: list[tuple[int, str]], where: str) -> tuple[
        int, list[tuple[int, int]], dict[int, memoryview], list[list[tuple[int, int, memoryview]]]]:
    """Every layer parsed and its hash checked: ``(block_size, [(ckpt_id, nb_var)], layer-0 bytes by id,
    [[(var id, block id, block)] of each later layer])``."""
    block, stack, size_fmt = _file_header(raw, where)
    if len(layers) > stack:
        raise FormatError(f"the meta file records {len(layers)} layers, the file's stack size is {stack}",
                          path=where)
    heads: list[tuple[int, int]] = []
    base: dict[int, memoryview] = {}
    later: list[list[tuple[int, int, memoryview]]] = []
    start = 0
    for k, (size, digest) in enumerate(layers):
        cur = _Cursor(raw, start, start + size, f"{where}, layer {k}")
        if start + size > len(raw):
            raise FormatError(f"layer {k} ends at byte {start + size}, the file at {len(raw)} (cut short)",
                              path=where)
        if k == 0:
            cur.take(struct.calcsize(size_fmt) + 4, "file header")
        ckpt_id, nb_var = cur.unpack("<ii", "layer header")
        if nb_var < 0 or nb_var >= 1 << _VAR_BITS:
            raise FormatError(f"layer {k} counts {nb_var} variables", path=cur.where)
        heads.append((ckpt_id, nb_var))
        blocks: list[memoryview] = []
        if k == 0:
            for _ in range(nb_var):
                vid, nbytes = cur.unpack("<i" + size_fmt[1], "variable header")
                if vid in base or not 0 <= vid < 1 << _VAR_BITS:
                    raise FormatError(f"variable id {vid} is not a dCP id or is listed twice", path=cur.where)
                stored = -(-nbytes // block) * block
                base[vid] = cur.take(stored, f"variable {vid}'s {nbytes} bytes")
                blocks += [base[vid][i:i + block] for i in range(0, stored, block)]
        else:
            entries = []
            while cur.pos < cur.end:
                low, high = struct.unpack("<IH", cur.take(_BLOCK_META, "block header"))
                data = cur.take(block, "block")
                word = low | high << 32
                entries.append((word & (1 << _VAR_BITS) - 1, word >> _VAR_BITS & (1 << _BLOCK_BITS) - 1, data))
                blocks.append(data)
            later.append(entries)
        if cur.pos != cur.end:
            raise FormatError(f"layer {k}'s content ends at byte {cur.pos}, the meta file's dcp_layer{k}_size at "
                              f"{cur.end}", path=where)
        if _blocks_md5(blocks) != digest:
            raise FormatError(f"layer {k}'s blocks do not match the meta file's dcp_layer{k}_hash (damaged file)",
                              path=where)
        start += size
    return block, heads, base, later


def _layer_sizes(values: dict[str, str], nlayers: int, where: str) -> list[dict[int, int] | None]:
    """Each layer's variable sizes as FTI recorded them when it wrote the layer (``dcp_layer{k}_var{j}_id`` and
    ``_size``; FTI reads them back into ``datasetInfo[k]``), None for a layer the section records none of."""
    out: list[dict[int, int] | None] = []
    for k in range(nlayers):
        found: dict[int, int] = {}
        while f"dcp_layer{k}_var{len(found)}_id" in values:
            key = f"dcp_layer{k}_var{len(found)}"
            vid = _count(values, f"{key}_id", where, signed=True)
            if vid in found:
                raise FormatError(f"{key}_id = {vid} is listed twice in layer {k}", path=where)
            found[vid] = _count(values, f"{key}_size", where)
        out.append(found or None)
    return out


def _apply(block: int, sizes: dict[int, int], base: dict[int, memoryview],
           later: list[list[tuple[int, int, memoryview]]], where: str,
           layer_sizes: list[dict[int, int] | None] | None = None) -> dict[int, memoryview]:
    """Each variable's bytes: layer 0, then the later layers' blocks in order, cut to its recorded size; every
    block of every variable must have been written by some layer. FTI's layer hash covers the blocks, not their
    headers: a block a layer could not have written (past its variable's size at that layer, ``layer_sizes``) is a
    damaged header, never a block to drop (the older layer's block would be recovered in its place)."""
    unknown = sorted(set(base) - set(sizes)) + sorted({vid for entries in later for vid, _b, _d in entries
                                                        if vid not in sizes})
    if unknown:
        raise FormatError(f"the file holds variable id {unknown[0]}, which the meta file does not list", path=where)
    order = {vid: j for j, vid in enumerate(sizes)}  # protection order: FTI writes a layer's blocks in it
    for k, entries in enumerate(later, 1):
        keys = [(order[vid], index) for vid, index, _d in entries]
        if any(a >= b for a, b in zip(keys, keys[1:])):
            raise FormatError(f"layer {k}'s blocks are not in FTI's order (variables as protected, blocks rising): "
                              "a block header is damaged", path=where)
    for k, entries in enumerate(later, 1):
        known = layer_sizes[k] if layer_sizes and k < len(layer_sizes) else None
        for vid, index, _d in entries if known is not None else ():
            if index * block >= known.get(vid, 0):
                raise FormatError(f"layer {k} holds block {index} of variable {vid}, past its {known.get(vid, 0)} "
                                  f"bytes at that layer (dcp_layer{k}_var*_size): a block header is damaged",
                                  path=where)
    by_var: dict[int, list[tuple[int, memoryview]]] = {vid: [] for vid in sizes}  # one pass: linear in the blocks
    for entries in later:
        for vid, index, data in entries:
            by_var[vid].append((index, data))
    out: dict[int, memoryview] = {}
    for vid, size in sizes.items():
        held = -(-len(base.get(vid, b"")) // block) + len(by_var[vid])
        if -(-size // block) > held:  # checked before allocating: a hostile size asks for no memory
            raise FormatError(f"variable {vid}: its {size} bytes are {-(-size // block)} blocks, the layers hold "
                              f"{held} of it", path=where)
        buf = bytearray(size)
        covered = set()
        first = base.get(vid, memoryview(b""))
        n = min(len(first), size)
        buf[:n] = first[:n]
        covered.update(range(-(-n // block)))
        for index, data in by_var[vid]:  # the layers' order: a later layer's block overwrites an earlier one
            offset = index * block
            if offset < size:  # blocks past the size were written when the variable was larger
                buf[offset:offset + min(block, size - offset)] = data[:min(block, size - offset)]
                covered.add(index)
        missing = set(range(-(-size // block))) - covered
        if missing:
            raise FormatError(f"variable {vid}: block {min(missing)} of its {size} bytes is in no layer", path=where)
        out[vid] = memoryview(buf)
    return out


def read_dcp_posix(path: str | os.PathLike[str], meta: str | os.PathLike[str]) -> PosixFile:
    """Read and verify FTI's POSIX dCP file ``path`` with its meta file (or a directory of them): each variable's
    bytes as of the newest layer the meta file records, every layer's hash checked first (FormatError else)."""
    if not is_dcp_file(path):
        raise FormatError("not an FTI POSIX dCP file name (dcp-id{f}-rank{r}.fti)", path=os.fspath(path))
    meta_path, values = find_section(path, meta)
    where = f"{meta_path} [{os.path.basename(os.fspath(path))}]"
    if values["ckpt_type"] != "dcp":
        raise FormatError(f"the meta file's ckpt_type is {values['ckpt_type']!r}, not dcp", path=where)
    layers = _meta_layers(values, where)
    sizes = _variables(values, where)
    for j, (vid, size) in enumerate(sizes.items()):  # FTI_WriteMetadata repeats them under the newest layer
        key = f"dcp_layer{len(layers) - 1}_var{j}"
        if (values.get(f"{key}_id", str(vid)), values.get(f"{key}_size", str(size))) != (str(vid), str(size)):
            raise FormatError(f"{key}_id/_size say variable {values.get(f'{key}_id')} of "
                              f"{values.get(f'{key}_size')} bytes, var{j}_id/_size {vid} of {size}", path=where)
    total = sum(size for size, _d in layers)
    if _count(values, "ckpt_file_size", where) != total:
        raise FormatError(f"ckpt_file_size = {values['ckpt_file_size']}, the layers recorded add up to {total}",
                          path=where)
    raw = read_whole(path, total, longer=True)  # layers appended after the meta file's: not read
    block, heads, base, later = _parse_layers(memoryview(raw), layers, os.fspath(path))
    ckpt_id = values.get("ckpt_info_ckpt_id")
    if ckpt_id is not None and str(heads[-1][0]) != ckpt_id:
        raise FormatError(f"the newest layer is checkpoint {heads[-1][0]}, the meta file's ckpt_id is {ckpt_id}",
                          path=where)
    if heads[-1][1] != len(sizes):
        raise FormatError(f"the newest layer counts {heads[-1][1]} variables, the meta file lists {len(sizes)}",
                          path=where)
    return PosixFile(os.fspath(path), str(meta_path), _apply(block, sizes, base, later, os.fspath(path),
                                                             _layer_sizes(values, len(layers), where)))


def read_dcp_head(path: str | os.PathLike[str]) -> dict:
    """What a dCP file says of itself, without its meta file: layout, block and stack size, layer 0's checkpoint id
    and variables (id, bytes), the file's size. Later layers' bounds are in the meta file only (FormatError if the
    header or layer 0 does not hold together)."""
    try:
        with open_read(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(24)
            block, stack, size_fmt = _file_header(memoryview(head), os.fspath(path))
            pos = struct.calcsize(size_fmt) + 4
            if len(head) < pos + 8:
                raise FormatError("the file ends inside layer 0's header", path=os.fspath(path))
            ckpt_id, nb_var = struct.unpack_from("<ii", head, pos)
            pos += 8
            entry = struct.Struct("<i" + size_fmt[1])
            variables: list[tuple[int, int]] = []
            for _ in range(max(nb_var, 0)):
                fh.seek(pos)
                raw = fh.read(entry.size)
                if len(raw) < entry.size:
                    raise FormatError(f"the file ends inside layer 0's variable {len(variables)}", path=os.fspath(path))
                vid, nbytes = entry.unpack(raw)
                pos += entry.size + -(-nbytes // block) * block
                if pos > size:
                    raise FormatError(f"variable {vid}'s {nbytes} bytes run past the end of the file",
                                      path=os.fspath(path))
                variables.append((vid, nbytes))
    except OSError as exc:
        raise FormatError(f"cannot read: {exc}", path=os.fspath(path)) from None
    if nb_var < 0:
        raise FormatError(f"layer 0 counts {nb_var} variables", path=os.fspath(path))
    return {"layout": "uint32" if size_fmt == "<I" else "unsigned long", "block_size": block, "stack_size": stack,
            "ckpt_id": ckpt_id, "variables": variables, "layer0_size": pos, "file_size": size}
