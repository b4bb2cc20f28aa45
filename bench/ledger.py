"""Ledger benchmark: one synthetic 500-call agent session growing to 1M tokens.

Measures write time (500 appends, each handing the store the full prompt), read-back
time (load the session, materialise the final context), bytes on disk per unique token
and the read-back memory against the raw size of the stored arrays. Prints JSON.

Targets (issue 2): write < 2 s, read < 2 s, <= 16 bytes/unique token, read memory < 3x raw.

Then the same session with its requests (`Call.messages`, as the gateway records them:
each request the last one plus the assistant's turn and a tool result, ~4 characters a
token): what the messages add on disk against their text (linear: about 1x, where
storing every request whole would be ~n/2 = 250x), and the write and read times of the
session and of every call's request rebuilt (`with_messages`).
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


def synthetic_session(n_calls: int, total_tokens: int, seed: int = 0, *,
                      messages: bool = False) -> list[Call]:
    """Calls whose prompts are views of one growing buffer (as an agent's context grows);
    with `messages`, each carries its request, growing by two messages a call."""
    rng = np.random.default_rng(seed)
    history: list[dict[str, object]] = [{"role": "system", "content": "You are an agent."}]
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
            messages=list(history) if messages else None,
        ))
        if messages:
            history += [{"role": "assistant", "content": _text(rng, 4 * out_len)},
                        {"role": "tool", "tool_call_id": f"t{i}",
                         "content": _text(rng, 4 * tool_len)}]
        n += out_len + tool_len
    return calls


def _text(rng: np.random.Generator, n: int) -> str:
    return rng.integers(97, 123, n, dtype=np.uint8).tobytes().decode()


def _write(path: Path, calls: list[Call]) -> tuple[float, dict[str, int]]:
    """Append `calls` one by one to a new store at `path`: seconds taken, its stats."""
    with LedgerStore(path) as store:
        t0 = time.perf_counter()
        for c in calls:
            store.append_call(c)
        return time.perf_counter() - t0, store.stats()


def with_messages(n_calls: int, total_tokens: int, plain_bytes: int) -> dict[str, object]:
    calls = synthetic_session(n_calls, total_tokens, messages=True)
    last = calls[-1].messages or []
    text = sum(len(str(m["content"])) for m in last)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.db"
        write_s, stats = _write(path, calls)
        size = stats["bytes"]
        with LedgerStore(path, readonly=True) as store:
            t0 = time.perf_counter()
            log = store.call_log("bench")
            rebuilt = [log.request(c.call_id) for c in calls]
            read_s = time.perf_counter() - t0
    exact = all(r is not None and r[0] == c.messages for r, c in zip(rebuilt, calls,
                                                                       strict=True))
    extra = size - plain_bytes
    return {"message_text_bytes": text, "bytes_on_disk": size,
            "extra_bytes_per_text_byte": round(extra / text, 2),
            "whole_requests_would_be_text_x": round(
                sum(len(c.messages or ()) for c in calls) / len(last), 1),
            "write_s": round(write_s, 3), "read_all_requests_s": round(read_s, 3),
            "exact": exact, "ok": exact and extra < 2 * text}


def run(n_calls: int, total_tokens: int) -> dict[str, float | int | bool]:
    calls = synthetic_session(n_calls, total_tokens)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.db"
        write_s, stats = _write(path, calls)
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
    plain = run(a.calls, a.tokens)
    msgs = with_messages(a.calls, a.tokens, int(plain["bytes_on_disk"]))
    print(json.dumps({**plain, "with_messages": msgs}))


if __name__ == "__main__":
    main()
