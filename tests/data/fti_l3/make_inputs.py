"""Write the rank files of the two simulated groups of 4 (see README.md): run from the repository root as
``python tests/data/fti_l3/make_inputs.py``. Deterministic: rerunning it rewrites the same bytes."""

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))  # tests/, for ftiff_builders (FTI-FF files built from the format)

from ftiff_builders import fti_tail_file  # noqa: E402

POSIX_SIZES = (2500, 1777, 3001, 999)  # odd, over 2-3 blocks of 1 KiB, the largest odd (maxFs odd)


def posix_rank(g: int) -> bytes:
    """Rank g's POSIX file: variable 0 (int32) then variable 1 (bytes), POSIX_SIZES[g] bytes in all."""
    ints = (np.arange(200, dtype="<i4") * (g + 3) - 7).tobytes()
    rng = np.random.default_rng(1000 + g)
    return ints + rng.integers(0, 256, POSIX_SIZES[g] - len(ints), dtype=np.uint8).tobytes()


def ftiff_vars(g: int) -> dict[int, bytes]:
    """Rank g's FTI-FF variables: 0 int32, 1 float64, of sizes of its own."""
    return {0: (np.arange(150 + 61 * g, dtype="<i4") ^ (g * 0x01010101)).tobytes(),
            1: np.linspace(-1.0, 1.0 + g, 37 + 29 * g, dtype="<f8").tobytes()}


def ftiff_rank(g: int, max_fs: int) -> bytes:
    variables = ftiff_vars(g)
    blocks = [[(0, 1, 0, len(variables[0])), (1, 1, 0, len(variables[1]))]]
    return fti_tail_file(variables, blocks, max_fs=max_fs)


def main() -> None:
    for g in range(4):
        (HERE / "posix").mkdir(exist_ok=True)
        (HERE / "posix" / f"Ckpt1-Rank{g}.fti").write_bytes(posix_rank(g))
    sizes = [len(ftiff_rank(g, 0)) for g in range(4)]
    max_fs = max(sizes) + 8  # FTI-FF: the group's largest file plus sizeof(off_t)
    for g in range(4):
        (HERE / "ftiff").mkdir(exist_ok=True)
        (HERE / "ftiff" / f"Ckpt1-Rank{g}.fti").write_bytes(ftiff_rank(g, max_fs))
    print("posix maxFs", max(POSIX_SIZES), "ftiff sizes", sizes, "maxFs", max_fs)


if __name__ == "__main__":
    main()
