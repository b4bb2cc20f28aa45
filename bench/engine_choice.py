"""Which engine `make run-real` should ship with: the embedded engine with full fine-tuning,
vLLM with full fine-tuning, and vLLM serving the trainer's LoRA adapters, each as a short
`tidal run` of configs/laptop-real.toml (the same warm start, tasks and seed; `--steps` RL
steps, held-out evaluations at the start and the end), one after another in fresh
processes on the same machine.

Per variant: minutes in the warm start, the evaluations, RL rollouts and RL training;
per step, tokens a second of rollout time, both the batch's (`rollout_tokens_per_s`) and
every token the engine sampled, dynamic sampling's re-rolled groups included
(`generated_tokens_per_s`); the weight sync per step (trainer -> engine: an in-process
copy, a server restart on the new checkpoint, or an adapter load); and the held-out
success at the start and the end (two steps say nothing of learning: it shows the
variant ran the same task). Then bench/engine_sessions.py, the embedded engine alone on
shell-skills' shapes with a step's sessions at once and the config's prefix cache,
sessions in lockstep and with their starts spread over 1 s, and
each variant's generated tokens a second over it (issue 53's target: >= 0.8). Prints
one JSON object.

    .venv/bin/python bench/engine_choice.py [--steps 2] [--variants embedded vllm vllm-lora]
                                            [--out runs/engine-choice]

Needs .venv-vllm (`.ci/vllm-venv.sh`) for the vLLM variants. ~10-25 minutes a variant on 2
cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from run import matmul_gflops, run_seed  # bench/run.py (the script's directory)
from tidal.run.config import RunConfig, dump_config, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "laptop-real.toml"
LORA = {"r": 16, "alpha": 32.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"]}
LORA_LR = 2e-5  # the anchors' LoRA range is 1e-5..1e-4; full fine-tuning here uses 5e-6
LORA_WARMSTART_LR = 1e-3  # 10x the full warm start's 1e-4 (at 1e-4 LoRA solved no task)


def variant(base: RunConfig, name: str, steps: int) -> RunConfig:
    raw = base.model_dump(mode="json", exclude_none=True)
    raw["rl"]["steps"] = steps
    raw["eval"]["every"] = steps
    if name.startswith("vllm"):  # vLLM batches by itself (max_num_seqs: 256 > 64 sessions)
        for key in ("max_batch_size", "matmul_dtype", "kv_dtype"):  # the embedded engine's
            raw["engine"].pop(key, None)
        raw["engine"].update(kind="vllm", servers=1, vllm_python=str(ROOT / ".venv-vllm" /
                                                                     "bin" / "python"))
    if name == "vllm-lora":
        raw["train"]["lora"] = LORA
        raw["rl"]["lr"] = LORA_LR
        raw["warmstart"]["lr"] = LORA_WARMSTART_LR
    return parse_config(raw, f"{CONFIG.name} ({name})")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    rows = [json.loads(line) for line in
            (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    keys = ("phase_minutes", "minutes", "rollout_tokens_per_s", "generated_tokens_per_s",
            "success_rate_start", "success_rate_end", "sessions", "verify_ok", "drift_tokens")
    return {**{k: run[k] for k in keys},
            "weight_sync_s": [round(r["weight_sync_s"], 2) for r in rl],
            # role switches (a vLLM server put to sleep while its device trains, woken after)
            "switch_s": [round(sum(r["switch_s"]), 1) for r in rl]}


def engine_sessions(base: RunConfig, stagger: float) -> float:
    """bench/engine_sessions.py's tokens a second (the embedded engine alone, on
    shell-skills' shapes and the config's batch, prefix cache and dtypes: a step's
    sessions at once), sessions in lockstep (0) or their starts spread (1 s)."""
    n = base.rollout.group_size * base.rollout.tasks_per_step
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_sessions.py"),
                          "--sessions", str(n), "--concurrent", str(n),
                          "--prefix-cache-mb", str(base.rollout.prefix_cache_mb),
                          "--matmul-dtype", base.engine.matmul_dtype,
                          "--kv-dtype", base.engine.kv_dtype,
                          "--stagger", str(stagger)], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["embedded", "vllm", "vllm-lora"],
                    choices=["embedded", "vllm", "vllm-lora"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "engine-choice")
    ap.add_argument("--reuse", action="store_true",
                    help="read a variant's finished run directory instead of running it again")
    args = ap.parse_args()
    base = load_config(CONFIG)
    rate_before = matmul_gflops()
    results: dict[str, Any] = {}
    for name in args.variants:
        conf = args.out / f"{name}.toml"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(dump_config(variant(base, name, args.steps)))
        results[name] = summarize(run_seed(conf, args.seed, args.out / name, args.reuse))
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    engine = {f"stagger_{st:g}": engine_sessions(base, st) for st in (0.0, 1.0)}
    for r in results.values():  # the run's generated tokens/s over the engine's alone
        r["generated_over_engine_sessions"] = {
            k: [round(x / e, 2) for x in r["generated_tokens_per_s"]] for k, e in engine.items()}
    print(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "steps": args.steps,
                      "seed": args.seed, "variants": results,
                      "engine_sessions_tokens_per_s": engine,
                      "large_matmul_gflops": [rate_before, matmul_gflops()]}, indent=1))


if __name__ == "__main__":
    main()
