"""The one-pass word sums of wordsum.c, built once per node and loaded in each rank.

`watcher run` builds the library before it starts the job (`build`, cached
by the source's hash) and tells the ranks where it is (WATCHER_WORDSUM);
a rank without it, or on a machine without a C compiler, sums with torch
and gets the same values.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from . import native

SOURCE = Path(__file__).with_name("wordsum.c")
ENV = "WATCHER_WORDSUM"
# Plain -O3, no -march=native: the cache may be a home directory shared by
# nodes of different CPUs, and a rank must never die of an illegal
# instruction (the sums are memory-bound anyway).  No contraction of a
# multiply and an add into one FMA: the sum of squares must have the same
# bits from the vector loop as from the scalar one, whatever the compiler
# and its default target.
FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]


def build(cache_dir: Path) -> Path | None:
    """Compile wordsum.c into `cache_dir` (once per source); None if it cannot be built."""
    return native.build(SOURCE, FLAGS, cache_dir)


def load(path: str | None):
    """The library at `path` with its signatures set, or None."""
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    u32, size, u64p = ctypes.c_uint32, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)
    lib.ws_sum.argtypes, lib.ws_sum.restype = [ctypes.c_void_p, size], u32
    lib.ws_copy_sum.argtypes, lib.ws_copy_sum.restype = [ctypes.c_void_p, ctypes.c_void_p, size], u32
    lib.ws_sum_many.argtypes, lib.ws_sum_many.restype = [u64p, u64p, size], u32
    lib.ws_sumsq_f32_many.argtypes, lib.ws_sumsq_f32_many.restype = [u64p, u64p, size], ctypes.c_double
    lib.ws_sum_sumsq_f32.argtypes = [ctypes.c_void_p, size, ctypes.POINTER(ctypes.c_double)]
    lib.ws_sum_sumsq_f32.restype = u32
    lib.ws_gather.argtypes, lib.ws_gather.restype = [ctypes.c_void_p, u64p, u64p, size], None
    return lib


LIB = load(os.environ.get(ENV))
