"""Elastic against the best fixed split chosen with hindsight, on workloads that drift.

RL runs lengthen their sessions as the policy learns (more turns, more tool calls), so
the rollout/train cost ratio that a fixed split must be tuned to is not the same at the
start and at the end of a run. This benchmark simulates, at 64 to 1024 devices:

- workloads that drift over the run (`tidal.schedule.workload.DriftingWorkload`: session
  `i`'s draw scaled from 1x to the growth factor over the run's trained sessions):
  durations and tokens growing together (the ratio holds), tokens outgrowing durations
  (training's share grows) and durations outgrowing tokens (rollout's share grows),
  beside the stationary workload for reference;
- decode that speeds up as a rollout device empties (`--decode-speedup`, the share of a
  full device's decode step that grows with the batch; `SimConfig.decode_speedup`);
- migration at the cost measured here (`tidal.schedule.types.MIGRATE_S`).

Every row is one `tidal.schedule.compare.compare` run with `refine_split=True`: the
fixed-split baseline is the fastest split found by a hill climb on that very workload
(an oracle: a user must pick the split before the run). Beside it, "fixed at start" is
the split a user would pick by tuning on the first sessions: the best split of the
stationary row at the same scale, run on the drifting workload. Reported per row:
samples per hour of the best fixed split, the start-tuned split, elastic with
migration, elastic drain-only (what the real backends do today) and colocated;
elastic's speedups over the best fixed split (and over the start-tuned one); device
utilisation; the workload.

    .venv/bin/python bench/nonstationary.py              # 64..1024 devices (minutes)
    .venv/bin/python bench/nonstationary.py --quick      # 16, 32 devices (seconds)
    .venv/bin/python bench/nonstationary.py --json       # the results as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.schedule.compare import Scenario, compare
from tidal.schedule.policy import FixedSplitPolicy
from tidal.schedule.sim import simulate
from tidal.schedule.types import MIGRATE_S
from tidal.schedule.workload import (
    GROWTH_SHAPES,
    DriftingWorkload,
    GrowthShape,
    LognormalWorkload,
    SessionTable,
    WorkloadModel,
)


@dataclass(frozen=True)
class Drift:
    """One workload of the sweep: how durations and tokens grow over the run."""

    name: str
    growth: float
    token_growth: float

    def model(self, over_sessions: int, shape: GrowthShape) -> WorkloadModel:
        base = LognormalWorkload()
        if self.growth == 1.0 and self.token_growth == 1.0:
            return base
        return DriftingWorkload(base, growth=self.growth, token_growth=self.token_growth,
                                over_sessions=over_sessions, shape=shape)


DRIFTS = (
    Drift("stationary", 1.0, 1.0),
    Drift("lengthen", 3.0, 3.0),
    Drift("tokens-outgrow", 1.5, 4.0),
    Drift("durations-outgrow", 4.0, 1.5),
)

HEADER = (
    "| devices | workload | mean session, first → last | best fixed (split) "
    "| fixed at start (split) | elastic | elastic drain-only | colocated | bound "
    "| **elastic vs best fixed** | drain-only vs best fixed | elastic vs fixed at start "
    "| util elastic | util drain-only | util fixed |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def fixed_at_start(sc: Scenario, n_train: int) -> dict[str, Any]:
    """The split tuned on the first (stationary) sessions, run on `sc`'s workload."""
    cfg = sc.sim_config(sc.pool_config(migration=False))
    r = simulate(FixedSplitPolicy(n_train=n_train), SessionTable(sc.workload, sc.seed), cfg,
                 seed=sc.seed)
    return {"n_train": n_train, "split": f"{sc.n_devices - n_train}/{n_train}",
            "samples_per_hour": r.samples_per_hour, "utilization": r.utilization}


def summarise(
    label: str, drift: Drift, n: int, r: dict[str, Any], start: dict[str, Any] | None
) -> dict[str, Any]:
    """The figures of one row, from a `compare` result (and the start-tuned split's)."""
    p = r["policies"]
    fixed = p["async"]["samples_per_hour"]
    elastic = p["elastic"]["samples_per_hour"]
    w = r["workload"]
    first = w.get("first", w)
    last = w.get("last", w)
    names = ("async", "elastic", "elastic_drain_only", "colocated")
    return {
        "label": label,
        "n_devices": n,
        "drift": drift.name,
        "growth": drift.growth,
        "token_growth": drift.token_growth,
        "workload": w,
        "workload_summary": w.get("summary", "stationary lognormal"),
        "mean_h_first": first["mean_s"] / 3600,
        "mean_h_last": last["mean_s"] / 3600,
        "mean_mtokens_first": first["mean_tokens"] / 1e6,
        "mean_mtokens_last": last["mean_tokens"] / 1e6,
        "best_split": p["async"]["split"],
        "splits_tried": len(p["async"]["splits_tried"]),
        "samples_per_hour": {k: p[k]["samples_per_hour"] for k in names},
        "fluid_bound_samples_per_hour": r["fluid_bound_samples_per_hour"],
        "speedup_vs_best_fixed": {
            "elastic": elastic / fixed,
            "elastic_drain_only": p["elastic_drain_only"]["samples_per_hour"] / fixed,
        },
        "fixed_at_start": start,
        "speedup_vs_fixed_at_start": None if start is None
        else elastic / start["samples_per_hour"],
        "utilization": {k: p[k]["utilization"] for k in names},
        "migrations": p["elastic"]["migrations"],
        "role_switches": {k: p[k]["role_switches"] for k in ("elastic", "elastic_drain_only")},
        "compare": r,
    }


def md_row(s: dict[str, Any]) -> str:
    sph, u, sp = s["samples_per_hour"], s["utilization"], s["speedup_vs_best_fixed"]
    st = s["fixed_at_start"]
    at_start = "–" if st is None else f"{st['samples_per_hour']:.0f} ({st['split']})"
    vs_start = "–" if st is None else f"{s['speedup_vs_fixed_at_start']:.3f}x"
    return (
        f"| {s['n_devices']} | {s['drift']} "
        f"| {s['mean_h_first']:.1f} h, {s['mean_mtokens_first']:.2f} M → "
        f"{s['mean_h_last']:.1f} h, {s['mean_mtokens_last']:.2f} M "
        f"| {sph['async']:.0f} ({s['best_split']}) | {at_start} | {sph['elastic']:.0f} "
        f"| {sph['elastic_drain_only']:.0f} | {sph['colocated']:.0f} "
        f"| {s['fluid_bound_samples_per_hour']:.0f} "
        f"| **{sp['elastic']:.3f}x** | {sp['elastic_drain_only']:.3f}x | {vs_start} "
        f"| {u['elastic']:.1%} | {u['elastic_drain_only']:.1%} | {u['async']:.1%} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 and 32 devices, 3 steps")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--devices", type=int, nargs="+", default=None,
                    help="device counts (default 64 128 256 512 1024)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 8)")
    ap.add_argument("--drifts", nargs="+", default=[d.name for d in DRIFTS],
                    choices=[d.name for d in DRIFTS], help="which workloads")
    ap.add_argument("--shape", default="linear", choices=GROWTH_SHAPES)
    ap.add_argument("--decode-speedup", type=float, default=0.3,
                    help="share of a full device's decode step that grows with the batch")
    ap.add_argument("--migrate-s", type=float, default=MIGRATE_S,
                    help="seconds one session migration costs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    scales = args.devices or ([16, 32] if args.quick else [64, 128, 256, 512, 1024])
    steps = args.steps or (3 if args.quick else 8)
    if min(scales) < 2 or steps < 1:
        ap.error("--devices must be >= 2 and --steps >= 1")
    if not 0.0 <= args.decode_speedup <= 1.0:
        ap.error(f"--decode-speedup must be in [0, 1], got {args.decode_speedup}")
    if not args.migrate_s >= 0:
        ap.error(f"--migrate-s must be >= 0, got {args.migrate_s}")
    drifts = [d for d in DRIFTS if d.name in args.drifts]
    settings = {
        "steps": steps, "slots_per_device": 4, "batch": "devices x 4", "max_staleness": 2,
        "decode_speedup": args.decode_speedup, "migrate_s": args.migrate_s,
        "shape": args.shape, "seed": args.seed,
        "base_workload": LognormalWorkload().describe(),
        "drifts": {d.name: {"growth": d.growth, "token_growth": d.token_growth}
                   for d in drifts},
    }
    out = sys.stderr if args.json else sys.stdout
    print(f"Elastic vs the best fixed split (hindsight), {steps} steps, 4 slots/device, "
          f"batch = devices x 4, K=2 (drop), decode speedup {args.decode_speedup:g}, "
          f"migration {args.migrate_s:g} s; samples/hour.\n", file=out)
    print(HEADER, file=out, flush=True)
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for n in scales:
        start_split: int | None = None  # the stationary row's best split at this scale
        for d in drifts:
            sc = Scenario(
                n_devices=n, steps=steps, seed=args.seed, migrate_s=args.migrate_s,
                decode_speedup=args.decode_speedup, refine_split=True,
                workload=d.model(steps * n * 4, args.shape),
            )
            t = time.perf_counter()
            r = compare(sc)
            if d.name == "stationary":
                start_split = r["policies"]["async"]["n_train"]
            start = None
            if start_split is not None:
                start = (fixed_at_start(sc, start_split) if d.name != "stationary" else {
                    "n_train": start_split, "split": r["policies"]["async"]["split"],
                    "samples_per_hour": r["policies"]["async"]["samples_per_hour"],
                    "utilization": r["policies"]["async"]["utilization"]})
            s = summarise(f"N={n}, {d.name}", d, n, r, start)
            s["bench_wall_s"] = time.perf_counter() - t
            rows.append(s)
            print(md_row(s), file=out, flush=True)
    print(f"\n({time.perf_counter() - t_all:.0f} s)", file=out)
    doc = {"settings": settings, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
