"""Shared by the fuzz suites (`tests/*/test_fuzz*.py`): the budget, the seed, and where each
records how many cases it tried, so a bench-style run (`bench/fuzz.py`,
`TIDAL_FUZZ_EXAMPLES=5000`) can report them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("TIDAL_FUZZ_EXAMPLES", "40"))  # cases per test (CI: small)
SEED = os.environ.get("TIDAL_FUZZ_SEED")  # unset: derandomized, the same cases every run


def record_cases(door: str, test: str, cases: int) -> None:
    """Append `{"door", "test", "cases"}` as one JSON line to the file named by
    `TIDAL_FUZZ_COUNTS`, when it is set (nothing otherwise)."""
    path = os.environ.get("TIDAL_FUZZ_COUNTS")
    if not path:
        return
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"door": door, "test": test, "cases": cases}) + "\n")


def run_cases(door: str, name: str, case: Callable[[st.DataObject], None]) -> None:
    """Run `case` under the fuzz budget and record how many cases it tried."""
    tried = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example
        ],
    )
    @given(data=st.data())
    def body(data: st.DataObject) -> None:
        nonlocal tried
        tried += 1
        case(data)

    test = seed(int(SEED))(body) if SEED is not None else body
    try:
        test()
    finally:
        record_cases(door, name, tried)
