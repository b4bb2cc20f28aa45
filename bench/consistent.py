"""Consistent numerics (`tidal.engine.consistent`): the mismatch it removes and its cost.

For each mode (`standard`: the engine's transformers forward and the trainer's tree
attention; `consistent`: one batch-invariant forward on both sides), the tiny model
rolls out groups of agent-shaped sessions on the embedded engine: `--tasks` tasks x
`--group` sessions, all at once (the engine batches them), each a shared ~`--prompt`
token prompt then `--turns` calls that append the answer and a tool result. Then one
`TreeTrainer.step` on their trees (merged, packed) from the same weights.

Two models, measured side by side in one run: `tiny` (4 layers, hidden 128, its 151k
vocabulary dominating), with the workload below, and a randomly initialised model of
Qwen2.5-0.5B's shape (24 layers, hidden 896), on a smaller workload (2 tasks x 4
sessions x 2 calls of 32 tokens, 256-token prompts) so that it takes minutes on 2 cores.
Each mode runs `--repeats` times (the 0.5B-shaped model at most twice), the modes alternating so
that a shared machine's slow spells fall on both; times are medians.

Prints JSON per model and mode: rollout wall time and sampled tokens/s; the trainer's
recompute mismatch (`max_abs_logprob_diff`, `mean_abs_logprob_diff`, `token_kl`, the
fraction of importance weights clipped); the step's seconds; and the cost ratios
(`rollout_cost`, `train_step_cost`: consistent over standard).

    .venv/bin/python bench/consistent.py [--models tiny,qwen2.5-0.5b-shaped] [--repeats 3]
                                         [--tasks 4] [--group 4] [--turns 4]
                                         [--max-tokens 48] [--prompt 300] [--threads 2]
                                         [--prefix-cache-mb 256]

On a GPU (bench/gpu_check.sh): `--device cuda --dtype bfloat16` runs engine and trainer
there; `--keep-workload` gives the 0.5B-shaped model the workload of the flags instead
of the small CPU one; `--probe` first checks, on that device and dtype, which of the
forward's pieces give a row the same bits whatever else is in the batch (plain matmul,
`tiled_linear`, RMSNorm, log-softmax over the vocabulary, `block_attention`; the tile
and query-chunk sizes `tile_sizes`/`chunk_sizes` accept there), which says where a
non-zero KL would come from; `--out FILE` keeps what was measured after each model.
"""

from __future__ import annotations

import argparse
import json
import sys
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


MODELS = ("tiny", "qwen2.5-0.5b-shaped")
# Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads over 2 KV heads, MLP 4864, tied
# 151,936-token vocabulary), randomly initialised: what a real small policy costs.
QWEN05_SHAPE: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False,
    "initializer_range": 0.02,
}
# The 0.5B-shaped model's workload: the tiny one's shape, scaled to minutes on 2 cores.
QWEN05_WORKLOAD = {"tasks": 2, "group": 4, "turns": 2, "max_tokens": 32, "prompt": 256}


def model_dir(name: str) -> Path:
    """The model's checkpoint directory (the 0.5B-shaped one built once and cached)."""
    from tidal.engine.tiny import default_cache_root, ensure_tiny

    if name == "tiny":
        return ensure_tiny()
    out = default_cache_root() / "bench-qwen2.5-0.5b-shaped"
    if not (out / "config.json").exists():
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**QWEN05_SHAPE)).save_pretrained(out)
    return out


def rollout_all(numerics: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Every session of the workload at once on a fresh engine: its sessions and time."""
    from tidal.engine.base import SamplingParams
    from tidal.engine.embedded import EmbeddedEngine

    prompts = [np.random.default_rng(100 + t).integers(0, 5000, size=args.prompt).tolist()
               for t in range(args.tasks)]
    sessions: dict[tuple[int, int], list[tuple[list[int], Any]]] = {}
    with EmbeddedEngine(directory, numerics=numerics, seed=0, device=args.device,
                        dtype=args.dtype, prefix_cache_mb=args.prefix_cache_mb) as eng:
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
        return {"sessions": sessions, "seconds": time.perf_counter() - t0}


def train_once(numerics: str, sessions: dict[tuple[int, int], Any], directory: Path,
               args: argparse.Namespace) -> Any:
    """One `TreeTrainer.step` on the sessions' trees from the checkpoint's weights."""
    from tidal.engine.model import load_policy_model
    from tidal.train import LossConfig, TreeTrainer

    trees = [session_tree(f"t{t}-{g}", calls, f"task{t}", 1.0 if g % 2 else -1.0)
             for (t, g), calls in sorted(sessions.items())]
    model = load_policy_model(directory, device=args.device, dtype=args.dtype)
    trainer = TreeTrainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), LossConfig(),
        attention="consistent" if numerics == "consistent" else "auto",
    )
    _sync(args.device)
    t0 = time.perf_counter()
    m = trainer.step(trees)
    _sync(args.device)
    return m, time.perf_counter() - t0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def invariance_probe(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Which pieces of the forward give row i the same bits alone as among others, on
    this device and dtype (the model's own weights): row 0 of n rows against row 0 run
    alone (n = 1), and the first 3 rows against the same rows among 256."""
    from tidal.engine import consistent as c
    from tidal.engine.model import load_policy_model

    model = load_policy_model(directory, device=args.device, dtype=args.dtype)
    cm = c.ConsistentModel(model)
    dev, dtype = torch.device(args.device), model.dtype
    layer = cm.layers[0]
    w = layer.mlp.up_proj.weight
    gen = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    x = torch.randn(256, hidden, generator=gen).to(dev, dtype)
    head = model.get_output_embeddings().weight

    def same(fn: Any) -> dict[str, bool]:
        with torch.no_grad():
            full = fn(x)
            return {f"rows_{n}": bool(torch.equal(fn(x[:n]), full[:n])) for n in (1, 3, 16, 64)}

    out: dict[str, Any] = {
        "plain_matmul": same(lambda a: torch.nn.functional.linear(a, w)),
        "tiled_linear": same(lambda a: c.tiled_linear(a, w)),
        "rms_norm": same(lambda a: c.rms_norm(a, layer.input_layernorm.weight, cm.eps)),
        "vocab_log_softmax": same(
            lambda a: c.tiled_linear(a, head).float().log_softmax(-1)),
        "tile_sizes_up_proj": list(c.tile_sizes(w, None)),
        "tile_sizes_head": list(c.tile_sizes(head, None)),
        "chunk_sizes": list(c.chunk_sizes(cm.n_heads, cm.n_kv, cm.head_dim, dtype, dev)),
    }
    # attention: 3 queries over 300 keys, alone and among 64 others
    n_keys = 300
    width = n_keys + (-n_keys) % c.KEY_BLOCK
    q = torch.randn(67, cm.n_heads, cm.head_dim, generator=gen).to(dev, dtype)
    k, v = (torch.randn(n_keys, cm.n_kv, cm.head_dim, generator=gen).to(dev, dtype)
            for _ in range(2))
    keys = torch.arange(width, device=dev).clamp(max=n_keys - 1)[None].expand(67, -1)
    lens = torch.randint(1, n_keys + 1, (67,), generator=gen).to(dev)

    def attn(m: int) -> torch.Tensor:
        lists = c.KeyLists(keys[:m].contiguous(), torch.arange(m, device=dev), lens[:m])
        with torch.no_grad():
            return c.block_attention(q[:m], k, v, lists, cm.scale)

    full = attn(67)
    out["block_attention"] = {f"rows_{m}": bool(torch.equal(attn(m), full[:m]))
                              for m in (1, 3, 16, 64)}
    del model
    return out


def _keep_partial(args: argparse.Namespace, name: str, partial: dict[str, Any]) -> None:
    """What a model measured so far, in `--out` (replaced by the whole result at its end):
    a run killed mid-model keeps it."""
    if args.out is not None and not args.out.exists():
        args.out.with_suffix(".partial.json").write_text(
            json.dumps({"bench": "consistent_numerics", "partial": {name: partial}}, indent=1))


def measure_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both modes on one model, `--repeats` times each, the modes alternating (so slow
    spells of a shared machine fall on both); times are medians."""
    directory = model_dir(name)
    probe = invariance_probe(directory, args) if args.probe else None
    partial: dict[str, Any] = {"invariance_probe": probe}
    _keep_partial(args, name, partial)
    modes = ("standard", "consistent")
    rollouts: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    steps: dict[str, list[tuple[Any, float]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            rollouts[mode].append(rollout_all(mode, args, directory))
            partial.setdefault("rollout_s", {}).setdefault(mode, []).append(
                round(rollouts[mode][-1]["seconds"], 2))
            _keep_partial(args, name, partial)
    warmup: dict[str, float] = {}
    errors: dict[str, str] = {}

    def step(mode: str) -> Any:
        """One train step, or None (the error kept) when the mode's trainer fails."""
        if mode in errors:
            return None
        try:
            return train_once(mode, rollouts[mode][0]["sessions"], directory, args)
        except Exception as e:  # the other mode still measures
            errors[mode] = f"{type(e).__name__}: {e}"[:2000]
            return None

    if args.device != "cpu":  # a GPU's first step compiles (FlexAttention): not timed
        for mode in modes:
            first = step(mode)
            if first is not None:
                warmup[mode] = first[1]
    for _ in range(args.repeats):
        for mode in modes:
            got = step(mode)
            if got is not None:
                steps[mode].append(got)
                partial.setdefault("train", {}).setdefault(mode, []).append(
                    {"s": round(got[1], 2), "token_kl": got[0].token_kl,
                     "max_abs_logprob_diff": got[0].max_abs_logprob_diff})
                _keep_partial(args, name, partial)
    out: dict[str, Any] = {"workload": {k: getattr(args, k) for k in
                                        ("tasks", "group", "turns", "max_tokens", "prompt")},
                           "device": args.device, "dtype": args.dtype}
    if probe is not None:
        out["invariance_probe"] = probe
    if warmup:
        out["untimed_first_train_step_s"] = {m: round(t, 2) for m, t in warmup.items()}
    if errors:
        out["train_errors"] = errors
    for mode in modes:
        sessions = rollouts[mode][0]["sessions"]
        rollout_s = float(np.median([r["seconds"] for r in rollouts[mode]]))
        step_s = float(np.median([s for _, s in steps[mode]])) if steps[mode] else None
        m = steps[mode][0][0] if steps[mode] else None
        sampled = sum(int(gen.output_ids.shape[0]) for calls in sessions.values()
                      for _, gen in calls)
        prompt_tokens = sum(len(p) for calls in sessions.values() for p, _ in calls)
        cached = sum(int(gen.extra["cached_tokens"]) for calls in sessions.values()
                     for _, gen in calls)
        out[mode] = {
            "rollout_s": round(rollout_s, 2),
            "rollout_s_each": [round(r["seconds"], 2) for r in rollouts[mode]],
            "sampled_tokens": sampled,
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": prompt_tokens - cached,
            "sampled_tokens_per_s": round(sampled / rollout_s, 1),
            "train_step_s_each": [round(s, 2) for _, s in steps[mode]],
        }
        if m is not None and step_s is not None:
            out[mode].update({
                "train_step_s": round(step_s, 2),
                "train_tokens": m.tokens,
                "max_abs_logprob_diff": m.max_abs_logprob_diff,
                "mean_abs_logprob_diff": m.mean_abs_logprob_diff,
                "token_kl": m.token_kl,
                "is_clipped_fraction": m.is_clipped_fraction,
            })
    s, c = out["standard"], out["consistent"]
    out["rollout_cost"] = round(c["rollout_s"] / s["rollout_s"], 2)
    if "train_step_s" in s and "train_step_s" in c:
        out["train_step_cost"] = round(c["train_step_s"] / s["train_step_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen2.5-0.5b-shaped",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each mode on the tiny model (the 0.5B-shaped one: at most 2)")
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0,
                    help="the engine's prefix cache (0: off, every call prefills its prompt)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--keep-workload", action="store_true",
                    help="the 0.5B-shaped model runs the flags' workload, not the CPU one")
    ap.add_argument("--probe", action="store_true",
                    help="check which kernels are batch-invariant on this device first")
    ap.add_argument("--out", type=Path, default=None, help="rewritten after every model")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")

    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"bench": "consistent_numerics",
                           "config": vars(args) | {"out": None}, "models": {}}
    for name in names:
        margs = argparse.Namespace(**vars(args))
        if name != "tiny" and not args.keep_workload:
            vars(margs).update(QWEN05_WORKLOAD, repeats=min(args.repeats, 2))
        out["models"][name] = measure_model(name, margs)
        if args.out is not None:
            args.out.write_text(json.dumps(out, indent=2))
        print(json.dumps({name: {k: out["models"][name].get(k)
                                 for k in ("rollout_cost", "train_step_cost")}}),
              file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
