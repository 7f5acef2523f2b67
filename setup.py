"""Build the optional native helpers (block hashing, GF(2^8) erasure coding, early write-back,
copy-on-write memory snapshots); everything else is declared in pyproject.toml.

``optional=True``: without a C compiler the build goes on and ftidask hashes blocks through the
xxhash binding instead (same digests, slower; see ftidask/ftiff/blockhash.py) and erasure codes
with NumPy (same bytes, slower; see ftidask/levels/erasure.py). No -m flags: the GF(2^8) kernels
pick their instruction set at run time (ftidask/csrc/gf256.c), so the build runs on any CPU.
"""

import platform

from setuptools import Extension, setup

_X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}
_XXH = "ftidask/csrc/xxhash"

setup(
    ext_modules=[
        Extension(
            "ftidask._native",
            sources=["ftidask/csrc/native.c", "ftidask/csrc/native_pages.c", "ftidask/csrc/native_gf.c",
                     "ftidask/csrc/gf256.c", "ftidask/csrc/cow.c", "ftidask/csrc/cow_layout.c", "ftidask/csrc/cow_uffd.c",
                     "ftidask/csrc/cow_pages.c", "ftidask/csrc/cow_fault.c", "ftidask/csrc/cow_events.c",
                     "ftidask/csrc/cow_copyout.c", "ftidask/csrc/cow_py.c"]
                    + ([f"{_XXH}/xxh_x86dispatch.c"] if _X86 else []),
            include_dirs=[_XXH],
            depends=["ftidask/csrc/native.h", "ftidask/csrc/gf256.h", "ftidask/csrc/cow.h", "ftidask/csrc/cow_impl.h"],
            define_macros=[("FTIDASK_XXH_DISPATCH", "1")] if _X86 else [],
            extra_compile_args=["-O3"] if platform.system() != "Windows" else [],
            optional=True,
        )
    ]
)
