"""The fuzz suite, long: the three doors where outside data enters, N cases per test.

CI runs the same tests with a small budget (`pytest tests -k fuzz`, ~40 cases each).
This runs them with `TIDAL_FUZZ_EXAMPLES=N` (and a fresh random seed unless `--seed`),
collects how many cases each test really tried (`tests/fuzzing.py`), and prints JSON:
per door (jsonl import lines, gateway request bodies, config files) the cases tried, the
seconds taken and whether every property held (no traceback, no 5xx, no changed store
after a refusal, the server still serving).

    .venv/bin/python bench/fuzz.py [--examples 1000] [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {
    "jsonl": "tests/ledger/test_fuzz.py",
    "gateway": "tests/gateway/test_fuzz.py",
    "config": "tests/run/test_fuzz_config.py",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="cases per fuzz test")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--doors", nargs="+", default=list(SUITES), choices=list(SUITES))
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    out: dict[str, object] = {"examples_per_test": args.examples, "seed": seed}
    ok = True
    for door in args.doors:
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            counts = Path(f.name)
        env = dict(os.environ, TIDAL_FUZZ_EXAMPLES=str(args.examples),
                   TIDAL_FUZZ_SEED=str(seed), TIDAL_FUZZ_COUNTS=str(counts))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SUITES[door]],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False,
        )
        rows = [json.loads(x) for x in counts.read_text().splitlines() if x]
        counts.unlink()
        passed = proc.returncode == 0
        ok &= passed
        out[door] = {
            "cases": sum(r["cases"] for r in rows),
            "per_test": {r["test"]: r["cases"] for r in rows},
            "seconds": round(time.perf_counter() - t0, 1),
            "passed": passed,
            **({} if passed else {"tail": proc.stdout[-3000:]}),
        }
    out["cases_total"] = sum(v["cases"] for k, v in out.items()  # type: ignore[union-attr]
                             if k in SUITES)
    print(json.dumps(out, indent=None if args.json else 1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
