"""A seeded fuzzer of FTI-FF files of thousands of small containers: each case mutates a base file (VMD bytes, a
container's dptr/fptr/chunksize/containersize/hash, containers swapped, block and file block fields, the table's JSON,
data with or without its hash forged to match, the file cut or grown, also between the reader's checks) and recovers
it into arrays filled with a pattern. ``python tests/fuzz_small_containers.py DIR FIRST COUNT`` prints one line a case
(two versions of the readers compare line by line); test_hostile_reads6.py runs a slice.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ftidask.ftiff import hashing, reader
from ftidask.ftiff.layout import plan_layout
from ftidask.ftiff.structs import BMD_SIZE, FB_SIZE, VMD_SIZE, FileBlock
from ftidask.ftiff.trailer import TAIL_SIZE, pack_trailer
from ftidask.ftiff.writer import write_ftiff
from ftidask.model.arrays import ArrayBytes, VarInfo
from ftidask.model.errors import FTIError

_VMD = struct.Struct("<iiiB3xqqqq16s")
_BMD = struct.Struct("<iq")
_DTYPES = ["<f8", ">f8", "<i2", "u1", "<c8", "?", "<U3", "S5", "<M8[s]", "<f2"]


def base_arrays(seed: int, n: int) -> dict[int, np.ndarray]:
    """``n`` small arrays of many kinds (a few above the verifier's small size, to break its runs)."""
    rng = np.random.default_rng(seed)
    out: dict[int, np.ndarray] = {}
    for vid in range(n):
        kind = vid % 13
        if kind == 0:
            a = np.array(rng.random())  # 0-d
        elif kind == 1:
            a = np.zeros((0, 3))
        elif kind == 2:
            a = np.asfortranarray(rng.random((3, 1 + vid % 7)))
        elif kind == 3:
            a = np.frombuffer(rng.bytes(80), dtype=[("a", "<i4"), ("b", ">f8", (2,))]).copy()
        elif kind == 4 and vid % 117 == 4:
            a = rng.random(70_000 // 8 + vid % 5)  # above SMALL_BYTES
        else:
            dt = np.dtype(_DTYPES[vid % len(_DTYPES)])
            a = np.frombuffer(rng.bytes(dt.itemsize * (1 + vid % 40)), dt).copy()
        out[vid] = a
    return out


def write_base(path: Path, arrays: dict[int, np.ndarray], hash_id: int, grown: bool) -> dict[int, np.ndarray]:
    """Write a base file (``grown``: some variables then grown, shrunk, removed); the arrays it holds."""
    sizes = [(vid, a.nbytes) for vid, a in arrays.items()]
    layout = plan_layout(None, sizes)
    held = dict(arrays)
    if grown:
        rng = np.random.default_rng(len(arrays))
        for vid in list(held):
            if vid % 7 == 5:
                held[vid] = np.concatenate([held[vid].reshape(-1)] * 2) if held[vid].ndim else held[vid]
            elif vid % 11 == 6 and held[vid].ndim == 1 and held[vid].size > 1:
                held[vid] = held[vid][: held[vid].size // 2].copy()
            elif vid % 17 == 9:
                del held[vid]
        held[len(arrays) + 5] = rng.random(9)
        layout = plan_layout(layout, [(vid, a.nbytes) for vid, a in held.items()])
    infos = [VarInfo.json_of(vid, f"v{vid}", a) for vid, a in held.items()]
    with open(path, "w+b") as fh:
        write_ftiff(fh, layout, {vid: ArrayBytes(a) for vid, a in held.items()}, hash_id=hash_id,
                    trailer={"format": "ftidask", "vars": infos}, timestamp=12345)
    return held


def _blocks(raw: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(offset, numvars, dbsize) of each block the parser would walk (stopping where it would refuse)."""
    fs = struct.unpack_from("<q", raw, 64)[0]
    out, offset = [], FB_SIZE
    while offset < fs and offset + BMD_SIZE <= len(raw):
        numvars, dbsize = _BMD.unpack_from(raw, offset)
        if numvars < 0 or dbsize < BMD_SIZE + VMD_SIZE * numvars or offset + dbsize > len(raw):
            break
        out.append((offset, numvars, dbsize))
        offset += dbsize
    return out


def _trailer_start(raw: bytes | bytearray) -> int | None:
    if len(raw) < TAIL_SIZE:
        return None
    length, magic = struct.unpack_from("<Q8s", raw, len(raw) - TAIL_SIZE)
    start = len(raw) - TAIL_SIZE - length
    return start if magic == b"FTDKVARS" and start >= 0 else None


def reseal(raw: bytearray) -> None:
    """Recompute the metadata checksum and the file block's hash, as a forger would."""
    fb = FileBlock.unpack(bytes(raw[:FB_SIZE]))
    if fb.legacy or fb.hash_id not in (1, 2):
        return
    checksum = hashing.new_hasher(fb.hash_id)
    for offset, numvars, _dbsize in _blocks(raw):
        checksum.update(bytes(raw[offset:offset + BMD_SIZE + VMD_SIZE * numvars]))
    start = _trailer_start(raw)
    if start is not None:
        checksum.update(bytes(raw[start:]))
    sealed = FileBlock(checksum.hexdigest()[:32], bytes(16), fb.ckpt_size, fb.fs, fb.max_fs, fb.pt_fs, fb.timestamp,
                       fb.magic, fb.version, fb.hash_id, fb.flags).sealed()
    raw[:FB_SIZE] = sealed.pack()


def _vmd_offsets(raw: bytes | bytearray) -> list[int]:
    return [off + BMD_SIZE + VMD_SIZE * i for off, n, _d in _blocks(raw) for i in range(n)]


_ODD_DTYPES = [  # same item sizes as the bases' (a table that parses), and odd or hostile ones
    "<i8", ">u8", "<M8[s]", "<m8[ms]", "(2,)<f4", "(1,)<f8", "<c8", "(8,)u1", "S8", "<U2", "(2,)<i4", "V4", "(4,)S1",
    "<f4", ">i4", "(2,)<i2", "(2,)u1", "<i2", "S2", "V2", "?", "i1", "(3,)S1", "<U1", "(2,2)<f8", "(4,)<f8", "<c16",
    "(2,)<c8", "S32", "(8,)<f2", "<f8", ">f8", "f8", "d", "float64", "V8", "V0", "|V1", "i4,f8", "(2,3)f8", "(70,)f8",
    "(0,)f8", "U0", "S0", ">M8[ns]", "M8", "<m8[D]", "V99999999999", "<q9", " f8", "f8 ", "b1", "c", "O", "O8", "(2,)O",
    "[('a','<i4')]", "<f16", "g", "G", "e", "(33,33)f8", "(64,)u1", "u1", "(1,)" * 5 + "u1", "i", "<i4", "|b1", "S3",
    "p", "P", "<c32", "m", "M8[Y]", "<U999999999", "S2147483648", "\x00f8"]


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except Exception:  # noqa: BLE001 - not a dtype NumPy knows
        return -1


def _forge_table(raw: bytearray, rng: random.Random) -> None:
    start = _trailer_start(raw)
    if start is None:
        return
    try:
        table = json.loads(bytes(raw[start:len(raw) - TAIL_SIZE]))
    except ValueError:
        return
    entries = table.get("vars") or []
    for _ in range(rng.randint(1, 4)):
        if not entries:
            break
        e = rng.choice(entries)
        what = rng.randrange(11)
        if what >= 9:  # another dtype of the same item size: a table that parses, read as other values
            size = _itemsize(e["dtype"]) if isinstance(e["dtype"], str) else -2
            same = [d for d in _ODD_DTYPES if _itemsize(d) == size]
            if same:
                e["dtype"] = rng.choice(same)
        elif what <= 2:
            dt = rng.choice(_ODD_DTYPES)
            e["dtype"] = dt
            if rng.random() < 0.7 and _itemsize(dt) >= 0 and isinstance(e["shape"], list):  # a table that adds up
                e["nbytes"] = int(np.prod(e["shape"], dtype=np.int64)) * _itemsize(dt)
        elif what == 3:
            e["shape"] = rng.choice([[0], [], [-1], [1] * 70, [2 ** 40, 2 ** 40], ["3"], [1.5], None, "12", [True]])
        elif what == 4:
            e["nbytes"] = rng.choice([0, -1, e.get("nbytes", 0) + 1, 2 ** 63, "8", None])
        elif what == 5:
            e["order"] = rng.choice(["F", "C", "X", None, 1])
        elif what == 6:
            e["extra"] = rng.choice([{"codec": {"id": "zstd"}}, {"codec": "x"}, [], None, {"plain": [0]}, "ab",
                                     {"codec": {"id": "nope"}}, [["a", 1]], {}])
        elif what == 7:
            e["id"] = rng.choice([entries[0]["id"], -1, 2 ** 40, "1", None])
        else:
            e["dtype"] = rng.choice([{"base": "<f8", "shape": [2]}, {"names": ["a"], "formats": ["<f8"],
                                     "offsets": [0], "itemsize": 8}, ["<f8"], 8, None,
                                     {"names": ["a", "a"], "formats": ["u1", "u1"], "offsets": [0, 0], "itemsize": 1},
                                     {"base": {"base": "u1", "shape": [2] * 40}, "shape": [2] * 30}])
    payload = json.dumps(table).encode()
    raw[start:] = pack_trailer(payload)


def mutate(base: bytes, rng: random.Random) -> tuple[bytearray, str]:
    """A hostile copy of ``base`` and the kind of its last mutation; the caller's ``cut`` (see :func:`run_case`)."""
    raw, kinds = bytearray(base), []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        vmds = [off for off in _vmd_offsets(raw) if off + VMD_SIZE <= len(raw)]
        kind = rng.choice(["flip_vmd", "field", "field", "field", "swap", "data", "bmd", "fb", "table", "table",
                           "cut", "grow", "flip_any", "hash_copy", "rehash", "rehash"])
        kinds.append(kind)
        seal = rng.random() < 0.85
        blocks = _blocks(raw)
        if kind == "flip_vmd" and vmds:
            off = rng.choice(vmds)
            for _ in range(rng.randint(1, 4)):
                raw[off + rng.randrange(VMD_SIZE)] ^= 1 << rng.randrange(8)
        elif kind == "field" and vmds:
            off = rng.choice(vmds)
            fields = list(_VMD.unpack_from(raw, off))
            i = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8])
            neighbour = list(_VMD.unpack_from(raw, rng.choice(vmds)))
            if i == 8:
                fields[8] = rng.choice([bytes(16), neighbour[8], bytes(range(16))])
            elif i == 3:
                fields[3] = rng.choice([0, 1, 2, 255])
            else:
                v = fields[i]
                fields[i] = rng.choice([0, -1, v + 1, v - 1, v + 64, v - 64, v * 2, 2 ** 31 - 1 if i < 3 else 2 ** 62,
                                        -(2 ** 31) if i < 3 else -(2 ** 62), neighbour[i], 65536, 65537, 1 << 20])
                bound = 2 ** 31 if i < 3 else 2 ** 63
                fields[i] = max(-bound, min(bound - 1, fields[i]))
            _VMD.pack_into(raw, off, *fields)
            if rng.random() < 0.3 and i in (6, 7):  # the block's size follows, as a careful forger's would
                for boff, n, dbsize in blocks:
                    if boff < off < boff + BMD_SIZE + VMD_SIZE * n:
                        _BMD.pack_into(raw, boff, n, dbsize + (fields[i] - v if i == 7 else 0))
        elif kind == "swap" and len(vmds) > 1:
            a, b = rng.sample(vmds, 2)
            if rng.random() < 0.5:  # neighbours
                k = rng.randrange(len(vmds) - 1)
                a, b = vmds[k], vmds[k + 1]
            ra, rb = bytes(raw[a:a + VMD_SIZE]), bytes(raw[b:b + VMD_SIZE])
            raw[a:a + VMD_SIZE], raw[b:b + VMD_SIZE] = rb, ra
            if rng.random() < 0.5:  # fptrs kept in place: only the rest moved
                raw[a + 32:a + 40], raw[b + 32:b + 40] = ra[32:40], rb[32:40]
        elif kind in ("data", "rehash") and vmds:  # rehash: the container's hash forged to match its new bytes
            off = rng.choice(vmds)
            f = list(_VMD.unpack_from(raw, off))
            lo, n = f[5], max(1, f[6])
            if 0 <= lo < len(raw):
                raw[min(len(raw) - 1, lo + rng.randrange(n))] ^= 1 << rng.randrange(8)
            hid = raw[54] if raw[49:53] == b"FTDK" else 1
            if kind == "rehash" and f[3] and 0 <= lo <= lo + f[6] <= len(raw) and hid in (1, 2):
                f[8] = hashing.digest(hid, bytes(raw[lo:lo + f[6]]))
                _VMD.pack_into(raw, off, *f)
            else:
                seal = False
        elif kind == "bmd" and blocks:
            boff, n, dbsize = rng.choice(blocks)
            _BMD.pack_into(raw, boff, *rng.choice([(n - 1, dbsize), (n + 1, dbsize), (n, dbsize - 1),
                                                    (n, dbsize + 64), (0, BMD_SIZE), (-1, dbsize),
                                                    (n, dbsize - VMD_SIZE), (2 ** 31 - 1, dbsize)]))
        elif kind == "fb":
            field = rng.choice(["fs", "ckpt", "hid", "flags", "version", "maxfs"])
            pos = {"fs": 64, "ckpt": 56, "maxfs": 72}.get(field)
            if pos is not None:
                v = struct.unpack_from("<q", raw, pos)[0]
                struct.pack_into("<q", raw, pos, rng.choice([v - 1, v + 1, v - 64, 0, FB_SIZE, -1, len(raw)]))
            else:
                raw[{"hid": 54, "flags": 55, "version": 53}[field]] = rng.choice([0, 1, 2, 3, 255])
        elif kind == "table":
            _forge_table(raw, rng)
        elif kind == "cut":
            start = blocks[0][0] if blocks else FB_SIZE
            where = rng.randrange(start, len(raw))
            if vmds and rng.random() < 0.7:  # inside a run of small containers
                f = _VMD.unpack_from(raw, rng.choice(vmds))
                where = max(0, min(len(raw), f[5] + rng.randrange(max(1, f[7]))))
            del raw[where:]
            seal = False
        elif kind == "grow":
            raw += bytes(rng.randrange(1, 4096))
            seal = False
        elif kind == "flip_any":
            for _ in range(rng.randint(1, 8)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            seal = rng.random() < 0.5
        elif kind == "hash_copy" and len(vmds) > 1:  # a container given another's hash (and size)
            a, b = rng.sample(vmds, 2)
            fa, fb_ = list(_VMD.unpack_from(raw, a)), _VMD.unpack_from(raw, b)
            fa[8] = fb_[8]
            _VMD.pack_into(raw, a, *fa)
        if seal and len(raw) >= FB_SIZE:
            try:
                reseal(raw)
            except Exception:
                pass
    return raw, "+".join(kinds)


_PATTERN = 0xA5


def _digest_arrays(bufs: dict[int, np.ndarray]) -> str:
    h = hashlib.sha256()
    for vid in sorted(bufs):
        h.update(str(vid).encode())
        h.update(bufs[vid].tobytes())
    return h.hexdigest()[:16]


def expected_bytes(held: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """What the buffers of :func:`fresh_targets` hold once ``held`` is recovered into them (its own memory order)."""
    return {vid: np.frombuffer((a.T if a.flags.f_contiguous and not a.flags.c_contiguous else a).tobytes(), np.uint8)
            for vid, a in held.items()}


def fresh_targets(held: dict[int, np.ndarray]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Arrays shaped (and ordered) like the held ones over buffers of the pattern, and those buffers."""
    out, bufs = {}, {}
    for vid, a in held.items():
        buf = np.full(a.nbytes, _PATTERN, np.uint8)
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        out[vid], bufs[vid] = np.ndarray(a.shape, a.dtype, buffer=buf, order=order), buf
    return out, bufs


def run_case(path: Path, held: dict[int, np.ndarray], cut: str = "") -> tuple[str, str]:
    """Recover ``path`` into fresh arrays: ('ok', their digest), ('error', where and what) or ('BUG', why): an
    exception not an ftidask error, or arrays touched by a refused file.

    ``cut``: 'verify' shrinks the file between its parse and its check, 'read' between the check and the copy."""
    arrays, bufs = fresh_targets(held)
    stage = "parse"
    try:
        with open(path, "r+b") as fh:
            parsed = reader.parse_ftiff(fh, str(path))
            for vid, a in arrays.items():
                info = parsed.vars.get(vid)
                if info is None or info.nbytes != a.nbytes:  # the engine refuses sizes that differ, unread
                    return "refused", "sizes"
            stage = "verify"
            if cut == "verify":
                fh.truncate(max(FB_SIZE, parsed.fb.fs - 100))
            reader.verify_data(fh, parsed)
            stage = "read"
            if cut == "read":
                fh.truncate(max(FB_SIZE, parsed.fb.fs - 100))
            targets = {vid: ArrayBytes(a, parsed.vars[vid].order) for vid, a in arrays.items()}
            reader.read_into(fh, parsed, targets)
    except FTIError as exc:
        if stage != "read" and not all((b == _PATTERN).all() for b in bufs.values()):
            return "BUG", f"arrays touched by a file refused at {stage}: {exc}"
        said = str(exc).replace(str(path), "FILE")
        return "error", f"{stage}:{type(exc).__name__}:{said[:300]}"
    except Exception as exc:  # noqa: BLE001 - the finding
        return "BUG", f"{stage}: {type(exc).__name__}: {exc}"
    return "ok", _digest_arrays(bufs)


def make_bases(root: Path, n: int = 1500) -> list[tuple[Path, dict[int, np.ndarray]]]:
    """The base files: XXH3 and MD5, one block and grown (two blocks, shrunk and removed variables)."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for k, (hid, grown) in enumerate([(2, False), (1, True), (2, True)]):
        held = write_base(root / f"base{k}.fti", base_arrays(k, n), hid, grown)
        np.savez(root / f"base{k}.npz", **{str(vid): a for vid, a in held.items()})
        out.append((root / f"base{k}.fti", held))
    return out


def load_bases(root: Path) -> list[tuple[Path, dict[int, np.ndarray]]]:
    """The base files :func:`make_bases` wrote."""
    return [(root / f"base{k}.fti", dict(_npz(root / f"base{k}.npz"))) for k in range(3)]


def _npz(path: Path) -> Any:
    with np.load(path) as z:
        return [(int(key), z[key]) for key in z.files]


def case(bases: list[tuple[Path, dict[int, np.ndarray]]], seed: int, work: Path) -> tuple[str, str, str]:
    """Case ``seed``: (outcome, detail, what was done)."""
    rng = random.Random(seed)
    base_path, held = bases[seed % len(bases)]
    raw, kinds = mutate(base_path.read_bytes(), rng)
    cut = rng.choice(["", "", "", "", "", "", "verify", "read"])
    (work / "case.fti").write_bytes(bytes(raw))
    outcome, detail = run_case(work / "case.fti", held, cut)
    if outcome == "ok":  # the data the base holds, or other bytes a forged (resealed) file says it holds
        outcome = "ok-exact" if detail == _digest_arrays(expected_bytes(held)) else "ok-other"
    return outcome, detail, f"{kinds}{'/cut-' + cut if cut else ''}"


def main(argv: list[str]) -> int:
    import resource
    import signal

    root, first, count = Path(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    if not (root / "base0.fti").exists():
        make_bases(root)
    bases = load_bases(root)
    work = root / f"work{os.getpid()}"
    work.mkdir(exist_ok=True)
    for p, held in bases:  # the bases themselves recover exactly
        assert run_case(p, held) == ("ok", _digest_arrays(expected_bytes(held))), p
    signal.signal(signal.SIGALRM, lambda *_a: (_ for _ in ()).throw(TimeoutError("case took more than 60 s")))
    for seed in range(first, first + count):
        signal.alarm(60)
        try:
            outcome, detail, kinds = case(bases, seed, work)
        except TimeoutError as exc:
            outcome, detail, kinds = "BUG", str(exc), "?"
        signal.alarm(0)
        print(f"{seed}\t{outcome}\t{detail}\t{kinds}", flush=True)
    print(f"# maxrss_kib\t{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
