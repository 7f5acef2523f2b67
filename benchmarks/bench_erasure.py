"""Throughput of the level-3 Reed-Solomon codec against a plain memory copy.

    python benchmarks/bench_erasure.py [--size-mib 16] [--repeat 5] [--compare]

k = 4 data blocks, m = 4 parity blocks of --size-mib MiB each.  Figures are MB/s
of data (k blocks) per operation; "vs copy" divides by np.copyto of the same
bytes measured in the same run, which cancels part of the machine's noise.
The best and the median of --repeat runs are shown.  --compare adds zfec when
it is installed (a candidate library measured when the codec was chosen).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ftidask.levels.erasure import ReedSolomon, decode_files, encode_files


def measure(fn: Callable[[], object], nbytes: int, repeat: int) -> tuple[float, float]:
    """(best, median) MB/s over `repeat` timed runs after one warm-up."""
    fn()
    rates = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t) / 1e6)
    return max(rates), statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=16, help="size of each block in MiB (default 16)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per figure (default 5)")
    ap.add_argument("--compare", action="store_true", help="also time zfec if installed")
    args = ap.parse_args()
    k, m, lost = 4, 4, (0, 1)
    size = int(args.size_mib * (1 << 20))
    nbytes = k * size
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    rs = ReedSolomon(k, m)
    parity = rs.encode(data)
    avail = {i: b for i, b in enumerate(data + parity) if i not in lost}
    out = rs.decode(avail)
    assert all(np.array_equal(a, b) for a, b in zip(out, data)), "decode mismatch"
    copies = [np.empty(size, np.uint8) for _ in range(k)]

    rows: list[tuple[str, float, float]] = []

    def run(name: str, fn: Callable[[], object]) -> None:
        rows.append((name, *measure(fn, nbytes, args.repeat)))

    def copy() -> None:
        for c, d in zip(copies, data):
            np.copyto(c, d)

    run("np.copyto (baseline)", copy)
    run(f"encode all {m} parities", lambda: rs.encode(data))
    run("encode 1 parity row (row 2)", lambda: rs.encode(data, [2]))
    run(f"decode, data {lost[0]},{lost[1]} lost", lambda: rs.decode(avail))
    with tempfile.TemporaryDirectory() as tmp:
        dpaths = [os.path.join(tmp, f"d{i}") for i in range(k)]
        ppaths = [os.path.join(tmp, f"p{j}") for j in range(m)]
        for p, d in zip(dpaths, data):
            d.tofile(p)
        run("encode_files (page cache)", lambda: encode_files(dpaths, ppaths))
        gone = [None if i in lost else p for i, p in enumerate(dpaths)]
        outs = {i: os.path.join(tmp, f"o{i}") for i in lost}
        run("decode_files (page cache)", lambda: decode_files(gone, ppaths, [size] * k, outs))
    if args.compare:
        try:
            import zfec
        except ImportError:
            print("zfec not installed: --compare skipped", file=sys.stderr)
        else:
            enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
            raw = [d.tobytes() for d in data]
            zpar = enc.encode(raw, list(range(k, k + m)))
            idx = [i for i in range(k + m) if i not in lost][:k]
            have = [(raw + zpar)[i] for i in idx]
            run("zfec encode all parities", lambda: enc.encode(raw, list(range(k, k + m))))
            run("zfec encode 1 parity row", lambda: enc.encode(raw, [k + 2]))
            run("zfec decode, 2 lost", lambda: dec.decode(have, idx))

    base = rows[0][1]
    print(f"k={k} m={m}, blocks of {size / (1 << 20):g} MiB, MB/s of data ({nbytes / 1e6:.0f} MB), "
          f"best / median of {args.repeat}")
    print(f"{'operation':<32}{'best MB/s':>11}{'median':>9}{'vs copy':>9}")
    for name, best, med in rows:
        print(f"{name:<32}{best:>11.0f}{med:>9.0f}{best / base:>9.3f}")


if __name__ == "__main__":
    main()
