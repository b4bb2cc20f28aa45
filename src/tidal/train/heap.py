"""Give the C heap's free pages back to the system after a training step.

torch allocates a CPU tensor with the C library's malloc. glibc serves blocks below its
mmap threshold from the heap, and raises that threshold (up to 32 MB) each time a larger
mapped block is freed, so a training step's activations come from the heap and stay
resident after they are freed: glibc returns a heap's memory only from its top, and one
live block above the freed ones pins them all. Over a `make run-real` run the process
grew to 20 GB of which ~10 GB was such free memory (measured: `malloc_trim(0)` took a
run's RSS from 16.0 to 5.6 GB between two steps). `release_free_heap` hands those pages
back (glibc's `malloc_trim(0)` releases free pages anywhere in every arena, not only at
the top); the next step faults in what it uses again, a fraction of a second against a
step of tens of seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; True if any were returned, False
    where nothing was free or the C library cannot (it is then a no-op)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
