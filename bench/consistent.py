"""Consistent numerics (`tidal.engine.consistent`): the mismatch it removes and its cost.

For each mode (`standard`: the engine's transformers forward and the trainer's tree
attention; `consistent`: one batch-invariant forward on both sides), the tiny model
rolls out groups of agent-shaped sessions on the embedded engine: `--tasks` tasks x
`--group` sessions, all at once (the engine batches them), each a shared ~`--prompt`
token prompt then `--turns` calls that append the answer and a tool result. Then one
`TreeTrainer.step` on their trees (merged, packed) from the same weights.

Prints JSON per mode: rollout wall time and sampled tokens/s; the trainer's recompute
mismatch (`max_abs_logprob_diff`, `mean_abs_logprob_diff`, `token_kl`, the fraction
of importance weights clipped); the step's seconds; and the cost ratios.

    .venv/bin/python bench/consistent.py [--tasks 4] [--group 4] [--turns 4]
                                         [--max-tokens 48] [--prompt 300] [--threads 2]
                                         [--prefix-cache-mb 256]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rollout(
    engine: Any, prompt: list[int], turns: int, max_tokens: int, seed: int
) -> list[tuple[list[int], Any]]:
    """One session: (prompt ids, generation) per call; each call extends the last."""
    from tidal.engine.base import SamplingParams

    rng = np.random.default_rng(seed)
    ctx, calls = list(prompt), []
    for _ in range(turns):
        gen = engine.generate([ctx], SamplingParams(max_tokens=max_tokens))[0]
        calls.append((list(ctx), gen))
        ctx += gen.output_ids.tolist() + rng.integers(0, 5000, size=20).tolist()
    return calls


def session_tree(name: str, calls: list[tuple[list[int], Any]], group: str, adv: float) -> Any:
    """A session's calls as one path: prompt pieces (not trained), outputs (trained)."""
    from tidal.tree.types import Branch, Segment, TrainTree

    segs: list[Segment] = []
    done = 0
    for prompt, gen in calls:
        for piece, lp in ((prompt[done:], None), (gen.output_ids, gen.logprobs)):
            ids = np.asarray(piece, dtype=np.int32)
            if ids.size == 0:
                continue
            model = lp is not None
            segs.append(Segment(
                len(segs) - 1, ids, np.full(ids.size, model),
                np.asarray(lp, np.float32) if model else np.zeros(ids.size, np.float32),
                np.full(ids.size, 0 if model else -1, np.int32),
            ))
        done = len(prompt) + int(gen.output_ids.shape[0])
    return TrainTree(name, tuple(segs), (Branch(len(segs) - 1, adv, 1.0, group),))


def measure(numerics: str, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from tidal.engine.base import SamplingParams
    from tidal.engine.embedded import EmbeddedEngine
    from tidal.engine.model import load_policy_model
    from tidal.train import LossConfig, TreeTrainer

    prompts = [np.random.default_rng(100 + t).integers(0, 5000, size=args.prompt).tolist()
               for t in range(args.tasks)]
    sessions: dict[tuple[int, int], list[tuple[list[int], Any]]] = {}
    with EmbeddedEngine(model_dir, numerics=numerics, seed=0,
                        prefix_cache_mb=args.prefix_cache_mb) as eng:
        eng.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up

        def run(t: int, g: int) -> None:
            sessions[t, g] = rollout(eng, prompts[t], args.turns, args.max_tokens, 10 * t + g)

        threads = [threading.Thread(target=run, args=(t, g))
                   for t in range(args.tasks) for g in range(args.group)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        rollout_s = time.perf_counter() - t0
    sampled = sum(int(gen.output_ids.shape[0]) for calls in sessions.values()
                  for _, gen in calls)
    prompt_tokens = sum(len(p) for calls in sessions.values() for p, _ in calls)
    cached = sum(int(gen.extra["cached_tokens"]) for calls in sessions.values()
                 for _, gen in calls)
    trees = [session_tree(f"t{t}-{g}", calls, f"task{t}", 1.0 if g % 2 else -1.0)
             for (t, g), calls in sorted(sessions.items())]
    model = load_policy_model(model_dir)
    trainer = TreeTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), LossConfig(),
        attention="consistent" if numerics == "consistent" else "auto",
    )
    t0 = time.perf_counter()
    m = trainer.step(trees)
    step_s = time.perf_counter() - t0
    return {
        "rollout_s": round(rollout_s, 2),
        "sampled_tokens": sampled,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - cached,
        "sampled_tokens_per_s": round(sampled / rollout_s, 1),
        "train_step_s": round(step_s, 2),
        "train_tokens": m.tokens,
        "max_abs_logprob_diff": m.max_abs_logprob_diff,
        "mean_abs_logprob_diff": m.mean_abs_logprob_diff,
        "token_kl": m.token_kl,
        "is_clipped_fraction": m.is_clipped_fraction,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0,
                    help="the engine's prefix cache (0: off, every call prefills its prompt)")
    args = ap.parse_args()

    from tidal.engine.tiny import ensure_tiny

    torch.set_num_threads(args.threads)
    model_dir = ensure_tiny()
    out: dict[str, Any] = {"bench": "consistent_numerics", "config": vars(args)}
    for numerics in ("standard", "consistent"):
        out[numerics] = measure(numerics, args, model_dir)
    s, c = out["standard"], out["consistent"]
    out["rollout_cost"] = round(c["rollout_s"] / s["rollout_s"], 2)
    out["train_step_cost"] = round(c["train_step_s"] / s["train_step_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
