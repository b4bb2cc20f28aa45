"""Benchmark of the trajectory processor (tidal.tree): prints JSON.

Writes one 500-call episode (main agent with parallel tool calls, subagent sessions and
compaction; `tests.tree.synth.write_long_session`) into a real SQLite ledger at 250K,
500K and 1M stored tokens (writing is not timed), then times reading the ledger plus
processing it into TrainTrees (`process_store`, defaults and compaction samples on).

Time: the fastest of `--repeats` (9) runs (the machine is shared, so the minimum is the
least noisy estimate; the median is printed too), with the ledger read time apart.
Memory: the peak of Python + numpy allocations during one read-and-process run,
measured with tracemalloc (run apart from the timed runs, since tracing slows them).
Targets at 1M tokens: < 1 s and < 200 MB.

Usage: python bench/tree.py [--repeats 9] [--tokens 250000,500000,1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.tree.synth: the synthetic sessions of the tests

from tests.tree.synth import LongSessionSpec, SynthWriter, write_long_session  # noqa: E402

from tidal.ledger.store import LedgerStore  # noqa: E402
from tidal.tree.episode import load_sessions  # noqa: E402
from tidal.tree.process import process_sessions, process_store  # noqa: E402


def measure(path: Path, repeats: int, compaction_samples: bool) -> dict[str, float | int]:
    times, reads = [], []
    result = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        store = LedgerStore(path, readonly=True)
        sessions = load_sessions(store)
        t1 = time.perf_counter()
        result = process_sessions(sessions, compaction_samples=compaction_samples)
        times.append(time.perf_counter() - t0)
        reads.append(t1 - t0)
        store.close()
    tracemalloc.start()
    store = LedgerStore(path, readonly=True)
    process_store(store, compaction_samples=compaction_samples)
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    store.close()
    assert result is not None
    ep = result.episodes[0]
    return {
        "seconds": round(min(times), 4),
        "seconds_median": round(statistics.median(times), 4),
        "read_seconds": round(min(reads), 4),
        "peak_mb_tracemalloc": round(peak / 2**20, 1),
        "calls": ep.calls,
        "sessions": ep.sessions,
        "unique_tokens": ep.unique_tokens,
        "path_tokens": ep.path_tokens,
        "nodes": ep.nodes,
        "sampled_paths": ep.sampled_paths,
        "trained_tokens": sum(t.unique_tokens for t in result.trees),
        "edges": ep.edges,  # type: ignore[dict-item]
    }


def _fit(x: list[float], t: list[float]) -> dict[str, float]:
    """Least-squares t = a + b * x (x in millions of tokens): a is the fixed cost (SQLite
    open, per-session work), b the marginal cost per million tokens."""
    mx, mt = sum(x) / len(x), sum(t) / len(t)
    b = sum((xi - mx) * (ti - mt) for xi, ti in zip(x, t, strict=True)) / sum(
        (xi - mx) ** 2 for xi in x
    )
    a = mt - b * mx
    res = max(abs(ti - (a + b * xi)) for xi, ti in zip(x, t, strict=True))
    return {"intercept_seconds": round(a, 4), "seconds_per_million_tokens": round(b, 4),
            "max_abs_residual_seconds": round(res, 4)}


def series(
    d: Path, name: str, points: list[tuple[int, int]], repeats: int
) -> dict[str, object]:
    """Measure each (calls, tokens) point; fit time against tokens."""
    runs: dict[str, dict[str, object]] = {}
    for n_calls, n_tok in points:
        path = d / f"{name}-{n_calls}-{n_tok}.db"
        t0 = time.perf_counter()
        with LedgerStore(path) as store:
            write_long_session(
                SynthWriter(store, seed=n_tok + n_calls), "bench",
                LongSessionSpec(n_calls=n_calls, tokens=n_tok),
            )
        runs[str(n_tok)] = {
            "write_seconds_untimed": round(time.perf_counter() - t0, 2),
            "default": measure(path, repeats, compaction_samples=False),
            "compaction_samples": measure(path, repeats, compaction_samples=True),
        }
    x = [n / 1e6 for _c, n in points]
    t = [float(r["default"]["seconds"]) for r in runs.values()]  # type: ignore[index]
    return {"runs": runs, "linear_fit": _fit(x, t) if len(x) > 1 else {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", default="250000,500000,1000000")
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",")]
    out: dict[str, object] = {"n_calls": args.calls, "memory": "tracemalloc peak"}
    with tempfile.TemporaryDirectory() as d:
        # 500 calls, more tokens per call (the series).
        fixed = series(Path(d), "fixed", [(args.calls, n) for n in sizes], args.repeats)
        # The same token counts reached by more calls of the same size.
        per_call = sizes[-1] // args.calls
        growing = series(Path(d), "growing", [(max(1, n // per_call), n) for n in sizes],
                         args.repeats)
    out["fixed_calls"] = fixed
    out["calls_grow_with_tokens"] = growing
    top = fixed["runs"][str(sizes[-1])]["default"]  # type: ignore[index]
    out["targets_at_largest"] = {
        "tokens": sizes[-1],
        "seconds": top["seconds"],
        "peak_mb_tracemalloc": top["peak_mb_tracemalloc"],
        "under_1s": top["seconds"] < 1.0,
        "under_200mb": top["peak_mb_tracemalloc"] < 200,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
