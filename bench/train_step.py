"""One RL training step of `make run-real`'s shapes: `TreeTrainer.step` on SmolLM2-135M.

A step's trained batch in `make run-real` is ~4-5 GRPO groups of 8 sessions (the
groups with signal) of ~6,000 unique tokens: each group a tree, its prompt shared, each
session a few turns of model tokens and tool output. This builds such trees (random
token ids, rollout log-probabilities the model's own plus noise, advantages +-1) and
times `TreeTrainer.step` with AdamW, as `tidal run`'s trainer runs it.

`--matmul-dtype` is `train.matmul_dtype` (the linear layers in bf16: tidal.train.precision);
given several (`--matmul-dtype float32 bfloat16`), each runs in a process of its own,
alternating as `--compare` does, and the JSON gives each dtype's figures, the fp32/bf16
ratios and how far the recomputed log-probabilities of each lie from fp32's.

`--compare OLD_SRC` times the trainer at OLD_SRC (a worktree of an older commit:
`git worktree add /tmp/old 3c7c861`, then `--compare /tmp/old/src`) against this one,
each in a process of its own, alternating old, new, old, new, ... `--rounds` times, so
load on a shared machine hits both alike; each process warms up with one step, then
times `--steps` steps. Prints one JSON object: seconds per step (min and median) for
each tree and old/new.

    .venv/bin/python bench/train_step.py [--groups 4] [--compare /tmp/old/src]
    .venv/bin/python bench/train_step.py --matmul-dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

SRC = Path(__file__).resolve().parents[1] / "src"


def group_tree(rng: np.random.Generator, name: str, args: argparse.Namespace) -> Any:
    """A GRPO group as one tree: the shared prompt, then each session's turns."""
    from tidal.tree.types import Branch, Segment, TrainTree

    segs: list[Segment] = []

    def seg(parent: int, n: int, model: bool) -> int:
        segs.append(Segment(parent=parent, token_ids=rng.integers(0, 49152, n).astype(np.int32),
                            model_mask=np.full(n, model), logprobs=np.zeros(n, np.float32),
                            policy_versions=np.zeros(n, np.int32)))
        return len(segs) - 1

    root = seg(-1, args.prompt, False)
    branches = []
    for i in range(args.group):
        node = root
        for turn in range(args.turns):
            node = seg(node, args.reply, True)
            if turn < args.turns - 1:
                node = seg(node, args.tool, False)
        branches.append(Branch(leaf=node, advantage=1.0 if i % 2 else -1.0, coef=1.0,
                               norm_group=name))
    return TrainTree(name, tuple(segs), tuple(branches))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """This process's tree: warm up, then time `--steps` steps."""
    from tidal.engine.model import load_policy_model
    from tidal.engine.tiny import resolve_model
    from tidal.train.loss import LossConfig
    from tidal.train.packing import pack_trees
    from tidal.train.trainer import TargetLM, TreeTrainer, recompute_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lm = load_policy_model(resolve_model(args.model))
    trees = [group_tree(rng, f"g{i}", args) for i in range(args.groups)]
    # rollout log-probabilities: the model's own plus noise (a realistic mismatch)
    model = TargetLM(lm)
    batch = pack_trees(trees, args.max_tokens)
    true = recompute_logprobs(model, batch)
    noisy = (true + 0.05 * torch.randn(true.shape)).numpy()
    arrays = batch.to_segment_arrays(noisy)
    trees = [replace(t, segments=tuple(replace(s, logprobs=a.astype(np.float32))
                                       for s, a in zip(t.segments, arr, strict=True)))
             for t, arr in zip(trees, arrays, strict=True)]
    dtype, matmuls = "float32", contextlib.nullcontext  # an older tree has no precision
    if args.matmul_dtype[0] != "float32":
        from tidal.train.precision import matmuls as in_dtype
        from tidal.train.precision import resolve_matmul_dtype

        resolved = resolve_matmul_dtype(args.matmul_dtype[0], torch.device("cpu"))
        dtype = str(resolved).removeprefix("torch.")
        matmuls = partial(in_dtype, resolved)
    with matmuls():
        own = recompute_logprobs(model, batch)
    trainer = TreeTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-9),
                          LossConfig(), max_tokens=args.max_tokens)
    with matmuls():
        m = trainer.step(trees)  # warm-up
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        with matmuls():
            trainer.step(trees)
        times.append(time.perf_counter() - t0)
    diff = (own - true).abs()
    return {"seconds": times, "tokens": m.tokens, "path_tokens": m.path_tokens,
            "streams": m.streams, "matmul_dtype": dtype,
            "logprob_vs_fp32_mean_abs": float(diff.mean()),
            "logprob_vs_fp32_max_abs": float(diff.max())}


def run_child(src: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = list(sys.argv[1:])
    for flag, n in (("--compare", 1), ("--matmul-dtype", len(args.matmul_dtype))):
        if flag in argv:
            i = argv.index(flag)
            del argv[i : i + 1 + n]
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, __file__, "--child", *argv, "--matmul-dtype", dtype],
                         env=env,
                         capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group", type=int, default=8, help="sessions a group")
    ap.add_argument("--prompt", type=int, default=300, help="shared prompt tokens")
    ap.add_argument("--turns", type=int, default=3, help="model turns a session")
    ap.add_argument("--reply", type=int, default=30, help="model tokens a turn")
    ap.add_argument("--tool", type=int, default=40, help="tool-output tokens between turns")
    ap.add_argument("--max-tokens", type=int, default=4096, help="rl.max_tokens_per_stream")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", metavar="OLD_SRC")
    ap.add_argument("--matmul-dtype", nargs="+", default=["float32"],
                    choices=("float32", "bfloat16", "auto"),
                    help="train.matmul_dtype; several: each in turn, alternating")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.compare and len(args.matmul_dtype) > 1:
        ap.error("--compare and several --matmul-dtype: one comparison at a time")
    trees = {"new": str(SRC)} if not args.compare else {
        "old": str(Path(args.compare).resolve()), "new": str(SRC)}
    variants = ({name: (src, args.matmul_dtype[0]) for name, src in trees.items()}
                if len(args.matmul_dtype) == 1 else
                {dtype: (str(SRC), dtype) for dtype in args.matmul_dtype})
    runs: dict[str, list[float]] = {k: [] for k in variants}
    last: dict[str, dict[str, Any]] = {}
    shape: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name, (src, dtype) in variants.items():
            r = last[name] = run_child(src, dtype, args)
            runs[name] += r["seconds"]
            shape = {k: r[k] for k in ("tokens", "path_tokens", "streams")}
    out: dict[str, Any] = {"model": args.model, **shape, "trees": trees}
    for name, t in runs.items():
        out[name] = {"min_s": min(t), "median_s": statistics.median(t), "seconds": t,
                     **{k: last[name][k] for k in ("matmul_dtype", "logprob_vs_fp32_mean_abs",
                                                    "logprob_vs_fp32_max_abs")}}
    pairs = [("old", "new")] if args.compare else [
        ("float32", d) for d in args.matmul_dtype if d != "float32" and "float32" in runs]
    for a, b in pairs:
        key = "speedup" if args.compare else f"speedup_{b}"
        out[f"{key}_min"] = out[a]["min_s"] / out[b]["min_s"]
        out[f"{key}_median"] = out[a]["median_s"] / out[b]["median_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
