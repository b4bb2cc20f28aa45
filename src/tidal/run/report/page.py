"""The report's HTML: headline figures, the summary as named fields, the charts, the
sample session trees, and the config, in one self-contained page (inline SVG and CSS,
no script, nothing fetched)."""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.run.report import charts
from tidal.run.report.data import (
    Run,
    heldout_curve,
    keyed_series,
    load_run,
    series,
    status_rates,
    time_split,
)

_CSS = """
:root{--ink:#111827;--muted:#6b7280;--line:#e5e7eb;--card:#fff;--bg:#f8fafc}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--ink);
background:var(--bg);margin:0;padding:24px 32px 48px}
header h1{font-size:22px;margin:0 0 2px}header p{margin:0;color:var(--muted)}
h2{font-size:16px;margin:28px 0 10px}
.tiles{display:flex;flex-wrap:wrap;gap:12px;margin-top:18px}
.tile{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 14px;
min-width:150px}.tile b{display:block;font-size:20px}.tile>span{color:var(--muted);font-size:12px}
.good{color:#15803d}.bad{color:#b91c1c}
.cols{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
table{border-collapse:collapse;background:var(--card);border:1px solid var(--line);
border-radius:8px}
th,td{padding:5px 12px;text-align:left;border-bottom:1px solid var(--line);vertical-align:top}
th{font-weight:600;white-space:nowrap}td.n{text-align:right;font-variant-numeric:tabular-nums}
caption{text-align:left;font-weight:600;padding:0 0 6px}
thead th{background:#f3f4f6;font-size:12px;color:#374151}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:16px}
figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:12px 14px}
figcaption{font-weight:600;margin-bottom:4px}figcaption small{display:block;font-weight:400;
color:var(--muted)}
svg.chart{width:100%;height:auto;display:block}
pre{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px;
overflow:auto;font-size:12px}
details summary{cursor:pointer;color:#374151}
a{color:#1d4ed8}
"""


def _e(s: object) -> str:
    return html.escape(str(s), quote=True)


def _pct(v: Any) -> str:
    return f"{v:.1%}" if isinstance(v, int | float) else "–"


def _count(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else _e(v)


def _minutes(v: Any) -> str:
    if not isinstance(v, int | float):
        return "–"
    return f"{v:.1f} min" if v < 120 else f"{v / 60:.1f} h"


def _verify(v: Any) -> str:
    if v is None:
        return "–"
    return '<span class="good">ok</span>' if v else '<span class="bad">problems found</span>'


def _pairs(v: Any, unit: str = "") -> str:
    if isinstance(v, dict):
        return ", ".join(f"{_e(str(k).replace('_', ' '))}: {_count(x)}{unit}"
                         for k, x in v.items()) or "none"
    return _e(v)


def _seconds_list(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(f"{x:.1f} s" for x in v)
    return _e(v)


def _staleness(v: Any) -> str:
    if not isinstance(v, dict) or not v:
        return "none trained stale" if isinstance(v, dict) else _e(v)
    return ", ".join(f"{_count(n)} group{'s' * (n != 1)} {k} behind"
                     for k, n in sorted(v.items(), key=lambda kv: int(kv[0])))


SUMMARY_FIELDS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("success_rate_start", "Held-out success after the warm start", _pct),
    ("success_rate_end", "Held-out success at the end", _pct),
    ("steps", "RL steps", _count),
    ("policy_version", "Policy version", _count),
    ("sessions", "RL sessions trained", _count),
    ("minutes", "Wall clock (resumes included)", _minutes),
    ("drift_tokens", "Trained tokens that differ from the sampled ones", _count),
    ("verify_ok", "tidal verify", _verify),
]
SCHEDULE_FIELDS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("schedule_policy", "Policy", _e),
    ("device_utilization", "Device utilisation", _pct),
    ("role_switches", "Role switches", _pairs),
    ("idle_s_per_device", "Idle time per device", _seconds_list),
    ("stale_groups_dropped", "Stale groups dropped", _count),
    ("staleness_trained", "Staleness of trained groups", _staleness),
]


def _table(caption: str, fields: list[tuple[str, str, Callable[[Any], str]]],
           values: dict[str, Any], extra: dict[str, str] | None = None) -> str:
    rows = [f"<tr><th>{_e(label)}</th><td>{fmt(values[key])}</td></tr>"
            for key, label, fmt in fields if key in values]
    rows += [f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in (extra or {}).items()]
    known = {k for k, _, _ in fields} | {"heldout_curve", "schedule"}
    rows += [f"<tr><th>{_e(k)}</th><td>{_e(json.dumps(v))}</td></tr>"
             for k, v in values.items() if k not in known]
    return f"<table><caption>{_e(caption)}</caption>{''.join(rows)}</table>"


def _tiles(run: Run) -> str:
    s = run.summary
    curve = heldout_curve(run)
    start = s.get("success_rate_start", curve[0][1] if curve else None)
    end = s.get("success_rate_end", curve[-1][1] if len(curve) > 1 else None)
    tiles = []
    if isinstance(start, int | float) and isinstance(end, int | float):
        d = end - start
        cls = "good" if d > 0 else "bad" if d < 0 else ""
        tiles.append((f'{start:.0%} &rarr; {end:.0%} <small class="{cls}">'
                      f"({d * 100:+.0f} pts)</small>", "held-out success, start &rarr; end"))
    rl = run.phase("rl")
    steps = s.get("steps", rl[-1]["step"] if rl else 0)
    tiles.append((_count(steps), "RL steps"))
    if "minutes" in s:
        tiles.append((_minutes(s["minutes"]), "wall clock"))
    tok = [float(r["rollout_tokens_per_s"]) for r in rl if r.get("rollout_tokens_per_s")]
    if tok:
        tiles.append((f"{sum(tok) / len(tok):,.0f}", "sampled tokens/s, mean per step"))
    if "verify_ok" in s:
        tiles.append((_verify(s["verify_ok"]), "tidal verify"))
    return '<div class="tiles">' + "".join(
        f'<div class="tile"><b>{v}</b><span>{label}</span></div>' for v, label in tiles) + "</div>"


def build_charts(run: Run) -> list[charts.Chart]:
    ev, rl = run.phase("eval"), run.phase("rl")
    trained = [r for r in rl if r.get("tokens")]  # steps whose batch had signal to train
    steps = [float(r["step"]) for r in rl]
    checks = {f"check: {k}": v for k, v in keyed_series(ev, "checks").items()}
    return [
        charts.line_chart(
            "heldout", "Held-out success, and the checks passed",
            {"success": heldout_curve(run), **checks}, y_label="held-out episodes",
            percent=True,
            note="success: reward 1; check: the share of held-out episodes passing each "
                 "kind of check"),
        charts.line_chart(
            "reward", "Training reward",
            {"mean reward": series(rl, "reward_mean"),
             "success rate": series(rl, "success_rate"),
             "partial score": series(rl, "partial_mean")},
            y_label="mean over the step's episodes", smooth=True),
        charts.stacked_bars(
            "statuses", "How RL episodes ended", status_rates(rl), y_label="episodes",
            percent=True, colours=charts.STATUS_COLOURS,
            note="the share of each step's episodes by final status"),
        charts.line_chart(
            "throughput", "Tokens per second",
            {"rollout: sampled": series(rl, "rollout_tokens_per_s"),
             "training: path tokens": series(trained, "train_tokens_per_s")},
            y_label="tokens / s", log_if_spread=True, smooth=True, steps=steps,
            note="rollout: tokens the engine sampled for the step's batch over the span of "
                 "its calls; training: tokens trained (summed over paths) per second of "
                 "training, on steps that trained"),
        charts.stacked_bars(
            "step_time", "Seconds per RL step",
            {"rollout (trainer waiting)": series(rl, "rollout_s"),
             "training": series(rl, "train_s")}, y_label="seconds",
            note="under elastic or async scheduling rollouts overlap training: the rollout "
                 "part is only the trainer's wait"),
        charts.panels_chart(
            "mismatch", "Train/inference mismatch",
            {"k3 KL (nats)": series(trained, "k3_kl"),
             "mean |Δ log p|": series(trained, "mean_abs_logprob_diff")},
            note="between the engine's sampling log-probabilities and the trainer's, on "
                 "the trained tokens of steps that trained", steps=steps),
        charts.split_bar("time", "Where the wall clock went", time_split(run)),
    ]


def _figure(c: charts.Chart) -> str:
    note = f"<small>{_e(c.note)}</small>" if c.note else ""
    return (f'<figure id="chart-{_e(c.key)}" data-chart="{_e(c.key)}">'
            f"<figcaption>{_e(c.title)}{note}</figcaption>{c.svg}</figure>")


def _trees(run: Run, link_base: str) -> str:
    if not run.trees:
        return "<p>No sample trees in this run.</p>"
    index_path = run.run_dir / "trees" / "index.json"
    index: dict[str, Any] = json.loads(index_path.read_text()) if index_path.exists() else {}
    rows = []
    for p in run.trees:
        info = index.get(p.stem, {})
        edges = ", ".join(f"{k} {v}" for k, v in sorted((info.get("edges") or {}).items())
                          if k != "continuation" and v) or "–"
        reward = info.get("reward")
        rows.append(
            f'<tr><td><a href="{_e(link_base + p.name)}">{_e(p.stem)}</a></td>'
            f"<td>{_e(info.get('status', '–'))}</td>"
            f'<td class="n">{"–" if reward is None else f"{reward:.2f}"}</td>'
            f'<td class="n">{_e(info.get("sessions", "–"))}</td>'
            f'<td class="n">{_e(info.get("calls", "–"))}</td><td>{_e(edges)}</td></tr>')
    return ("<table><thead><tr><th>episode</th><th>status</th><th>reward</th>"
            "<th>sessions</th><th>calls</th><th>branches (edges)</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")


def render_report(run_dir: Path, *, trees_href: str = "trees/") -> str:
    """The page; `trees_href` is where the tree pages are, relative to the page."""
    run = load_run(run_dir)
    s = run.summary
    first = run.rows[0].get("time") if run.rows else None
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(first)) if first else ""
    cfg = run.config
    facts = [when,
             f"model {cfg.get('model', {}).get('name', '?')}",
             f"tasks {cfg.get('tasks', {}).get('source', '?')}",
             f"{cfg.get('schedule', {}).get('policy', '?')} schedule"] if cfg else [when]
    summary = (_table("Run", SUMMARY_FIELDS, s, extra={
        "Held-out curve": '<a href="#chart-heldout">chart: held-out success</a>'
                          f" ({len(heldout_curve(run))} evaluations)"})
               if s else "<p>No summary.json: the run has not finished.</p>")
    schedule = _table("Schedule", SCHEDULE_FIELDS, s["schedule"]) if s.get("schedule") else ""
    config_text = (run.run_dir / "config.toml").read_text() if cfg else ""
    config = (f"<h2>Config</h2><details><summary>config.toml</summary><pre>"
              f"{_e(config_text)}</pre></details>") if config_text else ""
    figures = "".join(_figure(c) for c in build_charts(run))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>tidal run {_e(run_dir.name)}</title><style>{_CSS}</style></head><body>
<header><h1>tidal run {_e(run_dir.name)}</h1>
<p>{_e(" · ".join(f for f in facts if f))} · <code>{_e(run_dir)}</code></p>
{_tiles(run)}</header>
<h2>Summary</h2><div class="cols">{summary}{schedule}</div>
<h2>Curves</h2><div class="grid">{figures}</div>
<h2>Sample session trees</h2>{_trees(run, trees_href)}
{config}
</body></html>
"""


def write_report(run_dir: Path, out: Path) -> Path:
    """Writes the page to `out`; its tree links are relative to where it is written."""
    rel = os.path.relpath((run_dir / "trees").resolve(), out.resolve().parent)
    out.write_text(render_report(run_dir, trees_href=Path(rel).as_posix() + "/"),
                   encoding="utf-8")
    return out
