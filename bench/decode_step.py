"""What one decode step and the prefill cost the embedded engine's batch, for a real model.

`B` sequences of `T` random prompt tokens are prefilled (8 at a time, as the engine admits
arrivals) into one `DecodeBatch`; after 3 warm-up steps, 20 decode steps are timed. Prints
JSON: prefill tokens per second, milliseconds per decode step, decode tokens per second.
The decode step is where the KV cache's append shows: `DynamicLayer.update` copies the whole
cache every step (`torch.cat`), the batch's growing layer writes one column.

    .venv/bin/python bench/decode_step.py [--model smollm2-135m] [--batch 16] [--context 800]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tidal.engine.base import SamplingParams
from tidal.engine.batch import DecodeBatch, SequenceRequest
from tidal.engine.model import load_policy_model
from tidal.engine.tiny import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_policy_model(resolve_model(args.model))
    gen = torch.Generator().manual_seed(0)
    requests = [SequenceRequest(tuple(torch.randint(1000, 9000, (args.context,),
                                                    generator=gen).tolist()),
                                SamplingParams(max_tokens=args.steps + 10), seed=i)
                for i in range(args.batch)]
    batch = DecodeBatch(model, max_context=args.context + args.steps + 20, pad_id=0)
    t0 = time.perf_counter()
    for i in range(0, args.batch, 8):
        batch.admit(requests[i : i + 8], list(range(i, min(i + 8, args.batch))))
    t1 = time.perf_counter()
    for _ in range(3):
        batch.step()
    t2 = time.perf_counter()
    for _ in range(args.steps):
        batch.step()
    t3 = time.perf_counter()
    print(json.dumps({
        "model": args.model, "batch": args.batch, "context": args.context,
        "threads": args.threads,
        "prefill_tokens_per_s": round(args.batch * args.context / (t1 - t0), 1),
        "decode_step_ms": round((t3 - t2) / args.steps * 1000, 1),
        "decode_tokens_per_s": round(args.batch * args.steps / (t3 - t2), 1),
    }))


if __name__ == "__main__":
    main()
