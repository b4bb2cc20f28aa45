"""A run directory for report tests, written the way `tidal run` writes one: metrics
rows through `RunLog` (as the loop's rows: warm start, evaluations, RL steps), the
config, summary.json, and tree pages of a real ledger episode with subagents, parallel
calls and compaction (`tests.tree.synth`), drawn by `tidal.tree.html`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from tests.tree.synth import LongSessionSpec, SynthWriter, write_long_session
from tidal.ledger.store import LedgerStore
from tidal.run.config import dump_config, parse_config
from tidal.run.progress import RunLog
from tidal.tree import process_store
from tidal.tree.html import render_episode_html

SPEC = LongSessionSpec(n_calls=60, tokens=12000, out_tokens=20, subagent_every=10,
                       subagent_calls=3, parallel_every=5, parallel_width=3,
                       compaction_every=20)


def rl_row(step: int, rng: random.Random, steps: int) -> dict[str, Any]:
    learnt = step / max(steps, 1)
    reward = min(1.0, max(0.0, 0.2 + 0.6 * learnt + rng.uniform(-0.15, 0.15)))
    statuses = {"complete": 10 + int(4 * learnt), "truncated": 4 - int(3 * learnt),
                "timeout": rng.choice([0, 1, 2])}
    if step % 7 == 0:
        statuses["infra_error"] = 1
    trained = step % 9 != 0  # some steps have no signal: nothing trained
    return {
        "phase": "rl", "step": step, "policy_version": step + 1, "reward_mean": reward,
        "success_rate": reward * 0.8, "partial_mean": min(1.0, reward + 0.1),
        "timeouts": statuses["timeout"], "statuses": statuses, "grader_errors": 0,
        "staleness": [0, 1], "rollout_s": 20 + rng.uniform(-5, 5),
        "train_s": 8 + rng.uniform(-1, 1) if trained else 0.1,
        "train_tokens_per_s": 900 + rng.uniform(-50, 50) if trained else 0.0,
        "rollout_tokens": 1200, "rollout_tokens_per_s": 45 + 10 * math.sin(step / 5),
        "cpu_utilization": 0.6, "schedule_policy": "elastic", "device_utilization": 0.8,
        "role_switches": {"to_train": 1, "to_rollout": 0}, "idle_s_per_device": [1.0, 2.0],
        "stale_groups_dropped": 0, "staleness_trained": {"0": step, "1": step // 2},
        "k3_kl": 0.05 * rng.random() if trained else 0.0,
        "mean_abs_logprob_diff": 0.1 + 0.05 * rng.random() if trained else 0.0,
        "tokens": 1300.0 if trained else 0.0, "path_tokens": 3600.0 if trained else 0.0,
    }


def eval_row(step: int, steps: int) -> dict[str, Any]:
    learnt = step / max(steps, 1)
    return {"phase": "eval", "step": step, "success_rate": 0.1 + 0.5 * learnt,
            "partial_mean": 0.3 + 0.5 * learnt,
            "checks": {"equals": 0.1 + 0.5 * learnt, "exists": 0.5 + 0.5 * learnt,
                       "finished": 0.9},
            "grader_errors": 0, "seconds": 12.0, "policy_version": step + 1}


def make_run(run_dir: Path, steps: int = 30, every: int = 10) -> Path:
    run_dir.mkdir(parents=True)
    cfg = parse_config({"rl": {"steps": steps}, "eval": {"every": every}})
    (run_dir / "config.toml").write_text(dump_config(cfg))
    log = RunLog(run_dir, total_steps=steps, quiet=True, backends=())
    rng = random.Random(0)
    log.metrics({"phase": "warmstart", "step": 0, "loss_first": 12.0, "loss_last": 0.3,
                 "seconds": 130.0})
    log.metrics(eval_row(0, steps))
    for step in range(1, steps + 1):
        log.metrics(rl_row(step, rng, steps))
        if step % every == 0 or step == steps:
            log.metrics(eval_row(step, steps))
    log.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [[r["step"], r["success_rate"]] for r in rows if r["phase"] == "eval"]
    seconds = sum(r.get("seconds", 0) + r.get("rollout_s", 0) + r.get("train_s", 0)
                  for r in rows) + 40  # start-up and the rest
    (run_dir / "summary.json").write_text(json.dumps({
        "success_rate_start": curve[0][1], "success_rate_end": curve[-1][1], "steps": steps,
        "minutes": seconds / 60, "sessions": 16 * steps, "drift_tokens": 0,
        "verify_ok": True, "policy_version": steps + 1, "heldout_curve": curve,
        "schedule": {"schedule_policy": "elastic", "device_utilization": 0.81,
                     "role_switches": {"to_train": 1, "to_rollout": 0},
                     "idle_s_per_device": [1.0, 20.5], "stale_groups_dropped": 2,
                     "staleness_trained": {"0": 40, "1": 12}},
    }))
    write_tree_page(run_dir / "trees")
    return run_dir


def write_tree_page(out: Path) -> Path:
    """One episode of 60 calls (4 sessions: subagents; parallel calls; a compaction)."""
    out.mkdir(parents=True, exist_ok=True)
    with LedgerStore(out.parent / "tree-ledger.db") as store:
        write_long_session(SynthWriter(store, seed=7), "mix", SPEC)
        res = process_store(store, keep_graphs=True)
    (graph,), (rep,) = res.graphs, res.episodes
    branches = [b for t in res.trees for b in t.branches]
    page = out / "mix.html"
    page.write_text(render_episode_html(graph, rep, branches), encoding="utf-8")
    (out / "index.json").write_text(json.dumps({"mix": {
        "status": rep.status, "reward": rep.reward, "sessions": rep.sessions,
        "calls": rep.calls, "edges": rep.edges}}))
    return page
