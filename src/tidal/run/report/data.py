"""What the report reads out of a run directory, as plain series and tables: no drawing,
no HTML, so each figure's numbers can be tested on their own.

A series is a list of (x, y); x is the RL step (an evaluation at step s ran after s RL
steps). Rates are fractions in [0, 1].
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Series = list[tuple[float, float]]


@dataclass(frozen=True)
class Run:
    """Everything the report draws: metrics rows, summary.json, config.toml, tree pages."""

    run_dir: Path
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    trees: list[Path]

    def phase(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("phase") == name]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: is it a tidal run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(run_dir: Path) -> Run:
    rows = read_metrics(run_dir)
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.toml"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    try:
        config = tomllib.loads(config_path.read_text()) if config_path.exists() else {}
    except tomllib.TOMLDecodeError:
        config = {}
    trees_dir = run_dir / "trees"
    trees = sorted(trees_dir.glob("*.html")) if trees_dir.is_dir() else []
    return Run(run_dir, rows, summary, config, trees)


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def series(rows: list[dict[str, Any]], key: str) -> Series:
    """(step, row[key]) of the rows that have a number there."""
    return [(float(r["step"]), float(r[key])) for r in rows if _num(r.get(key))]


def keyed_series(rows: list[dict[str, Any]], key: str) -> dict[str, Series]:
    """For a dict-valued column (`checks`, `statuses`): one series per entry."""
    out: dict[str, Series] = {}
    for r in rows:
        for name, v in (r.get(key) or {}).items():
            if _num(v):
                out.setdefault(str(name), []).append((float(r["step"]), float(v)))
    return dict(sorted(out.items()))


def status_rates(rl_rows: list[dict[str, Any]]) -> dict[str, Series]:
    """Per RL step, the fraction of its episodes that ended in each status (`statuses`
    holds counts); a status absent from a step is 0 there."""
    names = sorted({s for r in rl_rows for s in (r.get("statuses") or {})},
                   key=lambda s: (s != "complete", s))
    out: dict[str, Series] = {s: [] for s in names}
    for r in rl_rows:
        counts = r.get("statuses") or {}
        total = sum(counts.values())
        if not total:
            continue
        for s in names:
            out[s].append((float(r["step"]), counts.get(s, 0) / total))
    return out


def time_split(run: Run) -> dict[str, float]:
    """Seconds of the run by phase. Under elastic/async scheduling rollouts overlap
    training; then "rollout" is only the time the trainer waited for its batch. What
    summary.json's wall clock holds beyond the phases (start-up, checkpoints, the final
    verify) is "other"."""
    parts = {
        "warm start": sum(float(r.get("seconds") or 0.0) for r in run.phase("warmstart")),
        "rollout (trainer waiting)": sum(float(r.get("rollout_s") or 0.0)
                                         for r in run.phase("rl")),
        "training": sum(float(r.get("train_s") or 0.0) for r in run.phase("rl")),
        "evaluation": sum(float(r.get("seconds") or 0.0) for r in run.phase("eval")),
    }
    minutes = run.summary.get("minutes")
    if isinstance(minutes, int | float) and minutes * 60 > sum(parts.values()):
        parts["other (start-up, checkpoints, verify)"] = minutes * 60 - sum(parts.values())
    return parts


def heldout_curve(run: Run) -> Series:
    """summary.json's held-out curve, or the evaluation rows' when there is no summary."""
    curve = run.summary.get("heldout_curve")
    if curve:
        return [(float(s), float(v)) for s, v in curve]
    return series(run.phase("eval"), "success_rate")
