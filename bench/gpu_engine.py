"""The embedded engine's decode rate against the card's bandwidth limit, and what moving
trained weights into it costs (bench/gpu_check.sh; runs on CPU too, small).

For each dtype (`--dtypes`), one `EmbeddedEngine` on `--device` (prefix cache off:
every prompt is new) serves, for each context (`--contexts`) and batch (`--batches`),
one `generate` call of B random prompts of that many tokens, `--steps` + 1 tokens each:
the engine admits them together (one prefill), then decodes them in one batch. Its own
counters (`EmbeddedEngine.metrics()`) split the time: prefill tokens/s, milliseconds per
decode step, decode tokens/s (rows x steps / decode seconds).

Bandwidth limit: a decode step must read every weight once (the tied embedding as the
output projection; the input lookup reads B rows) and each row's KV cache; with the
measured device bandwidth (`--bandwidth-gbs`, bytes read + written per second of a
device-to-device copy, bench/gpu_ceilings.py) the fastest possible step is
bytes / bandwidth, so tokens/s <= B x bandwidth / (weight bytes + B x KV bytes per row).
`fraction_of_bound` is the measured rate over that.

Weight move: a trainer-like fp32 copy of the model (other random weights) handed over as
`Weights` tensors in process (what `tidal run`'s trainer gives the engine), timed around
`update_weights` with the device synchronised: from the same GPU and from CPU memory;
then one parameter is checked to have arrived.

    python3 bench/gpu_engine.py [--model qwen2.5-0.5b-shaped] [--device cuda]
        [--dtypes bfloat16,float32] [--batches 1,16,64] [--contexts 1024,8192] [--steps 32]
        [--bandwidth-gbs 4300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _model_dir(name: str) -> Path:
    if name in ("tiny", "qwen2.5-0.5b-shaped"):
        from consistent import model_dir  # bench/consistent.py builds and caches both

        return model_dir(name)
    return Path(name)


def _bytes(model: Any) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes per row per token of context)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied once
    cfg = model.config
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * hd * elem
    return weights, kv


def decode(eng: Any, dev: torch.device, batch: int, context: int, *, steps: int,
           bandwidth: float | None) -> dict[str, Any]:
    from tidal.engine.base import SamplingParams

    rng = np.random.default_rng(batch * 100_003 + context)
    prompts = [rng.integers(1000, 9000, size=context).tolist() for _ in range(batch)]
    eng.metrics()  # reset the counters
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    gens = eng.generate(prompts, SamplingParams(max_tokens=steps + 1, seed=1))
    wall = time.perf_counter() - t0
    m = eng.metrics()
    assert all(len(g.output_ids) == steps + 1 for g in gens)
    rows = m["mean_batch"] * m["decode_steps"]
    out: dict[str, Any] = {
        "batch": batch, "context": context, "decode_steps": m["decode_steps"],
        "prefills": m["prefills"], "mean_batch": round(m["mean_batch"], 2),
        "prefill_s": round(m["prefill_s"], 4),
        "prefill_tokens_per_s": round(batch * context / m["prefill_s"], 1),
        "decode_step_ms": round(1000 * m["decode_s"] / max(m["decode_steps"], 1), 3),
        "decode_tokens_per_s": round(rows / m["decode_s"], 1) if m["decode_s"] else None,
        "wall_s": round(wall, 3),
    }
    if dev.type == "cuda":
        out["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
    weights, kv = _bytes(eng.model)
    step_bytes = weights + batch * kv * (context + steps / 2)
    out["bytes_per_step_mb"] = round(step_bytes / 2**20, 1)
    if bandwidth:
        bound = batch * bandwidth * 1e9 / step_bytes
        out["bandwidth_bound_tokens_per_s"] = round(bound, 1)
        if out["decode_tokens_per_s"]:
            out["fraction_of_bound"] = round(out["decode_tokens_per_s"] / bound, 4)
    return out


def weight_move(eng: Any, dev: torch.device, directory: Path, reps: int) -> dict[str, Any]:
    """`update_weights` from a trainer-like fp32 model: from the same device, from CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.engine.base import Weights

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    torch.manual_seed(123)
    with torch.device(dev):
        trainer = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    on_device = {k: v.detach() for k, v in trainer.state_dict().items()}
    on_cpu = {k: v.cpu() for k, v in on_device.items()}
    out: dict[str, Any] = {
        "tensors": len(on_device),
        "source_mb": round(sum(v.numel() * v.element_size() for v in on_device.values())
                           / 2**20, 1),
    }
    version = 1
    for name, sd in (("from_device", on_device), ("from_cpu", on_cpu)):
        times = []
        for _ in range(reps):
            _sync(dev)
            t0 = time.perf_counter()
            eng.update_weights(Weights.of_state_dict(sd), version)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            version += 1
        out[f"{name}_s"] = round(min(times), 4)
        out[f"{name}_s_each"] = [round(t, 4) for t in times]
    key = "model.layers.0.mlp.up_proj.weight"
    got = dict(eng.model.named_parameters())[key]
    out["arrived"] = bool(torch.equal(got, on_device[key].to(got.dtype)))
    out["policy_version"] = eng.policy_version
    del trainer, on_device, on_cpu
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b-shaped",
                    help="qwen2.5-0.5b-shaped, tiny, or a checkpoint directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per call")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="measured bandwidth (GB/s, bytes read + written: a D2D copy)")
    ap.add_argument("--weight-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="rewritten after every row")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # tidal, and tests.train.synthetic
    if args.threads:
        torch.set_num_threads(args.threads)
    from tidal.engine.base import SamplingParams
    from tidal.engine.embedded import EmbeddedEngine

    dev = torch.device(args.device)
    directory = _model_dir(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict[str, Any] = {"bench": "gpu_engine", "model": args.model,
                              "device": args.device, "config": vars(args) | {"out": None},
                              "rows": [], "weight_move": {}, "errors": []}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        try:
            eng = EmbeddedEngine(directory, device=args.device, dtype=dtype,
                                 max_batch_size=max(batches), prefix_cache_mb=0,
                                 max_context=max(contexts) + args.steps + 16, batch_wait_s=0.05)
        except Exception as e:
            result["errors"].append(f"{dtype}: engine: {type(e).__name__}: {e}")
            save()
            continue
        with eng:
            load_s = time.perf_counter() - t0
            eng.generate([[1000, 1001, 1002, 1003]] * 2, SamplingParams(max_tokens=4, seed=0))
            weights, kv = _bytes(eng.model)
            result.setdefault("models", {})[dtype] = {
                "load_s": round(load_s, 2), "weight_mb": round(weights / 2**20, 1),
                "kv_bytes_per_token": kv}
            for context in contexts:
                for batch in batches:
                    try:
                        row = decode(eng, dev, batch, context, steps=args.steps,
                                     bandwidth=args.bandwidth_gbs)
                    except Exception as e:
                        result["errors"].append(
                            f"{dtype} batch {batch} context {context}: {type(e).__name__}: {e}")
                        save()
                        continue
                    result["rows"].append({"dtype": dtype, **row})
                    print(json.dumps(result["rows"][-1]), file=sys.stderr, flush=True)
                    save()
            try:
                result["weight_move"][dtype] = weight_move(eng, dev, directory, args.weight_reps)
            except Exception as e:
                result["errors"].append(f"{dtype}: weight move: {type(e).__name__}: {e}")
            save()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
