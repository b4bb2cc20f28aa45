"""What one decode step and the prefill cost the embedded engine's batch, for a real model,
and where a decode step's milliseconds go.

`B` sequences of `T` random prompt tokens (`--ragged`: lengths spread over [T/2, T], so a
left-padded batch is padded and masked) are prefilled (8 at a time, as the engine admits
arrivals) into the batch the tree's engine runs (`embedded.batch_class`: the fast batch
where the tree has one, else `DecodeBatch`); after 3 warm-up steps, decode steps are
timed one by one. After
each step the same process times, alone and on the same shapes:

- the step's linear layers: every matmul of a step ([B, in] x [in, out]: q/k/v, o,
  gate/up and down per layer, and the LM head) through the engine's own linear path (the
  fused, packed ones of `tidal.engine.fused` where the tree has them, else `F.linear` on
  the model's separate weights), their GFLOP/s, and this machine's large-matmul rate
  (a 2048 x 2048 x 2048 fp32 matmul, every 4th step), so that the linear layers'
  efficiency is a ratio;
- the attention alone over the batch's KV cache, as the tree's decode step runs it (the
  attention kernel of `tidal.engine.decode_attention` where the tree has it and it
  builds, over the fast batch's region store or the left-padded cache of older trees,
  else SDPA);
- the sampling alone (`processed_logprobs` and `sample_tokens` on [B, V] logits).

Prints JSON: prefill tokens per second, the median decode step and decode tokens per
second, those components (medians), the rest of the step ("other_ms": norms, rotary,
activations, KV writes, Python, and in an older tree transformers' per-step mask and
cache bookkeeping), and the share of the step outside the linear layers.

`--compare OLD_SRC` measures the tree at OLD_SRC (say a worktree of an older commit:
`git worktree add /tmp/old a07c393`, then `--compare /tmp/old/src`) against this one,
side by side: one worker process per tree (PYTHONPATH set to its src), driven in lock
step, so that both see the same machine: `--repeat` times, each prefills a fresh batch
(old, then new; new, then old the next time), then `--rounds` rounds of `--steps` decode
steps alternate between them (who goes first alternating too). It prints each tree's
pooled figures, the new/old ratios and `/proc/loadavg` before and after (the machine
may be shared).

    .venv/bin/python bench/decode_step.py [--model smollm2-135m] [--batch 16] [--context 800]
    .venv/bin/python bench/decode_step.py --compare /tmp/old_a07c393/src [--repeat 3]
    .venv/bin/python bench/decode_step.py --compare src --matmul-dtype bfloat16 --kv-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
BIG = 2048  # the large matmul: BIG x BIG x BIG, fp32


def _attention_kernel() -> Any:
    """The tree's decode-attention kernel where it has one and the decode step uses it
    (tidal.engine.decode_attention), else None: SDPA, as older trees run it."""
    try:
        from tidal.engine.decode_attention import kernel
    except ImportError:
        return None
    return kernel()


def _batch_class(model: Any) -> Any:
    """The batch the tree's engine runs `model` with (`embedded.batch_class`), or, in an
    older tree, `DecodeBatch`."""
    try:
        from tidal.engine.embedded import batch_class
    except ImportError:
        from tidal.engine.batch import DecodeBatch

        return DecodeBatch
    return batch_class(model)


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _linears(model: Any, batch: int) -> tuple[list[Callable[[], object]], int]:
    """One closure per linear layer of a decode step, on a random [batch, in] input, and
    the step's linear FLOPs: the engine's fused path where this tree has one."""
    try:
        from tidal.engine.fused import fast_decoder
    except ImportError:  # an older tree: transformers' separate nn.Linear layers
        fast = None
    else:
        fast = fast_decoder(model)
    calls: list[Callable[[], object]] = []
    flops = 0
    if fast is not None:
        for lin in fast.linears():
            x = torch.randn(batch, lin.in_features)
            calls.append(lambda lin=lin, x=x: lin(x))
            flops += batch * lin.flops_per_row
        return calls, flops
    mods = [m for layer in model.model.layers
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                      layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                      layer.mlp.down_proj)] + [model.get_output_embeddings()]
    for m in mods:
        x = torch.randn(batch, m.in_features)
        calls.append(lambda m=m, x=x: torch.nn.functional.linear(x, m.weight, m.bias))
        flops += 2 * batch * m.in_features * m.out_features
    return calls, flops


class Bench:
    """One tree's model, its batch and the timings so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        import tidal
        from tidal.engine.model import load_policy_model
        from tidal.engine.tiny import resolve_model

        torch.set_num_threads(args.threads)
        self.args = args
        self.tree = str(Path(tidal.__file__).resolve().parents[1])
        self.model = load_policy_model(resolve_model(args.model))
        if "bfloat16" in (args.matmul_dtype, args.kv_dtype):  # this tree (an older one: fp32)
            from tidal.engine.fused import fast_decoder

            bf16 = {"bfloat16": torch.bfloat16, "float32": None}
            fast_decoder(self.model, matmul_dtype=bf16[args.matmul_dtype],
                         kv_dtype=bf16[args.kv_dtype])
        self.batch: Any = None
        self._warm_up()
        self.prefill_tps: list[float] = []
        self.times: dict[str, list[float]] = {k: [] for k in ("step", "linear", "attention",
                                                              "sampling", "big", "big_bf16")}

    def _warm_up(self) -> None:
        """A process's first forwards pay one-time costs (kernel set-up, first
        allocations, the fused weights): a short batch runs before anything is timed."""
        from tidal.engine.base import SamplingParams
        from tidal.engine.batch import SequenceRequest, decode_batch

        requests = [SequenceRequest(tuple(range(1000, 1064)), SamplingParams(max_tokens=4),
                                    seed=i) for i in range(self.args.batch)]
        decode_batch(self.model, requests, max_context=128, pad_id=0)

    def prefill(self) -> float:
        """A fresh batch: B prompts admitted 8 at a time, then 3 warm-up steps."""
        from tidal.engine.base import SamplingParams
        from tidal.engine.batch import SequenceRequest

        args = self.args
        budget = args.rounds * args.steps + 10
        gen = torch.Generator().manual_seed(0)
        lengths = [args.context - (i * args.context // (2 * args.batch) if args.ragged else 0)
                   for i in range(args.batch)]
        requests = [SequenceRequest(tuple(torch.randint(1000, 9000, (n,), generator=gen)
                                          .tolist()), SamplingParams(max_tokens=budget), seed=i)
                    for i, n in enumerate(lengths)]
        self.batch = None
        batch = _batch_class(self.model)(self.model, max_context=args.context + budget + 10,
                                         pad_id=0)
        t0 = time.perf_counter()
        for i in range(0, args.batch, 8):
            batch.admit(requests[i : i + 8], list(range(i, min(i + 8, args.batch))))
        tps = sum(lengths) / (time.perf_counter() - t0)
        for _ in range(3):
            batch.step()
        self.batch = batch
        self.linears, self.linear_flops = _linears(self.model, args.batch)
        self.prefill_tps.append(tps)
        return tps

    def decode(self, steps: int) -> None:
        """`steps` decode steps, each followed by its components timed alone."""
        from tidal.engine.sampling import processed_logprobs, sample_tokens

        config, batch, n = self.model.config, self.batch, self.args.batch
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        q = torch.randn(n, heads, 1, head_dim)
        logits = torch.randn(n, int(config.vocab_size)) * 3
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        ones = torch.ones(n)
        a, b = torch.randn(BIG, BIG), torch.randn(BIG, BIG)
        a16, b16 = a.bfloat16(), b.bfloat16()

        kernel = _attention_kernel()

        def attention() -> None:
            if hasattr(batch, "_store"):  # a region store: each row reads its own slots
                lengths = batch._next_pos + 1
                for keys, values in batch._store:
                    if kernel is not None:
                        kernel(q[:, :, 0], keys, values, batch._start, lengths, 0.125)
                    else:
                        from tidal.engine.decode_attention import reference

                        reference(q[:, :, 0], keys, values, batch._start, lengths, 0.125)
                return
            mask = batch._mask  # the step's [B, T] mask, as the decode step reads it
            allowed = None if bool(mask.all()) else mask.bool()
            for layer in batch._cache.layers:
                if kernel is not None:
                    kernel(q[:, :, 0], layer.keys, layer.values, allowed, 0.125)
                else:
                    torch.nn.functional.scaled_dot_product_attention(
                        q, layer.keys, layer.values,
                        attn_mask=None if allowed is None else allowed[:, None, None, :],
                        enable_gqa=heads != kv_heads)

        def sampling() -> None:
            lp = processed_logprobs(logits, ones, torch.zeros(n, dtype=torch.long), ones)
            sample_tokens(lp, ones <= 0, gens)

        t = self.times
        with torch.inference_mode():
            for i in range(steps):
                t["step"].append(_seconds(batch.step))
                t["linear"].append(_seconds(lambda: [f() for f in self.linears]))
                t["attention"].append(_seconds(attention))
                t["sampling"].append(_seconds(sampling))
                if i % 4 == 0:
                    t["big"].append(_seconds(lambda: a @ b))
                    if self.args.matmul_dtype == "bfloat16":
                        t["big_bf16"].append(_seconds(lambda: a16 @ b16))

    def report(self) -> dict[str, Any]:
        med = {k: statistics.median(v) for k, v in self.times.items() if v}
        step, linear = med["step"], med["linear"]
        big_gflops = 2 * BIG**3 / med["big"] / 1e9
        linear_gflops = self.linear_flops / linear / 1e9
        args, ms = self.args, 1000.0
        return {
            "tree": self.tree, "model": args.model, "batch": args.batch,
            "context": args.context, "ragged": args.ragged, "threads": args.threads,
            "prefills": len(self.prefill_tps), "decode_steps": len(self.times["step"]),
            "prefill_tokens_per_s": round(statistics.median(self.prefill_tps), 1),
            "decode_step_ms": round(step * ms, 1),
            "decode_step_ms_mean": round(statistics.mean(self.times["step"]) * ms, 1),
            "decode_tokens_per_s": round(args.batch / step, 1),
            "linear_ms": round(linear * ms, 1),
            "linear_gflops": round(linear_gflops, 1),
            "big_matmul_gflops": round(big_gflops, 1),
            "linear_vs_big_matmul": round(linear_gflops / big_gflops, 3),
            "matmul_dtype": args.matmul_dtype, "kv_dtype": args.kv_dtype,
            **({"big_matmul_bf16_gflops": round(2 * BIG**3 / med["big_bf16"] / 1e9, 1),
                "linear_vs_big_bf16_matmul": round(
                    linear_gflops * med["big_bf16"] / (2 * BIG**3 / 1e9), 3)}
               if self.times["big_bf16"] else {}),
            "attention_ms": round(med["attention"] * ms, 1),
            "sampling_ms": round(med["sampling"] * ms, 1),
            "other_ms": round((step - linear - med["attention"] - med["sampling"]) * ms, 1),
            "non_linear_ms": round((step - linear) * ms, 1),
            "non_linear_share": round((step - linear) / step, 3),
        }


def worker(args: argparse.Namespace) -> None:
    """Serve `prefill`, `decode N` and `report` lines on stdin, one JSON line back each."""
    bench = Bench(args)
    print(json.dumps({"ready": bench.tree}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "prefill":
            out: dict[str, Any] = {"prefill_tokens_per_s": bench.prefill()}
        elif cmd[0] == "decode":
            bench.decode(int(cmd[1]))
            out = {"ok": True}
        else:
            out = bench.report()
        print(json.dumps(out), flush=True)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """The old tree and this one, one worker each, driven in lock step."""
    trees = {"old": str(Path(args.compare).resolve()), "new": str(SRC)}
    child = [sys.executable, __file__, "--worker", "--model", args.model,
             "--batch", str(args.batch), "--context", str(args.context),
             "--steps", str(args.steps), "--rounds", str(args.rounds),
             "--threads", str(args.threads), *(["--ragged"] if args.ragged else [])]
    # --matmul-dtype and --kv-dtype are the new tree's (an older one runs fp32): `--compare
    # src --matmul-dtype bfloat16` measures this tree's fp32 step against its bf16 one
    dtype = {"old": [], "new": ["--matmul-dtype", args.matmul_dtype, "--kv-dtype", args.kv_dtype]}
    procs = {name: subprocess.Popen([*child, *dtype[name]],
                                    env={**os.environ, "PYTHONPATH": src}, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL)
             for name, src in trees.items()}

    def ask(name: str, line: str) -> dict[str, Any]:
        proc = procs[name]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer: dict[str, Any] = json.loads(proc.stdout.readline())
        return answer

    for name, proc in procs.items():
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())["ready"]
        assert ready.startswith(trees[name]), (name, ready, trees[name])
    loads = [Path("/proc/loadavg").read_text().strip()]
    prefills: dict[str, list[float]] = {"old": [], "new": []}
    orders = [["old", "new"], ["new", "old"]]  # who goes first alternates too
    for r in range(args.repeat):
        for name in orders[r % 2]:
            prefills[name].append(round(ask(name, "prefill")["prefill_tokens_per_s"], 1))
        for i in range(args.rounds):
            for name in orders[(r + i) % 2]:
                ask(name, f"decode {args.steps}")
    reports = {name: ask(name, "report") for name in procs}
    loads.append(Path("/proc/loadavg").read_text().strip())
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratio = {k: round(reports["new"][k] / reports["old"][k], 3)
             for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_ms",
                       "linear_ms", "non_linear_ms", "big_matmul_gflops")}
    return {"old": reports["old"], "new": reports["new"], "new_over_old": ratio,
            "prefills_tokens_per_s": prefills, "loadavg": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds per prefill")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ragged", action="store_true",
                    help="prompt lengths spread over [T/2, T]: a padded, masked batch")
    ap.add_argument("--matmul-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the linear layers' dtype (engine.matmul_dtype; with --compare, the "
                    "new tree's), and for bfloat16 a 2048^3 bf16 matmul's rate beside fp32's")
    ap.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the KV store's dtype (engine.kv_dtype; with --compare, the new tree's)")
    ap.add_argument("--compare", metavar="OLD_SRC",
                    help="measure the tree at OLD_SRC against this one, side by side")
    ap.add_argument("--repeat", type=int, default=3, help="prefills per tree (--compare)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    elif args.compare:
        print(json.dumps(compare(args), indent=1))
    else:
        bench = Bench(args)
        bench.prefill()
        bench.decode(args.rounds * args.steps)
        print(json.dumps(bench.report()))


if __name__ == "__main__":
    main()
