"""`tidal run` on a Ray cluster (`schedule.backend = "ray"`) against the same run on the
local backend, and what a lost node costs (docs/scale.md).

On a real multi-node cluster on this machine (a head and two workers, separate raylets
from `ray.cluster_utils.Cluster`, one `tidal_gpu` each), the same small config (the tiny
model, digits tasks, colocated, 2 devices) runs alternately on the local backend (the
sessions' sandboxes, harnesses and engine in this process) and on the Ray backend (one
host per worker node, each with its engine, gateway, sandboxes and ledger shard), so
machine drift hits both alike. Then the Ray run again with a worker node removed while
one of its task groups runs.

Prints JSON: per run the wall minutes, per RL step the seconds of rollout, training and
weight sync, and their means per backend; the Ray backend's step-time overhead (ratio
of the mean step times); for the node loss: which node, the groups resumed elsewhere
(with how long each had run on the lost host), the minutes against the undisturbed Ray
runs, and `tidal verify`.

    .venv/bin/python bench/cluster.py [--pairs 2] [--steps 3] [--out runs/bench-cluster]

About 1-2 minutes a run on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.run.clusters, tests.run.loop_runs

from tests.run.clusters import hosts_running, start_cluster, stop_cluster  # noqa: E402
from tests.run.loop_runs import small_config  # noqa: E402

from tidal.run.config import parse_config  # noqa: E402
from tidal.run.loop import run  # noqa: E402


def config(backend: str, steps: int) -> dict[str, Any]:
    cfg: dict[str, Any] = small_config(
        tasks={"name": "digits", "train_size": 8, "heldout_size": 2},
        # temperature 1 and the mixed teacher (tests/run/loop_runs.REPRO): rewards differ
        # within groups, so every step trains
        rollout={"context_budget": 4096, "group_size": 4, "tasks_per_step": 2,
                 "snapshot_every": 1, "temperature": 1.0},
        warmstart={"steps": 20, "teacher": "mixed"}, rl={"steps": steps},
        schedule={"backend": backend, "ray_resource": "tidal_gpu", "devices": 2,
                  "policy": "colocated"})
    return cfg


def figures(out: Path, wall_s: float) -> dict[str, Any]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    summary = json.loads((out / "summary.json").read_text())
    steps = [{"rollout_s": round(r["rollout_s"], 2), "train_s": round(r["train_s"], 2),
              "weight_sync_s": round(r.get("weight_sync_s", 0.0), 2),
              **({"sessions_per_node": r["sessions_per_node"]}
                 if "sessions_per_node" in r else {})} for r in rl]
    return {"wall_minutes": round(wall_s / 60, 2), "steps": steps,
            "step_s": round(statistics.mean(s["rollout_s"] + s["train_s"] + s["weight_sync_s"]
                                            for s in steps), 2),
            "verify_ok": summary["verify_ok"], "sessions": summary["sessions"]}


def one(backend: str, steps: int, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    run(parse_config(config(backend, steps)), out)
    return {"backend": backend, **figures(out, time.perf_counter() - t0)}


def node_loss(cluster: Any, steps: int, out: Path) -> dict[str, Any]:
    """The Ray run with the node of a host that runs a live task group removed (once a
    step is checkpointed and a group has a sandbox snapshot)."""
    shutil.rmtree(out, ignore_errors=True)
    got: dict[str, Any] = {}

    def go() -> None:
        try:
            run(parse_config(config("ray", steps)), out)
        except BaseException as e:  # reported below
            got["error"] = repr(e)

    t0 = time.perf_counter()
    th = threading.Thread(target=go)
    th.start()
    victim = None
    while th.is_alive() and victim is None:
        victim = next(iter(sorted(hosts_running(out))), None)
        time.sleep(0.05)
    if victim is None:
        raise SystemExit(f"the run ended before a node could be removed: {got}")
    killed_at = time.perf_counter() - t0
    (node,) = [n for n in cluster.worker_nodes if n.node_id.startswith(victim)]
    cluster.remove_node(node, allow_graceful=False)
    th.join()
    cluster.add_node(num_cpus=1, resources={"tidal_gpu": 1})  # back to two workers
    if "error" in got:
        raise SystemExit(f"the run failed after the node loss: {got['error']}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    engine = [r if r["phase"] == "rl" else r.get("engine", {}) for r in rows]
    return {"node": victim, "removed_after_s": round(killed_at, 1),
            "groups_resumed": [g for r in engine for g in r.get("groups_resumed", ())],
            **figures(out, time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="local/ray pairs, alternating")
    ap.add_argument("--steps", type=int, default=3, help="RL steps a run")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-cluster"))
    args = ap.parse_args()
    # stdout is the JSON alone: the runs' progress and what Ray's log monitor prints
    # (from its own threads) go to stderr, at the descriptor
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        cluster, _workers = start_cluster(workers=2)
        try:
            runs = [one(b, args.steps, args.out / f"{b}-{i}")
                    for i in range(args.pairs) for b in ("local", "ray")]
            loss = node_loss(cluster, args.steps, args.out / "ray-node-loss")
        finally:
            stop_cluster(cluster)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    mean = {b: round(statistics.mean(r["step_s"] for r in runs if r["backend"] == b), 2)
            for b in ("local", "ray")}
    minutes = {b: round(statistics.mean(r["wall_minutes"] for r in runs
                                        if r["backend"] == b), 2) for b in ("local", "ray")}
    print(json.dumps({
        "config": config("ray", args.steps),
        "runs": runs,
        "mean_step_s": mean,
        "ray_step_overhead": round(mean["ray"] / mean["local"], 3),
        "mean_wall_minutes": minutes,
        "node_loss": {**loss, "minutes_over_undisturbed_ray": round(
            loss["wall_minutes"] - minutes["ray"], 2)},
    }, indent=1))


if __name__ == "__main__":
    main()
