"""`release_free_heap`: freed tensors that glibc kept resident go back to the system."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tidal.train.heap import _malloc_trim, release_free_heap


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None,
                    reason="glibc's malloc_trim is Linux-only")
def test_freed_activations_leave_the_process() -> None:
    """As in a training step: a large block freed raises glibc's mmap threshold, so the
    next blocks come from the heap; one of them still live pins the rest when they are
    freed. release_free_heap gives them back."""
    big = torch.ones(24 << 18)  # a 24 MB block, mapped and freed: the threshold rises
    del big
    blocks = [torch.ones(1 << 18) for _ in range(400)]  # 400 x 1 MB from the heap
    pin = blocks.pop()  # the last one stays live
    del blocks
    held = _rss_mb()
    assert release_free_heap()
    assert _rss_mb() < held - 200, "the freed 1 MB blocks stayed resident"
    assert pin.sum() == 1 << 18
