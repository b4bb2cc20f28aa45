"""The suite runs on pytest-xdist workers (`make test`: `-n auto --dist loadfile`), each
given an equal share of the cores: torch's intra-op threads, and those of every process
a test starts (OMP_NUM_THREADS is inherited), so workers never oversubscribe them.
Without xdist (`pytest tests/...`), the threads are left alone.

Every CLI's rich error box is drawn 1000 columns wide (COLUMNS, in this process and the
ones it starts), so a long tmp_path (xdist's `popen-gw0/...`) is never broken inside a
word where a test looks for it.

The files holding `slow` or `vllm` tests are collected first, most such tests first
(`make test` passes `--no-loadscope-reorder`, else xdist would queue files by their
number of tests, and the one-test end-to-end files, minutes each, would start last and
finish alone on one worker while the other idles). `--dist loadfile` hands the workers
files in that order, so the short files fill in around the long ones."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("COLUMNS", "1000")
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    _share = str(max(1, (os.cpu_count() or 1) // _workers))
    os.environ["OMP_NUM_THREADS"] = _share
    os.environ["MKL_NUM_THREADS"] = _share
    import torch

    torch.set_num_threads(int(_share))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy: Counter[Path] = Counter(
        item.path for item in items
        if item.get_closest_marker("slow") or item.get_closest_marker("vllm"))
    items.sort(key=lambda item: -heavy[item.path])  # stable: a file's tests stay in order
