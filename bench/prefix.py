"""The embedded engine's prefix cache (`tidal.engine.prefix`): what long sessions cost.

`--sessions` agent-shaped sessions run at once on the tiny model (the engine batches
them): a `--prompt`-token prompt, then `--calls` calls of exactly `--max-tokens` sampled
tokens, each followed by a `--tool`-token tool result appended to the history. With the
cache off every call prefills its whole history, so a session's prefill work grows with
the square of its calls; with it on, a call prefills only the tokens added since the
last one. Run for each session length in `--calls`, cache off and on, per numerics mode.

Prints JSON per run: wall seconds, prompt tokens sent, prompt tokens computed (the rest
read from the cache), the mean seconds per call over the first and the last quarter of
each session's calls (flat when cost follows unique tokens), and speed-ups.

    .venv/bin/python bench/prefix.py [--sessions 8] [--calls 4 16 32] [--prompt 300]
                                     [--max-tokens 48] [--tool 40]
                                     [--numerics standard consistent] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np
import torch


def session(engine: Any, prompt: list[int], calls: int, max_tokens: int, *, tool: int,
            seed: int) -> tuple[list[float], int, int]:
    """One session; returns (seconds per call, prompt tokens sent, tokens read from cache)."""
    from tidal.engine.base import SamplingParams

    rng = np.random.default_rng(seed)
    ctx, times, sent, cached = list(prompt), [], 0, 0
    for k in range(calls):
        t0 = time.perf_counter()
        gen = engine.generate([ctx], SamplingParams(max_tokens=max_tokens, seed=seed * 1000 + k))[0]
        times.append(time.perf_counter() - t0)
        sent += len(ctx)
        cached += int(gen.extra["cached_tokens"])
        ctx += gen.output_ids.tolist() + rng.integers(1000, 9000, size=tool).tolist()
    return times, sent, cached


def run(model_dir: Any, numerics: str, cache_mb: float, args: argparse.Namespace,
        calls: int) -> dict[str, Any]:
    from tidal.engine.embedded import EmbeddedEngine

    results: list[tuple[list[float], int, int]] = [([], 0, 0)] * args.sessions
    with EmbeddedEngine(model_dir, numerics=numerics, prefix_cache_mb=cache_mb, seed=0,
                        max_batch_size=args.sessions) as eng:
        def one(i: int) -> None:
            prompt = np.random.default_rng(i).integers(1000, 9000, size=args.prompt).tolist()
            results[i] = session(eng, prompt, calls, args.max_tokens, tool=args.tool, seed=i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    q = max(1, calls // 4)
    first = [s for times, _, _ in results for s in times[:q]]
    last = [s for times, _, _ in results for s in times[-q:]]
    sent = sum(r[1] for r in results)
    cached = sum(r[2] for r in results)
    return {
        "numerics": numerics,
        "prefix_cache": cache_mb > 0,
        "calls_per_session": calls,
        "wall_s": round(wall, 2),
        "prompt_tokens": sent,
        "prompt_tokens_computed": sent - cached,
        "final_context": args.prompt + calls * (args.max_tokens + args.tool) - args.tool,
        "s_per_call_first_quarter": round(float(np.mean(first)), 3),
        "s_per_call_last_quarter": round(float(np.mean(last)), 3),
    }


def main() -> None:
    from tidal.engine.tiny import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--calls", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tool", type=int, default=40)
    ap.add_argument("--numerics", nargs="+", default=["standard", "consistent"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("tiny")
    runs = []
    for numerics in args.numerics:
        for calls in args.calls:
            off = run(model_dir, numerics, 0.0, args, calls)
            on = run(model_dir, numerics, 256.0, args, calls)
            on["speedup"] = round(off["wall_s"] / on["wall_s"], 2)
            runs += [off, on]
    print(json.dumps({"bench": "prefix", "sessions": args.sessions, "prompt": args.prompt,
                      "max_tokens": args.max_tokens, "tool": args.tool,
                      "threads": args.threads, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
