"""Ledger benchmark: one synthetic 500-call agent session growing to 1M tokens.

Measures write time (500 appends, each handing the store the full prompt), read-back
time (load the session, materialise the final context), bytes on disk per unique token
and the read-back memory against the raw size of the stored arrays. Prints JSON.

Targets (issue 2): write < 2 s, read < 2 s, <= 16 bytes/unique token, read memory < 3x raw.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from tidal.ledger import Call, LedgerStore


def synthetic_session(n_calls: int, total_tokens: int, seed: int = 0) -> list[Call]:
    """Calls whose prompts are views of one growing buffer (as an agent's context grows)."""
    rng = np.random.default_rng(seed)
    per_call = total_tokens // n_calls
    out_len, tool_len = per_call // 2, per_call - per_call // 2
    buf = rng.integers(0, 151_000, total_tokens + per_call, dtype=np.int32)
    calls, n = [], tool_len  # the first prompt: system + task
    for i in range(n_calls):
        calls.append(Call(
            session_id="bench", call_id=f"c{i}", role="main", prompt_ids=buf[:n],
            output_ids=buf[n:n + out_len],
            output_logprobs=-rng.random(out_len, dtype=np.float32),
            output_text="", policy_version=0, finish_reason="tool_calls",
            started_at=float(i), ended_at=float(i) + 1.0,
        ))
        n += out_len + tool_len
    return calls


def run(n_calls: int, total_tokens: int) -> dict[str, float | int | bool]:
    calls = synthetic_session(n_calls, total_tokens)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.db"
        with LedgerStore(path) as store:
            t0 = time.perf_counter()
            for c in calls:
                store.append_call(c)
            write_s = time.perf_counter() - t0
            stats = store.stats()
        with LedgerStore(path, readonly=True) as store:
            tracemalloc.start()
            t0 = time.perf_counter()
            log = store.call_log("bench")
            last = log.context_ids(calls[-1].call_id)
            read_s = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            raw = sum(
                sc.prompt.suffix_ids.nbytes + sc.call.output_ids.nbytes
                + sc.call.output_logprobs.nbytes for sc in log.calls
            )
            want = np.concatenate([calls[-1].prompt_ids, calls[-1].output_ids])
            exact = bool(np.array_equal(last, want))
    unique = stats["unique_tokens"]
    return {
        "calls": n_calls,
        "unique_tokens": unique,
        "prompt_tokens_total": stats["prompt_tokens_total"],
        "write_s": round(write_s, 3),
        "read_s": round(read_s, 3),
        "bytes_on_disk": stats["bytes"],
        "bytes_per_unique_token": round(stats["bytes"] / unique, 2),
        "read_peak_mb": round(peak / 2**20, 1),
        "raw_array_mb": round(raw / 2**20, 1),
        "read_memory_ratio": round(peak / raw, 2),
        "exact": exact,
        "ok": write_s < 2 and read_s < 2 and stats["bytes"] / unique <= 16 and peak < 3 * raw
        and exact,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--json", action="store_true", help="(default) print JSON")
    a = p.parse_args()
    print(json.dumps(run(a.calls, a.tokens)))


if __name__ == "__main__":
    main()
