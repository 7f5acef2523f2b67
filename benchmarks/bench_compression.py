"""Compression of FTI-FF containers: ratio and throughput per codec, against no compression.

    python benchmarks/bench_compression.py [--mib 64] [--repeat 3] [--codecs zstd,lz4,blosc,...]

Two float64 fields of ``--mib`` MiB each: a smooth one (a 2-D temperature field, full double
precision, as a solver writes it) and uniform random numbers. For each codec: the ratio (raw / stored bytes), the codec's own
compress and decompress speed (MB/s of raw data, one core), and a level-1 checkpoint and
recovery through ftidask, timed against the uncompressed baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from timing import best

import ftidask
from ftidask.ftiff import compression

DEFAULT_CODECS = "none,lz4,zstd:1,zstd:3,blosc,blosc-zstd:3,blosc-lz4hc"


def smooth_field(nbytes: int) -> np.ndarray:
    """A diffused 2-D temperature field: a few Gaussian sources plus a gradient, full double precision."""
    n = int(np.sqrt(nbytes // 8))
    y, x = np.mgrid[0:1:n * 1j, 0:1:n * 1j]
    field = 300.0 + 20.0 * x
    rng = np.random.default_rng(0)
    for _ in range(6):
        cx, cy, w, a = rng.random(4)
        field += 50 * a * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (0.005 + 0.05 * w))
    return field


def random_field(nbytes: int) -> np.ndarray:
    return np.random.default_rng(1).random(nbytes // 8)



def codec_speed(spec: str, data: np.ndarray, repeat: int) -> tuple[float, float, float]:
    """(ratio, compress MB/s, decompress MB/s) of the codec alone on ``data``."""
    config = compression.parse_compressor(spec)
    if config is None:
        return 1.0, float("nan"), float("nan")
    codec = compression.get_codec(config)
    raw = memoryview(data.reshape(-1).view(np.uint8))
    stored, _plain = compression.encode_span(codec, raw, data.dtype.itemsize)
    t_c = best(lambda: compression.encode_span(codec, raw, data.dtype.itemsize), repeat)
    t_d = best(lambda: compression.decode_span(codec, stored, len(raw)), repeat) if len(stored) < len(raw) else 0
    mb = data.nbytes / 1e6
    return data.nbytes / len(stored), mb / t_c, (mb / t_d if t_d else float("nan"))


def checkpoint_cycle(root: Path, spec: str, data: np.ndarray, repeat: int) -> tuple[float, float, int]:
    """(checkpoint s, recovery s, stored bytes) of a level-1 checkpoint of ``data`` with ``spec``."""
    ckpts, recs, stored = [], [], 0
    for r in range(repeat):
        dirs = dict(ckpt_dir=root / f"l{r}", glbl_dir=root / f"g{r}", meta_dir=root / f"m{r}", verbosity=3,
                    progress="off")
        ctx = ftidask.init(**dirs)
        ctx.protect(1, data, compressor=spec)
        info = ctx.checkpoint(1, 1)
        ckpts.append(info.seconds)
        stored = info.bytes_written
        # closed as a job that ends (the checkpoint stays for the recovery; finalize would remove it): left open, the
        # recovering context's finalize warned that the run was still open in another context, once per codec
        ctx._close()
        ctx2 = ftidask.init(**dirs)
        out = np.empty_like(data)
        ctx2.protect(1, out)
        start = time.perf_counter()
        ctx2.recover()
        recs.append(time.perf_counter() - start)
        if out.tobytes() != data.tobytes():
            raise SystemExit(f"{spec}: recovered data differs")
        ctx2.finalize()
    return min(ckpts), min(recs), stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB per field (default 64)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    args = parser.parse_args()
    nbytes = args.mib << 20
    fields = {"smooth float64": smooth_field(nbytes), "random float64": random_field(nbytes)}
    root = Path(tempfile.mkdtemp(prefix="ftidask-bench-compression-"))
    try:
        for label, data in fields.items():
            print(f"\n{label}: {data.nbytes / 2**20:.0f} MiB, best of {args.repeat}")
            print(f"{'codec':14} {'ratio':>6} {'comp MB/s':>10} {'decomp MB/s':>12} {'ckpt s':>8} {'x base':>7} "
                  f"{'recover s':>10} {'x base':>7}")
            base_c = base_r = None
            codecs = args.codecs.split(",")
            for spec in ["none"] + [c for c in codecs if c != "none"]:  # the baseline first: uncompressed
                ratio, c_mbs, d_mbs = codec_speed(spec, data, args.repeat)
                t_c, t_r, stored = checkpoint_cycle(root / spec.replace(":", "_"), spec, data, args.repeat)
                if base_c is None:
                    base_c, base_r = t_c, t_r
                print(f"{spec:14} {data.nbytes / stored:6.2f} {c_mbs:10.0f} {d_mbs:12.0f} {t_c:8.3f} "
                      f"{t_c / base_c:7.2f} {t_r:10.3f} {t_r / base_r:7.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
