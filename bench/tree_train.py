"""Tree training vs per-path training (and vs prefix-grouper), one training step each.

A "step" is what the trainer does per batch: the no-grad recompute of old log-probabilities,
then forward + backward of the PPO/GRPO loss (no optimizer step, identical for all).
Each method runs in its own process (peak memory = peak RSS above the process's RSS
before the first step, or CUDA max allocated), on the same random model and trees;
gradients are compared to per-path training in the same run.

Workloads:
- agent: branching agent-like trees (`tidal.train.synthetic.agent_tree`): a shared
  trunk of `--shared` of each path, `--mid` sub-trunks, `--leaves` leaves.
- grpo: one shared prompt of `--prompt` tokens and `--group` responses of `--response`
  tokens, the only workload prefix-grouper supports; run with tidal, per-path and
  prefix-grouper (PyPI `prefix-grouper`; its default inner kernel is flash-attn, so a
  small SDPA adapter with bottom-right causal alignment is registered for CPU).

Timing: one process runs all methods of a workload, one warm-up each, then `--repeats`
rounds interleaved (tree, path, pg, tree, ...), so load from other jobs on a shared
machine hits every method alike; speedup = per-path / tree of the minimum step time,
the median and CPU-time ratios are reported too. Peak memory and gradients come from
one separate process per method. `--json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).float().to(args.device)  # type: ignore[no-untyped-call]


def _trees(args: argparse.Namespace, workload: str) -> list[Any]:
    from tidal.train.synthetic import agent_tree
    from tidal.tree.types import Branch, Segment, TrainTree

    rng = np.random.default_rng(0)
    if workload == "agent":
        return [
            agent_tree(
                rng,
                f"agent{i}",
                n_leaves=args.leaves,
                path_len=args.path_len,
                shared_fraction=args.shared,
                n_mid=args.mid,
                vocab=args.vocab,
            )
            for i in range(args.trees)
        ]
    P, G, R = args.prompt, args.group, args.response

    def seg(parent: int, n: int, model: bool) -> Segment:
        return Segment(
            parent,
            rng.integers(0, args.vocab, n).astype(np.int32),
            np.full(n, model),
            np.full(n, -2.0 if model else 0.0, np.float32),
            np.zeros(n, np.int32),
        )

    segs = [seg(-1, P, False)] + [seg(0, R, True) for _ in range(G)]
    adv = rng.normal(size=G)
    adv = (adv - adv.mean()) / adv.std()
    branches = tuple(Branch(1 + j, float(adv[j]), 1.0 / G, "grpo") for j in range(G))
    return [TrainTree("grpo", tuple(segs), branches)]


def _pg_sdpa(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *args: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """CPU adapter for prefix-grouper: causal SDPA aligned bottom-right, no padding."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("the bench adapter supports unpadded groups only")
    ql, kl = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if ql == kl:
        out = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        mask = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
        out = sdpa(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _rss_mb() -> float:
    with Path("/proc/self/statm").open() as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(
    methods: list[str], workload: str, args: argparse.Namespace, out: str, timed: bool
) -> None:
    """timed: all methods in this process, interleaved; else one method, for memory."""
    sys.path.insert(0, str(ROOT / "src"))
    torch.set_num_threads(args.threads)
    from tidal.train.attention import enable_tree_attention
    from tidal.train.loss import LossConfig, pair_loss, per_path_loss
    from tidal.train.packing import pack_trees
    from tidal.train.trainer import (
        KVCache,
        build_pair_terms,
        recompute_logprobs,
        tree_loss_backward,
    )

    model = _model(args)
    trees = _trees(args, workload)
    cfg = LossConfig(correction="none")
    dev = torch.device(args.device)

    def tree_step() -> None:
        batch = pack_trees(trees, args.max_tokens)
        cache = KVCache()
        old = recompute_logprobs(model, batch, kv_cache=cache)
        terms = build_pair_terms(batch, old, cfg)
        tree_loss_backward(model, batch, terms, cfg, cache)

    def path_step() -> None:
        from tidal.train.loss import path_logprobs

        old: list[list[np.ndarray]] = []
        with torch.no_grad():  # per-path recompute: every path through the plain model
            for t in trees:
                per_seg = [np.zeros(len(s), np.float32) for s in t.segments]
                for b in t.branches:
                    path = t.path_segments(b)
                    ids = np.concatenate([t.segments[i].token_ids for i in path])
                    mask = np.concatenate([t.segments[i].model_mask for i in path])
                    sel = np.flatnonzero(mask[1:]) + 1
                    lp = (
                        path_logprobs(
                            model,
                            torch.as_tensor(ids.astype(np.int64), device=dev),
                            torch.as_tensor(sel, device=dev),
                        )
                        .cpu()
                        .numpy()
                    )
                    full = np.zeros(ids.size, np.float32)
                    full[sel] = lp
                    o = 0
                    for i in path:
                        per_seg[i] = full[o : o + len(t.segments[i])]
                        o += len(t.segments[i])
                old.append(per_seg)
        per_path_loss(model, trees, old, cfg).backward()  # type: ignore[no-untyped-call]

    pg_state: dict[str, Any] = {}

    def pg_setup() -> None:
        if not pg_state:
            from prefix_grouper import PrefixGrouper
            from prefix_grouper.utils.register_transformers import register_attention
            from transformers import AttentionInterface

            register_attention()
            AttentionInterface.register("tidal_bench_pg_sdpa", _pg_sdpa)
            P, G, R = args.prompt, args.group, args.response
            t = trees[0]
            ids = np.concatenate([s.token_ids for s in t.segments]).astype(np.int64)
            pos = np.concatenate([np.arange(P)] + [np.arange(P, P + R)] * G)
            pred = np.concatenate(
                [np.concatenate([[P - 1], P + j * R + np.arange(R - 1)]) for j in range(G)]
            )
            pg_state.update(
                grouper=PrefixGrouper([[P] + [R] * G], device=dev),
                ids=torch.as_tensor(ids, device=dev)[None],
                pos=torch.as_tensor(pos, device=dev)[None],
                pred=torch.as_tensor(pred, device=dev),
                tgt=torch.as_tensor(ids[P:], device=dev),
                adv=torch.as_tensor(
                    np.repeat([b.advantage for b in t.branches], R), device=dev
                ).float(),
            )

    def pg_step() -> None:
        s = pg_state

        def logprobs() -> torch.Tensor:
            h = model.get_decoder()(  # type: ignore[operator]
                input_ids=s["ids"],
                position_ids=s["pos"],
                use_cache=False,
                prefix_grouper=s["grouper"],
                prefix_grouper_attn_func="tidal_bench_pg_sdpa",
            ).last_hidden_state[0]
            head = model.get_output_embeddings()  # type: ignore[operator]
            logits = head(h.index_select(0, s["pred"])).float()
            return logits.gather(1, s["tgt"][:, None])[:, 0] - logits.logsumexp(-1)

        with torch.no_grad():
            old = logprobs()
        new = logprobs()
        loss, _ = pair_loss(new, old, s["adv"], torch.ones_like(new), cfg=cfg)
        loss.mean().backward()  # type: ignore[no-untyped-call]  # one group, coef 1/G, all tokens trained: the token mean

    def use(method: str) -> None:
        if method == "tree":
            enable_tree_attention(model)
        elif method == "path":
            model.set_attn_implementation("sdpa")  # type: ignore[operator]
        else:
            pg_setup()
            model.set_attn_implementation("prefix_grouper_attention")  # type: ignore[operator]

    steps = {"tree": tree_step, "path": path_step, "pg": pg_step}

    def run(method: str) -> tuple[float, float]:
        use(method)
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        steps[method]()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    if not timed:
        (method,) = methods
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rss0 = _rss_mb()
        run(method)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
        grads = torch.cat(
            [p.grad.reshape(-1).cpu() for p in model.parameters() if p.grad is not None]
        )
        torch.save({"peak_mb": peak, "grads": grads}, out)
        return
    for m in methods:
        run(m)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits all alike
        for m in methods:
            w, c = run(m)
            times[m].append(w)
            cpu[m].append(c)
    torch.save({"times": times, "cpu": cpu}, out)


def _run(
    methods: list[str], workload: str, args: argparse.Namespace, out: str, timed: bool
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_worker, args=(methods, workload, args, out, timed))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{methods} on {workload} failed (exit {p.exitcode})")
    res: dict[str, Any] = torch.load(out)
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _compare(
    workload: str, methods: list[str], args: argparse.Namespace, tmp: str
) -> dict[str, Any]:
    from tidal.train.packing import pack_trees

    trees = _trees(args, workload)
    batch = pack_trees(trees, args.max_tokens)
    mem = {m: _run([m], workload, args, str(Path(tmp) / f"{m}.pt"), False) for m in methods}
    timing = _run(methods, workload, args, str(Path(tmp) / "timing.pt"), True)
    res = {m: {"times": timing["times"][m], "cpu": timing["cpu"][m], **mem[m]} for m in methods}
    path = res["path"]
    out: dict[str, Any] = {
        "ideal_ratio": batch.path_tokens / batch.unique_tokens,
        "unique_tokens": batch.unique_tokens,
        "path_tokens": batch.path_tokens,
        "streams": len(batch.streams),
        "path_s": min(path["times"]),
        "path_peak_mb": path["peak_mb"],
    }
    for m in methods:
        if m == "path":
            continue
        r = res[m]
        out[f"{m}_s"] = min(r["times"])
        out[f"{m}_speedup"] = min(path["times"]) / min(r["times"])
        out[f"{m}_speedup_median"] = statistics.median(path["times"]) / statistics.median(
            r["times"]
        )
        out[f"{m}_speedup_cpu"] = min(path["cpu"]) / min(r["cpu"])
        out[f"{m}_peak_mb"] = r["peak_mb"]
        out[f"{m}_grad_rel_err"] = _rel(r["grads"], path["grads"])
    out["tree_fraction_of_ideal"] = out["tree_speedup"] / out["ideal_ratio"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--trees", type=int, default=1)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--mid", type=int, default=4)
    ap.add_argument("--path-len", type=int, default=1024)
    ap.add_argument("--shared", type=float, default=0.8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--skip-grpo", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    with tempfile.TemporaryDirectory() as tmp:
        agent = _compare("agent", ["tree", "path"], args, tmp)
        grpo = None if args.skip_grpo else _compare("grpo", ["tree", "path", "pg"], args, tmp)
    result: dict[str, Any] = {
        "ideal_ratio": agent["ideal_ratio"],
        "speedup": agent["tree_speedup"],
        "tree_peak_mb": agent["tree_peak_mb"],
        "path_peak_mb": agent["path_peak_mb"],
        "agent": agent,
        "grpo": grpo,
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, r in (("agent", agent), ("grpo", grpo)):
        if r is None:
            continue
        print(f"[{name}] ideal {r['ideal_ratio']:.2f}x", end="")
        for m in ("tree", "pg"):
            if f"{m}_speedup" in r:
                print(
                    f" | {m}: {r[f'{m}_speedup']:.2f}x (median {r[f'{m}_speedup_median']:.2f}x,"
                    f" cpu {r[f'{m}_speedup_cpu']:.2f}x), peak {r[f'{m}_peak_mb']:.0f} MB,"
                    f" grad err {r[f'{m}_grad_rel_err']:.1e}",
                    end="",
                )
        print(f" | path peak {r['path_peak_mb']:.0f} MB")


if __name__ == "__main__":
    main()
