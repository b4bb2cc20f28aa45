"""What the embedded engine generates a second under sessions shaped like shell-skills'
rollouts, rather than one full batch decoding (bench/decode_step.py).

`--sessions` sessions, `--concurrent` at a time (threads, as the harness runs them), each
`--calls` calls: a shared system prompt of `--system` tokens plus `--task` of its own,
then each call's output and `--turn` new tokens (a tool result) appended, so the prefix
cache serves every history and each call prefills only what is new; `--stagger` spreads
the sessions' starts, so that calls arrive one by one as in a run rather than in lockstep.
Random token ids, so outputs run to `--max-tokens`. Prints JSON: generated tokens,
seconds, tokens a second, and the engine's own counters (`EmbeddedEngine.metrics`:
prompt tokens and those the prefix cache served, prefills and decode steps with their
seconds, the mean live batch). `--concurrent` is also the engine's `max_batch_size`.

    .venv/bin/python bench/engine_sessions.py [--model smollm2-135m] [--sessions 16]
    PYTHONPATH=/tmp/old/src .venv/bin/python bench/engine_sessions.py ...  # another tree

Measured figures: docs/engine.md ("The fast batch"). The first, on an older machine and
engine: the defaults (shell-skills' shapes: prompts of 150-550 tokens, ~45 tokens a
call) gave 48.3 tokens a second in lockstep, 36.7 with `--stagger 1`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tidal.engine.base import SamplingParams
from tidal.engine.embedded import EmbeddedEngine
from tidal.engine.tiny import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--system", type=int, default=100)
    ap.add_argument("--task", type=int, default=50)
    ap.add_argument("--turn", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0,
                    help="the engine's prefix cache (a run's rollout.prefix_cache_mb)")
    ap.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the engine's matmul_dtype (a run's engine.matmul_dtype)")
    ap.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the engine's kv_dtype (a run's engine.kv_dtype)")
    ap.add_argument("--stagger", type=float, default=0.0,
                    help="seconds between sessions' starts (0: all at once)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = EmbeddedEngine(resolve_model(args.model), max_batch_size=args.concurrent, seed=0,
                         prefix_cache_mb=args.prefix_cache_mb, matmul_dtype=args.matmul_dtype,
                         kv_dtype=args.kv_dtype)
    rng = random.Random(0)
    system = [rng.randrange(1000, 9000) for _ in range(args.system)]

    def session(i: int) -> int:
        time.sleep(i * args.stagger)
        r = random.Random(i)
        prompt = system + [r.randrange(1000, 9000) for _ in range(args.task)]
        generated = 0
        for call in range(args.calls):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                    seed=i * 1000 + call)
            out = eng.generate([prompt], params)[0].output_ids.tolist()
            generated += len(out)
            prompt = prompt + out + [r.randrange(1000, 9000) for _ in range(args.turn)]
        return generated

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrent) as pool:
            tokens = sum(pool.map(session, range(args.sessions)))
        dt = time.perf_counter() - t0
        m = eng.metrics()
    finally:
        eng.close()
    print(json.dumps({"model": args.model, "sessions": args.sessions,
                      "concurrent": args.concurrent, "calls": args.calls,
                      "generated": tokens, "seconds": round(dt, 1),
                      "tokens_per_s": round(tokens / dt, 1),
                      "engine": {k: round(m[k], 2) for k in (
                          "prompt_tokens", "cached_tokens", "prefills", "prefill_s",
                          "decode_steps", "decode_s", "mean_batch")}}))


if __name__ == "__main__":
    main()
