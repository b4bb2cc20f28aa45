"""The main job's figure: held-out success from the warm-started model to the end of RL,
over seeds (`tidal run`'s target: +20 points in under 15 minutes on 2 cores).

Runs `tidal run` once per seed, one after another in fresh processes (side by side on 2
cores they would slow each other and the minutes would mean nothing), with the default
config or CONFIG with only `seed` changed. Prints JSON: per seed the held-out curve,
what the held-out episodes got right at the start and the end (`checks`: per kind of
check, the fraction passed), minutes, sessions and the verify result; then the gain's
mean, min and max. A single run's gain says little (docs/agent.md: the same seed's warm
start varies by several points), hence the seeds.

    .venv/bin/python bench/run.py --seeds 0 1 2 [--config C.toml] [--out runs/bench] [--reuse]

Each seed takes the run's own time (~10-13 minutes on a 2-core machine for the default
config, ~30 for configs/laptop-real.toml). `--reuse` reads a seed's finished run
directory (its summary.json) instead of running it again. Per seed it also reports the
held-out success per task family at the start and the end (`families_*`: shell-skills'
skills) at every evaluation, tool calls per episode beside success (held-out and per RL
step: a rise cannot come from skipping the tools), the training success, groups replaced
by dynamic sampling and rollout tokens a second per RL step (and over all of RL,
rollouts and training: `rl_tokens_per_s`), where the minutes went
(`phase_minutes`), and this machine's large-matmul rate (`large_matmul_gflops`, before
and after the runs), since absolute minutes differ ~2x between machines of one kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tidal.run.config import dump_config, load_config


def run_seed(config: Path | None, seed: int, out: Path, reuse: bool = False) -> dict[str, Any]:
    cfg = load_config(config).model_copy(update={"seed": seed})
    t0 = time.perf_counter()
    if not (reuse and (out / "summary.json").is_file()):
        out.mkdir(parents=True, exist_ok=True)
        conf = out.parent / f"{out.name}.toml"
        conf.write_text(dump_config(cfg))
        proc = subprocess.run(
            [sys.executable, "-m", "tidal.cli", "run", str(conf), "--out", str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed}: tidal run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    rl = [r for r in rows if r.get("phase") == "rl" and "success_rate" in r]
    start, end = summary["success_rate_start"], summary["success_rate_end"]
    return {
        "seed": seed,
        "success_rate_start": start,
        "success_rate_end": end,
        "gain_points": round(100 * (end - start), 1),
        "heldout_curve": summary["heldout_curve"],
        "checks_start": evals[0].get("checks"),
        "checks_end": evals[-1].get("checks"),
        "families_start": evals[0].get("families"),
        "families_end": evals[-1].get("families"),
        "families_curve": {str(r["step"]): r.get("families") for r in evals},
        "tool_calls_per_episode_curve": {str(r["step"]): r.get("tool_calls_per_episode")
                                         for r in evals},
        "train_success_curve": [round(r["success_rate"], 3) for r in rl],
        "train_tool_calls_per_episode": [r.get("tool_calls_per_episode") for r in rl],
        "groups_replaced": [r.get("groups_replaced", 0) for r in rl],
        "rollout_tokens_per_s": [round(r.get("rollout_tokens_per_s", 0.0), 1) for r in rl],
        # every token sampled in the rollout time, dynamic sampling's re-rolls included
        # (the trainer's wait for its batch: under elastic, rollouts also run while it
        # trains, so this is no pace there)
        "generated_tokens_per_s": [round(generated(r) / r["rollout_s"], 1) for r in rl
                                   if r.get("rollout_s")],
        # every token sampled over RL's seconds, rollouts and training (overlapped or not):
        # the pace that compares schedules
        "rl_tokens_per_s": round(sum(generated(r) for r in rl)
                                 / max(sum(r["rollout_s"] + r["train_s"] for r in rl), 1e-9), 1),
        "phase_minutes": _phase_minutes(rows),
        "minutes": summary["minutes"],
        "wall_minutes": round((time.perf_counter() - t0) / 60, 2),
        "sessions": summary["sessions"],
        "peak_rss_mb": summary.get("peak_rss_mb"),
        "verify_ok": summary["verify_ok"],
        "drift_tokens": summary["drift_tokens"],
        "run_dir": str(out),
    }


def generated(row: dict[str, Any]) -> int:
    """Tokens the engine sampled since the metrics row before `row`: the embedded engine's
    counter, or the sum over vLLM servers."""
    if "generated_tokens" in row:
        return int(row["generated_tokens"])
    return sum(int(s["tokens"]) for s in row.get("servers", []))


def _phase_minutes(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Minutes in the warm start, the held-out evaluations, and RL's rollouts and
    training steps, from the run's metrics rows."""
    warm = sum(r.get("seconds", 0.0) for r in rows if r.get("phase") == "warmstart")
    evals = sum(r.get("seconds", 0.0) for r in rows if r.get("phase") == "eval")
    rl = [r for r in rows if r.get("phase") == "rl"]
    rollout = sum(r.get("rollout_s", 0.0) for r in rl)
    train = sum(r.get("train_s", 0.0) for r in rl)
    return {k: round(v / 60, 2) for k, v in
            (("warmstart", warm), ("eval", evals), ("rl_rollout", rollout), ("rl_train", train))}


def matmul_gflops(n: int = 2048, repeat: int = 5) -> float:
    """This machine's large-matmul rate (an n x n x n fp32 matmul, best of `repeat`), to
    state beside the minutes: absolute speeds differ ~2x between machines of one kind."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return round(2 * n**3 / best / 1e9, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=None, help="default: the built-in one")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--reuse", action="store_true",
                    help="read a seed's finished run directory instead of running it again")
    args = ap.parse_args()
    rate_before = matmul_gflops()
    runs = [run_seed(args.config, s, args.out / f"seed-{s}", args.reuse) for s in args.seeds]
    rate_after = matmul_gflops()
    gains = [r["gain_points"] for r in runs]
    print(
        json.dumps(
            {
                "config": str(args.config) if args.config else "default",
                "runs": runs,
                "gain_points_mean": round(statistics.fmean(gains), 1),
                "gain_points_min": min(gains),
                "gain_points_max": max(gains),
                "minutes_max": max(r["minutes"] for r in runs),
                "all_verify_ok": all(r["verify_ok"] and r["drift_tokens"] == 0 for r in runs),
                # measured by this invocation, before and after its runs (--reuse: now)
                "large_matmul_gflops": [rate_before, rate_after],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
