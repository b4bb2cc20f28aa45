"""What sharding the tree trainer over ranks buys: training state per rank, peak memory, step time.

A random Qwen2-shaped model (fp32, SDPA, untied head; ~58M parameters by default) whose
unsharded training state - parameters + gradients + AdamW's two moments, 16 bytes per
parameter - exceeds a per-rank memory budget that the bench sets (`--budget-frac` of the
unsharded state, 0.6 by default, or `--budget-mb`). For each world size (`--world 1,2`)
one process per rank (torch.multiprocessing.spawn; gloo on CPU, NCCL with `--device cuda`):

- builds the model on the meta device, wraps it in `TargetLM`, optionally checkpoints
  activations (`--activation-checkpointing`), applies `shard_policy` (FSDP2, world > 1),
  then materialises only its own shards (`to_empty`), initialises them deterministically
  (each parameter from a generator seeded by its name, sliced to the rank's shard, so every
  world size trains the same model: the warm-up losses must agree) and recomputes the
  rotary embedding's non-persistent `inv_freq`;
- AdamW over the parameters, one warm-up `TreeTrainer.step`, then `--steps` timed steps on
  the same batch of synthetic agent trees (every rank gets the same trees; the trainer
  spreads them over ranks).

Reported per rank: `state_mb` (exact: bytes of this rank's local parameter, gradient and
optimizer tensors; DTensors through `.to_local()`), `peak_rss_mb` (`peak_memory_mb` after
the steps: on CPU the process's peak RSS, interpreter and libraries included - `base_rss_mb`
is the RSS before the model was built; on CUDA the peak allocation), `resident_before_step_mb`
(what the rank holds between steps: RSS after glibc's malloc_trim, or CUDA's allocation),
`step_s` (median) and whether `state_mb` fits the budget. Per world size: `step_s` (median
over steps of the slowest rank), `tokens_per_s` (path tokens / step_s), `fits_budget` (every
rank fits). Threads per rank: max(1, cores // world), so more ranks add no cores: the time
columns compare one process of N threads with N processes of one thread plus collectives.

Why the peak falls by less than the state: the trainer runs one stream (<= `--max-tokens`)
at a time, so a rank's activations and [N, vocab] logits do not shrink with the world size,
and FSDP2 adds unsharded copies while it computes - each layer's parameters, and the root's
(embeddings + untied head: over half of this model's parameters) gathered whole and kept
from forward to backward, their full gradients before the reduce-scatter. The state halves
and `resident_before_step_mb` falls by as much; the peak falls by what is left.
`--activation-checkpointing` shrinks the activations, not the FSDP copies.

    .venv/bin/python bench/train_scale.py [--json] [--quick] [--world 1,2] [--steps 3]
                                          [--device cpu|cuda] [--activation-checkpointing]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _config(args: argparse.Namespace) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def _n_params(args: argparse.Namespace) -> int:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        lm = Qwen2ForCausalLM(_config(args))  # type: ignore[no-untyped-call]
    return sum(p.numel() for p in lm.parameters())


def _trees(args: argparse.Namespace) -> list[Any]:
    """Agent trees, each branch with a non-zero advantage (normal draws) and rollout
    log-probabilities on its model tokens (`agent_tree`'s own)."""
    from tests.train.synthetic import agent_tree

    rng = np.random.default_rng(0)
    return [
        agent_tree(rng, f"agent{i}", n_leaves=args.leaves, path_len=args.path_len,
                   shared_fraction=args.shared, n_mid=args.mid, vocab=args.vocab)
        for i in range(args.trees)
    ]


def _rss_mb() -> float:
    with Path("/proc/self/statm").open() as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _resident_mb(device: torch.device) -> float:
    """What this rank holds between steps: CUDA's allocation, or the RSS once glibc has
    returned its free pages (malloc_trim), so the high-water mark of the last step is out."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss_mb()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _init_(model: torch.nn.Module, std: float) -> None:
    """Every parameter from a generator seeded by its name (the same full tensor at every
    world size), this rank's shard of it copied in; norms 1, biases 0."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name.removeprefix("lm.")
            if "norm" in key:
                full = torch.ones(p.shape)
            elif key.endswith(".bias"):
                full = torch.zeros(p.shape)
            else:
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                full = torch.empty(p.shape).normal_(0.0, std, generator=g)
            if isinstance(p, DTensor):  # src_data_rank=None: slice locally, nothing sent
                shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(shard.to_local())
            else:
                p.copy_(full)


def _rotary_(model: torch.nn.Module, config: Any, device: torch.device) -> None:
    """`inv_freq` (and its copy) are non-persistent buffers: garbage after `to_empty`."""
    rot = model.lm.model.rotary_emb  # type: ignore[union-attr]
    fresh = type(rot)(config)
    for name, buf in fresh.named_buffers():
        getattr(rot, name).copy_(buf.to(device))


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in params:
        out["params"] += _local(p).nbytes
        if p.grad is not None:
            out["grads"] += _local(p.grad).nbytes
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                out["optimizer"] += _local(v).nbytes
    return out


def _train(rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic
    from transformers import Qwen2ForCausalLM

    from tidal.train.distributed import (
        Ranks,
        checkpoint_activations,
        peak_memory_mb,
        shard_policy,
    )
    from tidal.train.loss import LossConfig
    from tidal.train.trainer import TargetLM, TreeTrainer

    threads = max(1, args.cores // world)
    torch.set_num_threads(threads)
    ranks = Ranks(rank, world)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    trees = _trees(args)
    base_rss = _rss_mb()
    config = _config(args)
    with torch.device("meta"):
        model: torch.nn.Module = TargetLM(Qwen2ForCausalLM(config))  # type: ignore[no-untyped-call]
    if args.activation_checkpointing:
        checkpoint_activations(model)
    if ranks.distributed:
        model = shard_policy(model, ranks, device)
    model.to_empty(device=device)  # only this rank's shards are allocated
    _init_(model, config.initializer_range)
    _rotary_(model, config, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    trainer = TreeTrainer(model, opt, LossConfig(), max_tokens=args.max_tokens, ranks=ranks)

    def step() -> tuple[float, Any]:
        if ranks.distributed:
            torch.distributed.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        m = trainer.step(trees)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, m

    _, warm = step()
    times, metrics = [], warm
    for i in range(args.steps):
        if i == args.steps - 1:
            floor = _resident_mb(device)
        t, metrics = step()
        times.append(t)
    state = _state_bytes(model, opt)
    res = {
        "rank": rank,
        "threads": threads,
        "state_mb": sum(state.values()) / 2**20,
        "state_parts_mb": {k: v / 2**20 for k, v in state.items()},
        "peak_rss_mb": peak_memory_mb(device),
        "base_rss_mb": base_rss,
        "resident_before_step_mb": floor,
        "step_s": statistics.median(times),
        "times": times,
        "warmup_loss": warm.loss,
        "tokens": metrics.tokens,
        "path_tokens": metrics.path_tokens,
        "streams": metrics.streams,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(res))


def _rank_main(rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
    if world == 1:
        _train(rank, world, args, out)
        return
    import torch.distributed as dist

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        _train(rank, world, args, out)
    finally:
        dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace, budget_mb: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    threads = max(1, args.cores // world)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        mp.spawn(_rank_main, args=(world, args, out), nprocs=world)  # fresh processes: own peaks
        wall = time.perf_counter() - t0
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        r["fits_budget"] = r["state_mb"] <= budget_mb
    step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True))
    path_tokens = ranks[0]["path_tokens"]
    return {
        "world_size": world,
        "threads_per_rank": threads,
        "fits_budget": all(r["fits_budget"] for r in ranks),
        "max_state_mb": max(r["state_mb"] for r in ranks),
        "max_peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "max_resident_before_step_mb": max(r["resident_before_step_mb"] for r in ranks),
        "step_s": step_s,
        "tokens_per_s": path_tokens / step_s,
        "unique_tokens_per_s": ranks[0]["tokens"] / step_s,  # the whole batch's, every rank
        "wall_s": wall,
        "ranks": ranks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter trees; 2 timed steps")
    ap.add_argument("--world", default="1,2", help="world sizes, comma-separated")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads split over the ranks: max(1, cores // world) each")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--budget-frac", type=float, default=0.6,
                    help="per-rank budget as a fraction of the unsharded training state")
    ap.add_argument("--budget-mb", type=float, default=None, help="per-rank budget (overrides)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--trees", type=int, default=4)
    ap.add_argument("--leaves", type=int, default=4)
    ap.add_argument("--mid", type=int, default=2)
    ap.add_argument("--path-len", type=int, default=320)
    ap.add_argument("--shared", type=float, default=0.5)
    ap.add_argument("--activation-checkpointing", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.trees, args.path_len, args.steps = 2, 256, 2
    worlds = [int(w) for w in args.world.split(",")]
    if args.device == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(worlds) > have:
            ap.error(f"--device cuda with world {max(worlds)} needs as many GPUs, found {have}")
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic
    from tidal.train.packing import pack_trees

    n = _n_params(args)
    unsharded_mb = 16 * n / 2**20
    budget_mb = args.budget_mb if args.budget_mb is not None else args.budget_frac * unsharded_mb
    batch = pack_trees(_trees(args), args.max_tokens)
    if not args.json:
        print(f"model: {n / 1e6:.1f}M params, unsharded state {unsharded_mb:.0f} MB, "
              f"budget {budget_mb:.0f} MB per rank; batch: {batch.unique_tokens} unique / "
              f"{batch.path_tokens} path tokens, {len(batch.streams)} streams (one rank)",
              flush=True)
    t0 = time.perf_counter()
    runs = []
    for w in worlds:
        r = _run(w, args, budget_mb)
        runs.append(r)
        if not args.json:
            print(f"world {w} ({r['threads_per_rank']} thr/rank): "
                  f"{'fits' if r['fits_budget'] else 'OVER budget'}  step {r['step_s']:.2f}s  "
                  f"{r['tokens_per_s']:.0f} path tok/s  (wall {r['wall_s']:.0f}s)", flush=True)
            for rk in r["ranks"]:
                print(f"  rank {rk['rank']}: state {rk['state_mb']:.0f} MB  peak "
                      f"{rk['peak_rss_mb']:.0f} MB (base {rk['base_rss_mb']:.0f}, between "
                      f"steps {rk['resident_before_step_mb']:.0f})  "
                      f"step {rk['step_s']:.2f}s  warm-up loss {rk['warmup_loss']:.6g}",
                      flush=True)
    result: dict[str, Any] = {
        "bench": "train_scale",
        "model": {
            "params": n,
            "layers": args.layers,
            "hidden": args.hidden,
            "vocab": args.vocab,
            "unsharded_state_mb": unsharded_mb,
            "budget_mb": budget_mb,
        },
        "batch": {"unique_tokens": batch.unique_tokens, "path_tokens": batch.path_tokens,
                  "streams": len(batch.streams), "trees": args.trees,
                  "max_tokens": args.max_tokens},
        "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "peak_metric": ("cuda max_memory_allocated" if args.device == "cuda"
                        else "ru_maxrss (whole process)"),
        "activation_checkpointing": args.activation_checkpointing,
        "runs": runs,
        "total_s": time.perf_counter() - t0,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
