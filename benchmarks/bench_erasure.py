"""Throughput of the level-3 Reed-Solomon codec (native kernel and NumPy) against a plain memory copy.

    python benchmarks/bench_erasure.py [--size-mib 64] [--repeat 5] [--numpy-mib 8] [--isa NAME]
                                       [--files] [--compare]

For k = m = 4 and k = 8, m = 4, blocks of --size-mib MiB per member. Figures are GB/s of data
(k blocks) per operation; "vs copy" divides by np.copyto of the same bytes on one thread,
measured in the same run, which cancels part of the machine's noise. "threads 1" rows are per
core; "threads N" rows split each stripe over every core (what the codec does for stripes of
1 MiB or more). Encode computes all m parity rows, decode the 2 lost data blocks, both into
buffers allocated once (as encode_files does); "RS.encode" goes through the public API, which
allocates its outputs on every call. The NumPy rows time the first --numpy-mib MiB of each block
(the NumPy code is tens of times slower; its rate does not depend on the size). --isa forces one
native code path (scalar, ssse3, avx2, gfni-avx2, avx512, gfni, neon); --files adds
encode_files/decode_files with the files in the page cache; --compare adds zfec when installed.
The best and the median of --repeat runs are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ftidask.levels import erasure, gf_native
from ftidask.levels.erasure import ReedSolomon, decode_files, encode_files


def measure(fn: Callable[[], object], nbytes: int, repeat: int) -> tuple[float, float]:
    """(best, median) GB/s over `repeat` timed runs after one warm-up."""
    fn()
    rates = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    return max(rates), statistics.median(rates)


@contextlib.contextmanager
def mode(native: bool, threads: int | None) -> Iterator[None]:
    old = erasure.use_native, gf_native.threads
    erasure.use_native, gf_native.threads = native, threads
    try:
        yield
    finally:
        erasure.use_native, gf_native.threads = old


Row = tuple[str, str, float, float, float]  # operation, threads, best and median GB/s, best / copy's best


def bench(k: int, m: int, size: int, args: argparse.Namespace, rows: list[Row]) -> None:
    rng = np.random.default_rng(k * 100 + m)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    rs = ReedSolomon(k, m)
    lost = (0, 1)
    parity = [np.empty(size, np.uint8) for _ in range(m)]
    erasure._apply(rs._parity, data, parity)
    chosen, dmat = rs._solve([i for i in range(k + m) if i not in lost], list(lost))
    survivors = [(data + parity)[i] for i in chosen]
    rebuilt = [np.empty(size, np.uint8) for _ in lost]
    erasure._apply(dmat, survivors, rebuilt)
    assert all(np.array_equal(a, data[i]) for a, i in zip(rebuilt, lost)), "decode mismatch"
    copies = [np.empty(size, np.uint8) for _ in range(k)]
    nbytes, cores = k * size, gf_native._cores()
    base = measure(lambda: [np.copyto(c, d) for c, d in zip(copies, data)], nbytes, args.repeat)
    tag = f"k={k} m={m}"
    rows.append((f"{tag} np.copyto (memcpy)", "1", *base, 1.0))

    def run(name: str, threads: str, fn: Callable[[], object], n: int = nbytes) -> None:
        best, med = measure(fn, n, args.repeat)
        rows.append((f"{tag} {name}", threads, best, med, best / base[0]))

    if gf_native.available():
        isa = gf_native.isa()
        for threads in (1, None):
            with mode(True, threads):
                label = "1" if threads == 1 else str(cores)
                run(f"native encode ({isa})", label, lambda: erasure._apply(rs._parity, data, parity))
                run(f"native decode ({isa})", label, lambda: erasure._apply(dmat, survivors, rebuilt))
        with mode(True, None):
            run("RS.encode (API, allocates)", str(cores), lambda: rs.encode(data))
    cut = min(size, int(args.numpy_mib * (1 << 20)))
    with mode(False, 1):
        d, p, s, r = ([a[:cut] for a in x] for x in (data, parity, survivors, rebuilt))
        run("numpy encode", "1", lambda: erasure._apply(rs._parity, d, p), k * cut)
        run("numpy decode", "1", lambda: erasure._apply(dmat, s, r), k * cut)
    if args.files:
        with tempfile.TemporaryDirectory() as tmp:
            dpaths = [os.path.join(tmp, f"d{i}") for i in range(k)]
            ppaths = [os.path.join(tmp, f"p{j}") for j in range(m)]
            for path, block in zip(dpaths, data):
                block.tofile(path)
            run("encode_files (page cache)", str(cores), lambda: encode_files(dpaths, ppaths))
            gone = [None if i in lost else path for i, path in enumerate(dpaths)]
            outs = {i: os.path.join(tmp, f"o{i}") for i in lost}
            run("decode_files (page cache)", str(cores), lambda: decode_files(gone, ppaths, [size] * k, outs))
    if args.compare:
        import zfec  # (main checked it is installed)

        enc = zfec.Encoder(k, k + m)
        raw = [x.tobytes() for x in data]
        run("zfec encode", "1", lambda: enc.encode(raw, list(range(k, k + m))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=64, help="MiB per member block (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per figure (default 5)")
    ap.add_argument("--numpy-mib", type=float, default=8, help="MiB per block timed on the NumPy path (default 8)")
    ap.add_argument("--isa", default=None, help="force one native code path")
    ap.add_argument("--files", action="store_true", help="also time encode_files/decode_files")
    ap.add_argument("--compare", action="store_true", help="also time zfec if installed")
    args = ap.parse_args()
    if args.isa:
        from ftidask import _native

        try:
            ok = _native.gf_set_isa(args.isa)
        except ValueError as exc:  # a name no build has
            sys.exit(f"--isa {args.isa}: {exc}")
        if not ok:
            sys.exit(f"this CPU or build lacks {args.isa}")
    if args.compare:
        try:
            import zfec  # noqa: F401
        except ImportError:
            print("zfec not installed: --compare skipped", file=sys.stderr)
            args.compare = False
    size = int(args.size_mib * (1 << 20))
    rows: list[Row] = []
    for k, m in ((4, 4), (8, 4)):
        bench(k, m, size, args, rows)
    print(f"native kernel: {gf_native.isa() or 'not built'}; {gf_native._cores()} cores; blocks of "
          f"{size / (1 << 20):g} MiB; GB/s of data (k blocks), best / median of {args.repeat}; "
          f"vs copy = best / best of one-thread np.copyto")
    print(f"{'operation':<44}{'threads':>8}{'best GB/s':>11}{'median':>8}{'vs copy':>9}")
    for name, threads, best, med, ratio in rows:
        print(f"{name:<44}{threads:>8}{best:>11.2f}{med:>8.2f}{ratio:>9.3f}")


if __name__ == "__main__":
    main()
