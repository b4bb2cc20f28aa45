"""Tree training vs per-path training (and vs prefix-grouper), one training step each.

A "step" is what the trainer does per batch: the no-grad recompute of old log-probabilities,
then forward + backward of the PPO/GRPO loss (no optimizer step, identical for all).
Each method runs in its own process (peak memory = peak RSS above the process's RSS
before the first step, or CUDA max allocated), on the same random model and trees;
gradients are compared to per-path training in the same run.

Workloads:
- agent: branching agent-like trees (`tests.train.synthetic.agent_tree`): a shared
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

On a GPU (`--device cuda`; bench/gpu_check.sh): `--arch qwen2.5-0.5b` (Qwen2.5-0.5B's
config, random weights, vocabulary 151,936), `--dtype bfloat16|float32`, and
`--inprocess` (the default on CUDA): one process runs both methods, a warm-up each on a
small tree (FlexAttention's compile, cuBLAS), then `--repeats` interleaved rounds on the
real trees; peak memory is CUDA's peak allocation during each method's first timed step
(`torch.cuda.max_memory_allocated`, reset before it). `--path-mode each` backpropagates
each path as soon as it is computed (the same gradient, one path's activations alive at a
time), which a 0.5B model on 100K+ path tokens needs. FLOPs per step are counted
exactly for what each method computes (`_step_flops`: linear layers 2 P per token,
attention 4 c H D per token and layer with c the keys it sees, the vocabulary projection
2 d V per trained token; a step is the no-grad recompute, the forward and the backward,
4 forwards) and reported with MFU against `--peak-tflops` (measured by
bench/gpu_ceilings.py).
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


def _config(args: argparse.Namespace) -> Any:
    """The model's transformers config: `--arch qwen3` from --layers/--hidden/--vocab;
    `qwen2.5-0.5b` Qwen2.5-0.5B's (its layers replaced by --layers when given)."""
    from transformers import Qwen2Config, Qwen3Config

    if args.arch == "qwen2.5-0.5b":
        from consistent import QWEN05_SHAPE  # bench/consistent.py: Qwen2.5-0.5B's config

        shape = dict(QWEN05_SHAPE)
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        return Qwen2Config(**shape, attn_implementation="sdpa")
    return Qwen3Config(  # type: ignore[call-arg]
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers or 4,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        attn_implementation="sdpa",
    )


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = _config(args)
    if args.arch == "qwen2.5-0.5b":
        with torch.device(args.device):  # random init where it runs: fast on a GPU
            model = Qwen2ForCausalLM(cfg)  # type: ignore[no-untyped-call]
        return model.to(dtype)  # type: ignore[no-any-return]
    return Qwen3ForCausalLM(cfg).to(dtype).to(args.device)  # type: ignore[no-untyped-call]


def _trees(args: argparse.Namespace, workload: str) -> list[Any]:
    from tests.train.synthetic import agent_tree

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


def _path_old(model: torch.nn.Module, trees: list[Any], dev: torch.device) -> list[list[Any]]:
    """Per-path recompute (no grad): every path through the plain model; the old
    log-probabilities per [tree][segment]."""
    from tidal.train.loss import path_logprobs

    old: list[list[np.ndarray]] = []
    with torch.no_grad():
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
                    .float()
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
    return old


def _path_backward_each(
    model: torch.nn.Module, trees: list[Any], old: list[list[Any]], cfg: Any, dev: torch.device
) -> None:
    """`per_path_loss(model, trees, old, cfg).backward()`, one path at a time: the loss
    is a sum over branches of coef * sum(m * loss) / (D_g * G), and D_g depends only on
    the rollout and old log-probabilities, so each branch's term can be backpropagated
    as soon as it is formed (one path's activations alive, not all of them)."""
    from tidal.train.loss import pair_loss, path_correction, path_logprobs

    plans = []
    den: dict[str, float] = {}
    for ti, t in enumerate(trees):
        for b in t.branches:
            path = t.path_segments(b)
            segs = [t.segments[i] for i in path]
            ids = np.concatenate([s.token_ids for s in segs]).astype(np.int64)
            mask = np.concatenate([s.model_mask for s in segs])
            roll = np.concatenate([s.logprobs for s in segs]).astype(np.float32)
            o = np.concatenate([np.asarray(old[ti][i], dtype=np.float32) for i in path])
            sel = np.flatnonzero(mask[1:]) + 1
            den.setdefault(b.norm_group, 0.0)
            if sel.size == 0:
                continue
            old_t = torch.as_tensor(o[sel], device=dev)
            delta = old_t - torch.as_tensor(roll[sel], device=dev)
            w, m = path_correction(delta, cfg)
            den[b.norm_group] += b.coef * float(m.sum())
            plans.append((b, ids, sel, old_t, w, m))
    n_groups = max(len(den), 1)
    for b, ids, sel, old_t, w, m in plans:
        if den[b.norm_group] <= 0:
            continue
        new = path_logprobs(model, torch.as_tensor(ids, device=dev),
                            torch.as_tensor(sel, device=dev))
        loss, _ = pair_loss(new, old_t, torch.full_like(new, b.advantage), w, cfg=cfg)
        term = b.coef * (m * loss).sum() / (den[b.norm_group] * n_groups)
        term.backward()  # type: ignore[no-untyped-call]


def _methods(model: torch.nn.Module, args: argparse.Namespace) -> tuple[
        dict[str, Any], Any]:
    """The step of each method (as a function of the trees) and `use(method)`, which
    switches the model's attention for it."""
    from tidal.train.attention import enable_tree_attention
    from tidal.train.loss import LossConfig, pair_loss, per_path_loss
    from tidal.train.packing import pack_trees
    from tidal.train.trainer import (
        KVCache,
        build_pair_terms,
        recompute_logprobs,
        tree_loss_backward,
    )

    cfg = LossConfig(correction="none")
    dev = torch.device(args.device)

    def tree_step(trees: list[Any]) -> None:
        batch = pack_trees(trees, args.max_tokens)
        cache = KVCache()
        old = recompute_logprobs(model, batch, kv_cache=cache, attention=args.attention)
        terms = build_pair_terms(batch, old, cfg)
        tree_loss_backward(model, batch, terms, cfg, cache, attention=args.attention)

    def path_step(trees: list[Any]) -> None:
        old = _path_old(model, trees, dev)
        if args.path_mode == "each":
            _path_backward_each(model, trees, old, cfg, dev)
        else:
            per_path_loss(model, trees, old, cfg).backward()  # type: ignore[no-untyped-call]

    pg_state: dict[str, Any] = {}

    def pg_setup(trees: list[Any]) -> None:
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

    def pg_step(trees: list[Any]) -> None:
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

    def use(method: str, trees: list[Any]) -> None:
        if method == "tree":
            enable_tree_attention(model)
        elif method == "path":
            model.set_attn_implementation("sdpa")  # type: ignore[operator]
        else:
            pg_setup(trees)
            model.set_attn_implementation("prefix_grouper_attention")  # type: ignore[operator]

    return {"tree": tree_step, "path": path_step, "pg": pg_step}, use


def _timer(model: torch.nn.Module, args: argparse.Namespace) -> Any:
    steps, use = _methods(model, args)
    dev = torch.device(args.device)

    def run(method: str, trees: list[Any]) -> tuple[float, float]:
        use(method, trees)
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        steps[method](trees)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def _flat_grads(model: torch.nn.Module, device: str = "cpu") -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).to(device, torch.float32)
                      for p in model.parameters() if p.grad is not None])


def _worker(
    methods: list[str], workload: str, args: argparse.Namespace, out: str, timed: bool
) -> None:
    """timed: all methods in this process, interleaved; else one method, for memory."""
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic
    torch.set_num_threads(args.threads)
    model = _model(args)
    trees = _trees(args, workload)
    dev = torch.device(args.device)
    run = _timer(model, args)

    if not timed:
        (method,) = methods
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rss0 = _rss_mb()
        run(method, trees)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
        torch.save({"peak_mb": peak, "grads": _flat_grads(model)}, out)
        return
    for m in methods:
        run(m, trees)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):  # interleaved, so load on a shared machine hits all alike
        for m in methods:
            w, c = run(m, trees)
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


def _inprocess(methods: list[str], workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every method in this process (CUDA): a warm-up step each on a small tree, then the
    first timed step of each with CUDA's peak allocation reset before it (its gradients
    kept for the comparison), then `--repeats - 1` interleaved rounds."""
    dev = torch.device(args.device)
    model = _model(args)
    run = _timer(model, args)
    trees = _trees(args, workload)
    small = argparse.Namespace(**{**vars(args), "path_len": min(args.path_len, 512),
                                  "leaves": min(args.leaves, 4), "mid": min(args.mid, 2),
                                  "prompt": min(args.prompt, 256)})
    warm = _trees(small, workload) if workload == "agent" else trees
    res: dict[str, Any] = {m: {"times": [], "cpu": []} for m in methods}
    for m in methods:
        w, _ = run(m, warm)  # compiles (FlexAttention), cuBLAS and allocator warm-up
        res[m]["warmup_s"] = w
        _emit_partial(args, {"method": m, "warmup_s": w})
    grads: dict[str, torch.Tensor] = {}
    for m in methods:
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
        w, c = run(m, trees)
        res[m]["times"].append(w)
        res[m]["cpu"].append(c)
        if dev.type == "cuda":
            res[m]["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            res[m]["peak_above_weights_mb"] = res[m]["peak_mb"] - base
        else:
            res[m]["peak_mb"] = None
        sizes = [p.numel() for p in model.parameters() if p.grad is not None]
        grads[m] = _flat_grads(model, args.device)
        _emit_partial(args, {"method": m, "first_step_s": w, **{
            k: v for k, v in res[m].items() if k not in ("times", "cpu")}})
    for _ in range(args.repeats - 1):
        for m in methods:
            w, c = run(m, trees)
            res[m]["times"].append(w)
            res[m]["cpu"].append(c)
    model.zero_grad(set_to_none=True)
    try:  # how often FlexAttention's compiled function was (re)compiled in this process
        from torch._dynamo.utils import counters

        res["dynamo"] = {k: dict(v) for k, v in counters.items()
                         if k in ("stats", "recompiles", "frames", "unimplemented")}
    except Exception as e:
        res["dynamo"] = f"{type(e).__name__}: {e}"
    for m in methods:
        res[m]["grads"] = grads[m]
        if m != "path":
            g, ref = grads[m], grads["path"]
            res[m]["grad_max_param_rel_err"] = _max_param_rel(sizes, g, ref)
    return res


def _max_param_rel(sizes: list[int], g: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-parameter relative error ||g - ref|| / ||ref|| (flat gradients of
    parameters of `sizes` elements, in order)."""
    worst, o = 0.0, 0
    for n in sizes:
        a, b = g[o : o + n], ref[o : o + n]
        o += n
        nb = float(b.norm())
        if nb > 0:
            worst = max(worst, float((a - b).norm()) / nb)
    return worst


def _emit_partial(args: argparse.Namespace, row: dict[str, Any]) -> None:
    """A progress line on stderr (the GPU check keeps what a killed run had measured)."""
    print(json.dumps({"partial": row, "dtype": args.dtype}), file=sys.stderr, flush=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _linear_params(config: Any) -> int:
    """Matrix parameters of the decoder's linear layers (what a token multiplies by)."""
    d = config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * config.intermediate_size
    return int(config.num_hidden_layers * per_layer)


def _step_flops(config: Any, positions: list[np.ndarray], n_targets: int) -> float:
    """FLOPs of one step (no-grad recompute + forward + backward = 4 forwards) over
    tokens at `positions` (each token sees position + 1 keys) with `n_targets` trained
    tokens: linear 2 P, attention 4 c H D per layer, vocabulary projection 2 d V."""
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    tokens = sum(int(p.size) for p in positions)
    keys = sum(float((p.astype(np.float64) + 1).sum()) for p in positions)
    fwd = (2.0 * _linear_params(config) * tokens
           + 4.0 * keys * heads * hd * config.num_hidden_layers
           + 2.0 * config.hidden_size * config.vocab_size * n_targets)
    return 4 * fwd


def _flops(args: argparse.Namespace, trees: list[Any], batch: Any) -> tuple[float, float]:
    """(tree step FLOPs, per-path step FLOPs) for `--arch`'s config."""
    config = _config(args)
    tree = _step_flops(config, [s.position_ids_T for s in batch.streams], batch.n_targets)
    paths, targets = [], 0
    for t in trees:
        for b in t.branches:
            segs = [t.segments[i] for i in t.path_segments(b)]
            n = sum(len(s) for s in segs)
            paths.append(np.arange(n))
            targets += int(np.concatenate([s.model_mask for s in segs])[1:].sum())
    return tree, _step_flops(config, paths, targets)


def _compare(
    workload: str, methods: list[str], args: argparse.Namespace, tmp: str
) -> dict[str, Any]:
    from tidal.train.packing import pack_trees

    trees = _trees(args, workload)
    batch = pack_trees(trees, args.max_tokens)
    if args.inprocess:
        res = _inprocess(methods, workload, args)
    else:
        mem = {m: _run([m], workload, args, str(Path(tmp) / f"{m}.pt"), False) for m in methods}
        timing = _run(methods, workload, args, str(Path(tmp) / "timing.pt"), True)
        res = {m: {"times": timing["times"][m], "cpu": timing["cpu"][m], **mem[m]}
               for m in methods}
    path = res["path"]
    out: dict[str, Any] = {
        "dynamo": res.get("dynamo"),
        "ideal_ratio": batch.path_tokens / batch.unique_tokens,
        "unique_tokens": batch.unique_tokens,
        "path_tokens": batch.path_tokens,
        "targets": batch.n_targets,
        "streams": len(batch.streams),
        "path_s": min(path["times"]),
        "path_times": path["times"],
        "path_peak_mb": path["peak_mb"],
    }
    for m in methods:
        if m == "path":
            continue
        r = res[m]
        out[f"{m}_s"] = min(r["times"])
        out[f"{m}_times"] = r["times"]
        out[f"{m}_speedup"] = min(path["times"]) / min(r["times"])
        out[f"{m}_speedup_median"] = statistics.median(path["times"]) / statistics.median(
            r["times"]
        )
        out[f"{m}_speedup_cpu"] = min(path["cpu"]) / min(r["cpu"])
        out[f"{m}_peak_mb"] = r["peak_mb"]
        out[f"{m}_grad_rel_err"] = _rel(r["grads"], path["grads"])
        for k in ("grad_max_param_rel_err", "warmup_s", "peak_above_weights_mb"):
            if k in r:
                out[f"{m}_{k}"] = r[k]
    if "warmup_s" in path:
        out["path_warmup_s"] = path["warmup_s"]
        out["path_peak_above_weights_mb"] = path.get("peak_above_weights_mb")
    out["tree_fraction_of_ideal"] = out["tree_speedup"] / out["ideal_ratio"]
    if workload == "agent":
        tree_f, path_f = _flops(args, trees, batch)
        out["tree_tflop_per_step"] = tree_f / 1e12
        out["path_tflop_per_step"] = path_f / 1e12
        out["flop_ratio"] = path_f / tree_f  # the exact-attention bound on the speedup
        out["tree_fraction_of_flop_ratio"] = out["tree_speedup"] / out["flop_ratio"]
        out["tree_unique_tokens_per_s"] = batch.unique_tokens / out["tree_s"]
        out["tree_path_tokens_per_s"] = batch.path_tokens / out["tree_s"]
        out["path_tokens_per_s"] = batch.path_tokens / out["path_s"]
        out["tree_tflops"] = tree_f / out["tree_s"] / 1e12
        out["path_tflops"] = path_f / out["path_s"] / 1e12
        for name, peak in (args.peak_tflops or {}).items():
            if not peak or peak <= 0:
                continue
            out[f"tree_mfu_vs_{name}"] = out["tree_tflops"] / peak
            out[f"path_mfu_vs_{name}"] = out["path_tflops"] / peak
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen2.5-0.5b"],
                    help="qwen3: --layers/--hidden/--vocab; qwen2.5-0.5b: Qwen2.5-0.5B's config")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention", default="auto", choices=["auto", "blocks", "dense", "flex"],
                    help="the tree attention backend (auto: flex on CUDA, blocks on CPU)")
    ap.add_argument("--inprocess", action=argparse.BooleanOptionalAction, default=None,
                    help="all methods in one process (default on CUDA)")
    ap.add_argument("--path-mode", default="batch", choices=["batch", "each"],
                    help="per-path baseline: one backward of the summed loss, or per path")
    ap.add_argument("--peak-tflops", type=json.loads, default=None,
                    help='measured peaks for MFU, JSON: {"bf16": 790, "fp32": 50}')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (qwen3: 4; qwen2.5-0.5b: its 24 unless given)")
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
    if args.inprocess is None:
        args.inprocess = args.device.startswith("cuda")
    if args.arch == "qwen2.5-0.5b":
        from consistent import QWEN05_SHAPE

        args.vocab = QWEN05_SHAPE["vocab_size"]
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic
    if args.inprocess:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
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
        "wall_s": time.perf_counter() - t0,
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
