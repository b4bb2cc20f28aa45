"""A long `tidal run` on the tiny model: does a step cost more the longer the run?

Runs `--steps` RL steps (40 by default) of a small config (the tiny model, the built-in
`tools` tasks, groups of 2, 3 tasks a step, no evaluation between steps) in a process of
its own, then reads each step's row of metrics.jsonl: its wall time (`rollout_s +
train_s`, the wait for the batch and the trainer's step) and `ledger_rows_read` (call and
outcome rows the step read back from the ledger: its rollouts' and its trees'). Both
should be flat in the step number: a step's ledger work is proportional to its own
sessions. Reports the least-squares slope of each against the step, the mean of the
first and last quarter of the steps, and their ratio. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """seed = {seed}
[tasks]
name = "tools"
train_size = 6
heldout_size = 1
time_limit_s = 120
[rollout]
group_size = 2
tasks_per_step = 3
max_turns = 3
max_tokens = 48
context_budget = 4096
sandbox = "{sandbox}"
[warmstart]
steps = 5
[rl]
steps = {steps}
[schedule]
policy = "colocated"
devices = 2
groups_per_device = 1
[eval]
every = 1000
samples = 1
"""


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def figures(steps: list[int], values: list[float]) -> dict[str, float]:
    q = max(1, len(values) // 4)
    first, last = sum(values[:q]) / q, sum(values[-q:]) / q
    return {"slope_per_step": round(slope([float(s) for s in steps], values), 5),
            "first_quarter_mean": round(first, 4), "last_quarter_mean": round(last, 4),
            "last_over_first": round(last / first, 3) if first else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sandbox", default="bwrap", choices=["bwrap", "local"])
    ap.add_argument("--out", type=Path, default=None, help="the run directory (default: a "
                    "temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "run"
        cfg = Path(tmp) / "steps_flat.toml"
        cfg.write_text(CONFIG.format(seed=args.seed, steps=args.steps, sandbox=args.sandbox))
        t0 = time.perf_counter()
        tidal = str(Path(sys.executable).parent / "tidal")
        subprocess.run([tidal, "run", str(cfg), "--out", str(out)], check=True,
                       cwd=ROOT, env=os.environ, stdout=subprocess.DEVNULL)
        minutes = (time.perf_counter() - t0) / 60
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rl = [r for r in rows if r.get("phase") == "rl"]
    steps = [int(r["step"]) for r in rl]
    wall = [float(r["rollout_s"]) + float(r["train_s"]) for r in rl]
    reads = [float(r["ledger_rows_read"]) for r in rl]
    result: dict[str, Any] = {
        "steps": len(rl), "minutes": round(minutes, 2),
        "step_wall_s": figures(steps, wall),
        "ledger_rows_read": figures(steps, reads),
        "per_step": [{"step": s, "wall_s": round(w, 3), "ledger_rows_read": int(n)}
                     for s, w, n in zip(steps, wall, reads, strict=True)],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
