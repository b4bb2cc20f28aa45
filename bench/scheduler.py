"""Scheduler benchmark: the three policies on long-tail workloads, across scale and tail
weight (and the staleness bound). Prints a Markdown table and writes JSON.

Every row is one `tidal.schedule.compare.compare` run: same workload (seeded), same
devices, same batch and staleness bound, same number of trained samples for every
policy; the async baseline is the best fixed split found by search (50/50 and the
batch-synchronous variant shown beside it).

Targets (issue 8): elastic >= 1.85x colocated, >= 1.78x the fixed async split,
utilisation >= 90%. Anchors: QwenGyre reports 1.21-1.85x over colocated and
1.38-1.78x over asynchronous setups.

    .venv/bin/python bench/scheduler.py                 # full sweep (minutes)
    .venv/bin/python bench/scheduler.py --quick         # small sweep (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tidal.schedule.compare import Scenario, compare
from tidal.schedule.workload import LognormalWorkload


def row(label: str, r: dict[str, Any]) -> str:
    p = r["policies"]
    w = r["workload"]
    return (
        f"| {label} | {w['p99_s'] / 3600:.1f} h "
        f"| {p['colocated']['samples_per_hour']:.0f} "
        f"| {p['async']['samples_per_hour']:.0f} ({p['async']['split']}) "
        f"| {p['async_50_50']['samples_per_hour']:.0f} "
        f"| {p['async_batch']['samples_per_hour']:.0f} "
        f"| {p['elastic']['samples_per_hour']:.0f} "
        f"| {p.get('elastic_drain_only', p['elastic'])['samples_per_hour']:.0f} "
        f"| {r['fluid_bound_samples_per_hour']:.0f} "
        f"| **{r['speedup_vs_colocated']:.2f}x** | **{r['speedup_vs_async']:.2f}x** "
        f"| {r['speedup_vs_async_50_50']:.2f}x | {r['speedup_vs_async_batch']:.2f}x "
        f"| {p['elastic']['utilization']:.1%} "
        f"| {p.get('elastic_drain_only', p['elastic'])['utilization']:.1%} "
        f"| {p['async']['utilization']:.1%} |"
    )


HEADER = (
    "| run | p99 | colocated | async best (split) | async 50/50 | async batch-sync "
    "| elastic | elastic drain-only | bound | vs colocated | vs async best "
    "| vs 50/50 | vs batch-sync | util elastic | util drain-only | util async |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small devices counts only")
    ap.add_argument("--out", type=Path, default=None, help="write all results as JSON")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)

    scales = [16, 32] if args.quick else [64, 128, 256, 512, 1024]
    tails = [0.35, 0.5, 0.75, 1.0]
    base_n = 32 if args.quick else 256
    runs: list[tuple[str, Scenario]] = []
    for n in scales:
        runs.append((f"N={n}, sigma=0.5", Scenario(n_devices=n, steps=args.steps)))
    for s in tails:
        if s != 0.5:
            runs.append((
                f"N={base_n}, sigma={s}",
                Scenario(n_devices=base_n, steps=args.steps, workload=LognormalWorkload(sigma=s)),
            ))
    for k in (1, 4):
        runs.append((f"N={base_n}, K={k}", Scenario(n_devices=base_n, steps=args.steps,
                                                    max_staleness=k)))
    results: dict[str, Any] = {}
    print("Rows: samples per hour (trained), speedups of elastic, device utilisation.")
    print("Defaults: 4 sessions/device, batch = devices x 4, 8 steps, K=2 (drop), mean 2 h,")
    print("120 tokens/s of rollout, 4.5e-4 train device-s/token, step 30 s, switch 8.5/3.5 s,")
    print("migration 60 s.\n")
    print(HEADER)
    for label, sc in runs:
        t = time.perf_counter()
        r = compare(sc)
        r["bench_wall_s"] = time.perf_counter() - t
        results[label] = r
        print(row(label, r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
